"""The numpy reference engine: exact fp32 decoder for every supported family.

Non-expert tensors are held in memory (dequantized at load); experts come through the
ExpertStreamer, which reads them from the pack on demand or ahead of time. The interface and its
hooks (predictor, router hook, projection deltas) are engines/base.py's.
"""
from __future__ import annotations

import math
import time

import numpy as np
from threadpoolctl import threadpool_limits

from engines.base import Engine, Hooks, dense_weights
from workbench.streamer import ExpertStreamer
from workbench.errors import WorkbenchError
from workbench.spec import yarn_mscale
from workbench.store.pack import Pack
from workbench.telemetry import Telemetry


def rms_norm(x, w, eps):
    x32 = x.astype(np.float32)
    return w * (x32 / np.sqrt((x32 * x32).mean(-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


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


def rope(x, cos, sin):
    """x: (heads, T, hd); cos, sin: (T, hd)."""
    h = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin


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


def causal_softmax(att, T):
    """Softmax over the last axis (S keys) of T new queries, each blind to the keys after its own."""
    S = att.shape[-1]
    if T > 1:
        att = np.where(np.arange(S)[None, :] > (S - T + np.arange(T))[:, None], -np.inf, att)
    att = np.exp(att - att.max(-1, keepdims=True))
    return att / att.sum(-1, keepdims=True)


class NumpyEngine(Engine):
    name = "numpy"

    def __init__(self, pack: Pack, streamer: ExpertStreamer, telemetry: Telemetry, hooks: Hooks = Hooks(),
                 weights: dict | None = None, max_context: int | None = None):
        super().__init__(pack, streamer, telemetry, hooks)
        self.w = dense_weights(pack) if weights is None else weights
        if self.spec.attention == "mla":
            self.latent_scale = np.float32(latent_softmax_scale(self.spec))
        self.max_context = max_context or self.spec.max_position_embeddings
        self.cos, self.sin = rope_table(256, self.spec)  # grows with the context
        # Decode matmuls are tiny: one BLAS thread is faster, and leaves the other cores to the reader pool.
        threadpool_limits(limits=1, user_api="blas")
        self.reset()

    def reset(self):
        """An empty KV cache; its buffers grow by doubling, so a decode step copies nothing."""
        (hk, dk), (hv, dv) = kv_shapes(self.spec)
        self.kv = [(np.zeros((hk, 64, dk), np.float32), np.zeros((hv, 64, dv), np.float32))
                   for _ in range(self.spec.num_layers)]
        self.pos = 0

    def _kv_append(self, i: int, k, v):
        K, V = self.kv[i]
        end = self.pos + k.shape[1]
        if end > K.shape[1]:
            grow = max(end, 2 * K.shape[1])
            K2, V2 = (np.zeros((a.shape[0], grow, a.shape[2]), np.float32) for a in (K, V))
            K2[:, :self.pos], V2[:, :self.pos] = K[:, :self.pos], V[:, :self.pos]
            K, V = K2, V2
            self.kv[i] = (K, V)
        K[:, self.pos:end], V[:, self.pos:end] = k, v
        return K[:, :end], V[:, :end]

    # ------------------------------------------------------------ blocks

    def attention(self, i: int, x: np.ndarray) -> np.ndarray:
        if self.spec.attention == "mla":
            return self.latent_attention(i, x)
        s, w, p = self.spec, self.w, f"layers.{i}."
        T = x.shape[0]
        q, k, v = x @ w[p + "q"].T, x @ w[p + "k"].T, x @ w[p + "v"].T
        if self.deltas:
            q, k, v = (a + self.deltas[p + n](x) if p + n in self.deltas else a for n, a in zip("qkv", (q, k, v)))
        if s.attention_bias:
            q, k, v = q + w[p + "q_bias"], k + w[p + "k_bias"], v + w[p + "v_bias"]
        if s.qk_norm == "full":
            q, k = rms_norm(q, w[p + "q_norm"], s.rms_norm_eps), rms_norm(k, w[p + "k_norm"], s.rms_norm_eps)
        if s.clip_qkv is not None:
            q, k, v = (np.clip(a, -s.clip_qkv, s.clip_qkv) for a in (q, k, v))
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)
        k = k.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = v.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        if s.qk_norm == "head":
            q, k = rms_norm(q, w[p + "q_norm"], s.rms_norm_eps), rms_norm(k, w[p + "k_norm"], s.rms_norm_eps)
        cos, sin = self.cos[self.pos:self.pos + T], self.sin[self.pos:self.pos + T]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        K, V = self._kv_append(i, k, v)
        S, rep = K.shape[1], s.num_heads // s.num_kv_heads
        q = q.reshape(s.num_kv_heads, rep * T, s.head_dim)       # grouped query heads share their KV head
        att = (q @ K.transpose(0, 2, 1)).reshape(s.num_kv_heads, rep, T, S) * np.float32(1.0 / np.sqrt(s.head_dim))
        att = causal_softmax(att, T)
        y = (att.reshape(s.num_kv_heads, rep * T, S) @ V).reshape(s.num_heads, T, s.head_dim)
        y = y.transpose(1, 0, 2).reshape(T, -1)
        out = y @ w[p + "o"].T
        return out + self.deltas[p + "o"](y) if p + "o" in self.deltas else out

    def latent_attention(self, i: int, x: np.ndarray) -> np.ndarray:
        """DeepSeek's MLA in its absorbed form: the cache holds the normalised latent c and the rotary key;
        q_nope @ k_b scores against c directly, and the weighted latents are lifted to values by v_b."""
        s, w, p = self.spec, self.w, f"layers.{i}."
        T, nope = x.shape[0], s.qk_nope_head_dim
        q = x @ w[p + "q"].T if not s.q_lora_rank else \
            rms_norm(x @ w[p + "q_a"].T, w[p + "q_a_norm"], s.rms_norm_eps) @ w[p + "q_b"].T
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)              # (H, T, nope+rope)
        ckv = x @ w[p + "kv_a"].T                                               # (T, latent+rope)
        c = rms_norm(ckv[:, :s.kv_lora_rank], w[p + "kv_a_norm"], s.rms_norm_eps)
        cos, sin = self.cos[self.pos:self.pos + T], self.sin[self.pos:self.pos + T]
        q_pe = rope(deinterleave(q[..., nope:]), cos, sin)
        k_pe = rope(deinterleave(ckv[None, :, s.kv_lora_rank:]), cos, sin)
        C, K_pe = self._kv_append(i, c[None], k_pe)
        att = (q[..., :nope] @ w[p + "k_b"]) @ C[0].T + q_pe @ K_pe[0].T         # (H, T, S)
        att = causal_softmax(att * self.latent_scale, T)
        y = (att @ C[0]) @ w[p + "v_b"].transpose(0, 2, 1)                       # (H, T, v)
        return y.transpose(1, 0, 2).reshape(T, -1) @ w[p + "o"].T

    def mlp(self, x, gate, up, down):
        return (silu(x @ gate.T) * (x @ up.T)) @ down.T

    def moe(self, i: int, x: np.ndarray, h: np.ndarray, phase: str) -> np.ndarray:
        s, w, p = self.spec, self.w, f"layers.{i}."
        t0 = time.perf_counter()
        idx, weights, needed, ev = self.streamer.begin_layer(self, i, x, h, x @ w[p + "router"].T, phase, t0)
        contrib = {}

        def compute(e, ew):
            rows, slot = np.nonzero(idx == e)
            contrib[e] = (rows, self.mlp(x[rows], ew["gate"], ew["up"], ew["down"]) * weights[rows, slot][:, None])

        self.streamer.run_layer(i, needed, compute, ev)
        t0 = time.perf_counter()
        out = np.zeros_like(x)
        for e in needed:                        # a fixed order: the same sum whatever the arrival order
            rows, y = contrib[e]
            out[rows] += y                      # rows are distinct: a token picks an expert once
        if s.shared_expert_size:
            y = self.mlp(x, w[p + "shared.gate"], w[p + "shared.up"], w[p + "shared.down"])
            if s.shared_expert_gate:
                y = y / (1.0 + np.exp(-(x @ w[p + "shared_gate"].T)))
            out = out + y
        ev.compute_s += time.perf_counter() - t0
        ev.t_end = time.perf_counter()
        self.tel.add_event(ev)
        return out

    # ------------------------------------------------------------ forward

    def forward(self, ids, phase: str = "decode") -> np.ndarray:
        """Run tokens `ids` at the current position (extending the KV cache); returns logits (T, vocab)."""
        s, w = self.spec, self.w
        ids = np.asarray(ids, dtype=np.int64)
        if self.pos + len(ids) > self.max_context:
            raise WorkbenchError(f"context of {self.pos + len(ids)} tokens exceeds the model's {self.max_context}")
        if self.pos + len(ids) > len(self.cos):
            self.cos, self.sin = rope_table(max(self.pos + len(ids), 2 * len(self.cos)), s)
        clock = time.perf_counter
        t0 = clock()
        x = w["embed"][ids].astype(np.float32)
        for i in range(s.num_layers):
            p = f"layers.{i}."
            x = x + self.attention(i, rms_norm(x, w[p + "attn_norm"], s.rms_norm_eps))
            xn = rms_norm(x, w[p + "mlp_norm"], s.rms_norm_eps)
            if i in s.dense_layers:
                x = x + self.mlp(xn, w[p + "dense.gate"], w[p + "dense.up"], w[p + "dense.down"])
            else:
                self.dense_compute_s += clock() - t0
                x = x + self.moe(i, xn, x, phase)
                t0 = clock()
        self.pos += len(ids)
        logits = rms_norm(x, w["norm"], s.rms_norm_eps) @ w["lm_head"].T
        self.dense_compute_s += clock() - t0
        return logits
