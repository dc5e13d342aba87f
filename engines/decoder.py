"""The decoder, written once against a small array-ops layer: numpy (engines/numpy_engine.py) or MLX
(engines/mlx_engine.py), in the style of mlx-lm's model files.

Attention (standard with grouped KV heads, and DeepSeek's latent attention in its absorbed form), RMSNorm,
RoPE with YaRN, the KV cache, dense MLPs and the forward pass are here. What a backend adds is its array
module `xp`, four conversions (`W`, `to_numpy`, `from_numpy`, `sync`, `scalar`) and an expert-compute object:
how the routed experts of a layer are computed once the streamer has brought them in.

Non-expert tensors are held in memory (dequantized at load); experts come through the ExpertStreamer, which
reads them from the pack on demand or ahead of time. The hooks (predictor, router hook, projection deltas)
are engines/base.py's: they see numpy `x`, `h` and `logits` whatever the backend.
"""
from __future__ import annotations

import math
import time

import numpy as np

from engines.base import Engine
from engines.hybrid import GatedDeltaNet
from workbench.errors import WorkbenchError
from workbench.routing import route, topk_desc
from workbench.spec import yarn_mscale


def rope_table(positions: int, spec):
    """cos and sin for every position, HF rotate-half convention: (positions, rope_dim) each."""
    hd, theta, yarn = spec.rope_dim, spec.rope_theta, spec.rope_yarn
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    scale = 1.0
    if yarn:    # YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between
        def dim_of(rotations):
            return hd * math.log(yarn["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(yarn["beta_fast"]), dim_of(yarn["beta_slow"])
        if yarn["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        keep = 1 - np.clip((np.arange(hd // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
        inv = (inv / np.float32(yarn["factor"])) * (1 - keep) + inv * keep
        scale = yarn["attention_factor"]
    f = np.outer(np.arange(positions, dtype=np.float32), inv)
    f = np.concatenate([f, f], -1)
    return np.cos(f) * np.float32(scale), np.sin(f) * np.float32(scale)


def latent_softmax_scale(spec) -> float:
    """1/sqrt(head_dim), times DeepSeek's YaRN mscale squared (transformers' yarn_apply_mscale)."""
    scale = 1.0 / math.sqrt(spec.head_dim)
    if spec.rope_yarn and spec.rope_yarn["mscale_all_dim"]:
        scale *= yarn_mscale(spec.rope_yarn["factor"], spec.rope_yarn["mscale_all_dim"]) ** 2
    return scale


def deinterleave(x):
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved RoPE pairs in rotate-half order.
    Queries and keys move alike, so their dot products are those of the interleaved rotation."""
    return x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(x.shape)


def kv_shapes(spec):
    """Per layer, the (heads, dim) of the two cached streams: keys and values, or for latent attention the
    normalised latent and the shared rotary key."""
    if spec.attention == "mla":
        return (1, spec.kv_lora_rank), (1, spec.qk_rope_head_dim)
    return (spec.num_kv_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)


class Decoder(GatedDeltaNet, Engine):
    xp = np                     # the array module

    def W(self, name: str):
        """Weight `name` as the backend computes with it (self.w holds the numpy arrays)."""
        return self.w[name]

    def linear(self, x, name: str):
        """x W^T for the projection `name` (a backend may keep W encoded and compute from its bytes)."""
        return x @ self.W(name).T

    def to_numpy(self, a):
        return a

    def from_numpy(self, a):
        """A hook's numpy result (a projection delta) as a backend array."""
        return a

    def sync(self, *arrays):
        """Wait for lazily evaluated arrays (MLX), so that clocks measure the work."""

    def scalar(self, v: float):
        """A float32 constant as the backend multiplies arrays by it."""
        return np.float32(v)

    def setup(self, weights, max_context, experts):
        """The part of a backend's constructor that every backend shares."""
        self.w = weights
        if self.spec.attention == "mla":
            self.latent_scale = self.scalar(latent_softmax_scale(self.spec))
        self.max_context = max_context or self.spec.max_position_embeddings
        self.experts = experts
        self.rope_to(256)                       # grows with the context
        self.reset()

    def rope_to(self, n: int):
        self.cos, self.sin = rope_table(n, self.spec)
        self.cos_b, self.sin_b = self.from_numpy(self.cos), self.from_numpy(self.sin)

    def reset(self):
        """An empty KV cache; its buffers grow by doubling, so a decode step copies nothing."""
        (hk, dk), (hv, dv) = kv_shapes(self.spec)
        xp = self.xp
        self.kv = [[xp.zeros((hk, 64, dk), dtype=xp.float32), xp.zeros((hv, 64, dv), dtype=xp.float32)]
                   for _ in range(self.spec.num_layers)]
        self.pos = 0
        self.hidden, self.hidden_start = None, 0     # the last forward's hidden states (forward)
        self.reset_linear()

    def kv_room(self, i: int, end: int):
        """Layer i's KV buffers, grown (doubling) to hold `end` positions."""
        K, V = self.kv[i]
        if end > K.shape[1]:
            grow = max(end, 2 * K.shape[1])
            K2, V2 = (self.xp.zeros((a.shape[0], grow, a.shape[2]), dtype=self.xp.float32) for a in (K, V))
            K2[:, :self.pos], V2[:, :self.pos] = K[:, :self.pos], V[:, :self.pos]
            K, V = K2, V2
            self.kv[i] = [K, V]
        return K, V

    def kv_append(self, i: int, k, v):
        end = self.pos + k.shape[1]
        K, V = self.kv_room(i, end)
        K[:, self.pos:end], V[:, self.pos:end] = k, v
        return K[:, :end], V[:, :end]

    # ------------------------------------------------------------ blocks

    def rms_norm(self, x, w):
        x32 = x.astype(self.xp.float32)     # sum / n: np.mean's bits without its Python overhead
        ms = (x32 * x32).sum(axis=-1, keepdims=True) / x32.shape[-1]
        return w * (x32 / self.xp.sqrt(ms + self.spec.rms_norm_eps))

    def silu(self, x):
        return x / (1.0 + self.xp.exp(-x))

    def rope(self, x, cos, sin):
        """x: (heads, T, hd); cos, sin: (T, rope_dim): a partial rotary passes the rest of each head through."""
        if cos.shape[-1] < x.shape[-1]:
            return self.xp.concatenate([self.rope(x[..., :cos.shape[-1]], cos, sin), x[..., cos.shape[-1]:]], axis=-1)
        h = x.shape[-1] // 2
        return x * cos + self.xp.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin

    def causal_softmax(self, att, T):
        """Softmax over the last axis (S keys) of T new queries, each blind to the keys after its own."""
        S = att.shape[-1]
        if T > 1:
            future = np.arange(S)[None, :] > (S - T + np.arange(T))[:, None]
            att = self.xp.where(self.from_numpy(future), -np.inf, att)
        att = self.xp.exp(att - att.max(-1, keepdims=True))
        return att / att.sum(-1, keepdims=True)

    def delta(self, name, x, y):
        """y = x W^T plus the unmerged adapter's delta for projection `name`, if it has one."""
        return y + self.from_numpy(self.deltas[name](self.to_numpy(x))) if name in self.deltas else y

    def attention(self, i: int, x):
        if self.spec.attention == "mla":
            return self.latent_attention(i, x)
        if self.spec.is_linear(i):
            return self.gated_delta_net(i, x)
        s, W, p = self.spec, self.W, f"layers.{i}."
        T = x.shape[0]
        q, k, v = self.linear(x, p + "q"), self.linear(x, p + "k"), self.linear(x, p + "v")
        if self.deltas:
            q, k, v = (self.delta(p + n, x, a) for n, a in zip("qkv", (q, k, v)))
        if s.attn_output_gate:      # each query head is followed by as many gate dims for its output
            q, gate = (a.reshape(T, -1) for a in self.xp.split(q.reshape(T, s.num_heads, 2 * s.head_dim), 2, axis=-1))
        if s.attention_bias:
            q, k, v = q + W(p + "q_bias"), k + W(p + "k_bias"), v + W(p + "v_bias")
        if s.qk_norm == "full":
            q, k = self.rms_norm(q, W(p + "q_norm")), self.rms_norm(k, W(p + "k_norm"))
        if s.clip_qkv is not None:
            q, k, v = (self.xp.clip(a, -s.clip_qkv, s.clip_qkv) for a in (q, k, v))
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)
        k = k.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = v.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        if s.qk_norm == "head":
            q, k = self.rms_norm(q, W(p + "q_norm")), self.rms_norm(k, W(p + "k_norm"))
        cos, sin = self.cos_b[self.pos:self.pos + T], self.sin_b[self.pos:self.pos + T]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        K, V = self.kv_append(i, k, v)
        S, rep = K.shape[1], s.num_heads // s.num_kv_heads
        q = q.reshape(s.num_kv_heads, rep * T, s.head_dim)       # grouped query heads share their KV head
        att = (q @ K.transpose(0, 2, 1)).reshape(s.num_kv_heads, rep, T, S) * self.scalar(1.0 / np.sqrt(s.head_dim))
        att = self.causal_softmax(att, T)
        y = (att.reshape(s.num_kv_heads, rep * T, S) @ V).reshape(s.num_heads, T, s.head_dim)
        y = y.transpose(1, 0, 2).reshape(T, -1)
        if s.attn_output_gate:
            y = y / (1.0 + self.xp.exp(-gate))
        return self.delta(p + "o", y, self.linear(y, p + "o"))

    def latent_attention(self, i: int, x):
        """DeepSeek's MLA in its absorbed form: the cache holds the normalised latent c and the rotary key;
        q_nope @ k_b scores against c directly, and the weighted latents are lifted to values by v_b."""
        s, W, p = self.spec, self.W, f"layers.{i}."
        T, nope = x.shape[0], s.qk_nope_head_dim
        q = self.linear(x, p + "q") if not s.q_lora_rank else \
            self.linear(self.rms_norm(self.linear(x, p + "q_a"), W(p + "q_a_norm")), p + "q_b")
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)              # (H, T, nope+rope)
        ckv = self.linear(x, p + "kv_a")                                              # (T, latent+rope)
        c = self.rms_norm(ckv[:, :s.kv_lora_rank], W(p + "kv_a_norm"))
        cos, sin = self.cos_b[self.pos:self.pos + T], self.sin_b[self.pos:self.pos + T]
        q_pe = self.rope(deinterleave(q[..., nope:]), cos, sin)
        k_pe = self.rope(deinterleave(ckv[None, :, s.kv_lora_rank:]), cos, sin)
        C, K_pe = self.kv_append(i, c[None], k_pe)
        att = (q[..., :nope] @ W(p + "k_b")) @ C[0].T + q_pe @ K_pe[0].T         # (H, T, S)
        att = self.causal_softmax(att * self.latent_scale, T)
        y = (att @ C[0]) @ W(p + "v_b").transpose(0, 2, 1)                       # (H, T, v)
        return self.linear(y.transpose(1, 0, 2).reshape(T, -1), p + "o")

    def route(self, i: int, logits, ctx) -> tuple:
        """Layer i's (expert ids, mixing weights): the router hook's where the session gave one (the preset's
        routing: a Router of workbench.designs (smol_bias's CacheBias), Edge0's prerouter, a trace), else the exact router with the
        checkpoint's selection correction."""
        if self.router_hook is not None:
            return self.router_hook(i, logits, ctx)
        return route(self.spec, logits, self.w.get(f"layers.{i}.router_bias"))

    def routers(self, x, h, name: str, wanted: dict) -> tuple:
        """Router `name`'s logits on x (numpy), and for each later layer t the predictor wants ({t: (norm, bias,
        k)}: Predictor.routers) router_top(h, norm, layer t's router, bias, k): a MoE layer's routing and its
        lookahead, in one call where the backend computes them side by side (the packed engine)."""
        return (self.to_numpy(self.linear(x, name)),
                {t: self.router_top(h, norm, f"layers.{t}.router", bias, k) for t, (norm, bias, k) in wanted.items()})

    def router_top(self, h, norm, name: str, bias, k: int) -> np.ndarray:
        """The k experts router `name` ranks first on each row of h RMS-normed with weight `norm`, its selection
        bias added, best first (the lookahead: a later layer's router on this layer's residual)."""
        return topk_desc(self.to_numpy(self.linear(self.rms_norm(h, norm), name)) + bias, k)

    def mlp(self, x, gate, up, down):
        return (self.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def dense_mlp(self, x, p: str):
        """A resident MLP (a dense layer's, a shared expert) by its weights' names."""
        return self.linear(self.silu(self.linear(x, p + "gate")) * self.linear(x, p + "up"), p + "down")

    def moe(self, i: int, x, h, phase: str):
        """Route (the router hook, else the exact router), let the streamer bring the experts in (its predictor's
        prefetches started first), and let the backend's expert-compute object compute and sum them (those the
        router marks for the low tier from their low-precision copies, while the reads are in flight); the shared
        expert is added here."""
        s, p = self.spec, f"layers.{i}."
        t0 = time.perf_counter()
        later = getattr(self.predictor, "routers", None) if phase == "decode" else None     # Predictor.routers
        wanted = later(i) if later else {}
        logits, tops = self.routers(x, h, p + "router", wanted)
        ctx = {"x": self.to_numpy(x), "h": self.to_numpy(h), "logits": logits, "tops": tops, "phase": phase,
               "engine": self}
        idx, weights, *low = self.route(i, ctx["logits"], ctx)
        low = low[0] if low else None           # the choices computed from the low tier (a router's third array)
        if low is not None and self.low is None:
            raise WorkbenchError(f"layer {i}: the router marked choices for a low tier, and it declares none (its "
                                 f"`low`: q2 or q3)")
        lows = sorted(set(idx[low].tolist())) if low is not None else []
        if lows:                                # an expert marked on any row is computed from the tier on every row
            low = np.isin(idx, lows)
        step = self.streamer.begin_layer(i, idx, self.token_index, ctx, self.predictor, t0, low)
        compute = self.experts.begin(i, x, idx, weights)
        self.streamer.run_layer(step, compute, (lambda: self.experts.compute_low(lows)) if lows else None)
        t0 = time.perf_counter()
        ev = step.ev
        out = self.experts.combine(sorted({*step.needed, *lows}) if lows else step.needed)
        if s.shared_expert_size:
            y = self.dense_mlp(x, p + "shared.")
            if s.shared_expert_gate:
                y = y / (1.0 + self.xp.exp(-self.linear(x, p + "shared_gate")))
            out = out + y
        self.sync(out)
        ev.compute_s += time.perf_counter() - t0
        ev.t_end = time.perf_counter()
        self.tel.add_event(ev)
        return out

    # ------------------------------------------------------------ forward

    def forward(self, ids, phase: str) -> np.ndarray:
        """Run tokens `ids` at the current position (extending the KV cache); returns numpy logits (T, vocab)."""
        s, W = self.spec, self.W
        ids = np.asarray(ids, dtype=np.int64)
        if self.pos + len(ids) > self.max_context:
            raise WorkbenchError(f"context of {self.pos + len(ids)} tokens exceeds the model's {self.max_context}")
        if self.pos + len(ids) > len(self.cos):
            self.rope_to(max(self.pos + len(ids), 2 * len(self.cos)))
        clock = time.perf_counter
        t0 = clock()
        x = self.embed(ids)
        for i in range(s.num_layers):
            p = f"layers.{i}."
            x = x + self.attention(i, self.rms_norm(x, W(p + "attn_norm")))
            xn = self.rms_norm(x, W(p + "mlp_norm"))
            if i in s.dense_layers:
                x = x + self.dense_mlp(xn, p + "dense.")
            else:
                self.sync(x, xn)                # the dense work is done before the layer's clock starts
                self.dense_compute_s += clock() - t0
                x = x + self.moe(i, xn, x, phase)
                t0 = clock()
        self.hidden, self.hidden_start = x, self.pos      # the last hidden states, before the final norm (MTP's input)
        self.pos += len(ids)
        logits = self.to_numpy(self.linear(self.rms_norm(x, W("norm")), "lm_head"))
        self.dense_compute_s += clock() - t0
        return logits

    def embed(self, ids: np.ndarray):
        return self.w["embed"][ids].astype(np.float32)
