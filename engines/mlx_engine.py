"""The MLX engine: the numpy engine's decoder in MLX, experts computed straight from the pack's bytes.

The Apple-silicon path (Edge0 was built on it); on Linux `mlx[cpu]` runs it on the CPU, slowly, for
correctness. Same families, flags, hooks, predictors and telemetry as engines/numpy_engine.py, which it
mirrors line for line where it can.

Experts are never requantized: the streamer hands over each part's encoded bytes (`raw_experts`,
Pack.decode_expert(raw=True)), and affine q2/q3/q4/q8 parts are the codes, scales and biases of
`mx.quantize(w, 64, bits)` byte for byte (workbench/store/quant.py), so `mx.gather_qmm` computes from
them as they are (the float16 scales and biases are upcast, exactly, to float32 when staged). bf16 parts
stay bf16 and go through `mx.gather_mm` (an fp32 product of exact upcasts of the routed slots).
Packs whose experts are in other formats (raw GGUF blocks) are refused with a WorkbenchError.

Staged slots (Edge0's incremental stacking): every cache pool has one fixed-size stacked weight array per
part, as many slots as the pool holds experts: one per MoE layer for a per-layer cache, one shared by all
layers for a global cache, so the arrays never hold more experts than the budget does. An arriving expert
is written into a free slot in place (a slot is free when the cache no longer holds its expert), the cache
entry then becomes a small `Slot` marker (the read buffer is released), and one `gather_qmm` per
projection runs the layer's routed (token, expert) pairs with `rhs_indices` = their experts' slots.
When a layer streams in waves (its experts do not all fit), the experts staged so far are computed before
a slot of theirs is reused.

Routing runs in numpy (workbench.routing) on a copy of the router logits; the router hook and the
predictors see numpy `x`, `h` and `logits`, exactly as with the numpy engine. `w` is the numpy dict of
non-expert weights (predictors read it, Edge0 updates it); the MLX copies follow it by identity.

Numerics: fp32 throughout. The numpy engine's residual stream is float64 (NumPy 2 promotes
`att * (1.0 / np.sqrt(hd))`), so the two agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from workbench.streamer import ExpertStreamer
from workbench.errors import WorkbenchError
from workbench.store import quant
from workbench.store.pack import PARTS, Pack
from workbench.telemetry import Telemetry

from engines.base import Engine, Hooks, dense_weights
from engines.numpy_engine import kv_shapes, latent_softmax_scale, rope_table


MLX_KINDS = ("q2", "q3", "q4", "q8", "bf16")     # expert kinds computed from their bytes as they are


def rms_norm(x, w, eps):
    return w * (x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + mx.exp(-x))


def rope(x, cos, sin):
    """x: (heads, T, hd); cos, sin: (T, hd)."""
    h = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., h:], x[..., :h]], axis=-1) * sin


def deinterleave(x):
    """DeepSeek's interleaved RoPE pairs in rotate-half order (see engines.numpy_engine.deinterleave)."""
    return x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(x.shape)


def causal_softmax(att, T):
    S = att.shape[-1]
    if T > 1:
        future = np.arange(S)[None, :] > (S - T + np.arange(T))[:, None]
        att = mx.where(mx.array(future), float("-inf"), att)
    att = mx.exp(att - att.max(-1, keepdims=True))
    return att / att.sum(-1, keepdims=True)


class Slot:
    """A cache entry: the expert is staged in slot `index` of its pool's stacked arrays."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Slot({self.index})"


class SlotStack:
    """Fixed-size stacked expert weights for one cache pool: per part, (n, ...) arrays overwritten in place."""

    def __init__(self, n: int, shapes: dict, kinds: dict):
        self.n, self.shapes, self.kinds = n, shapes, kinds
        self.keys: list = [None] * n       # the expert each slot holds (its content stays valid until overwritten)
        self.where: dict = {}              # expert key -> slot
        self.arrays = {}
        for p in PARTS:
            out, inp = shapes[p]
            if kinds[p] == "bf16":
                self.arrays[p] = [mx.zeros((n, out, inp), dtype=mx.bfloat16)]
            else:
                bits = int(kinds[p][1:])
                # scales and biases upcast (exactly) from the pack's float16 to x's float32 once, at staging:
                # the kernels take one dtype for x, scales and biases, and a per-call cast would copy the stack
                self.arrays[p] = [mx.zeros((n, out, inp * bits // 32), dtype=mx.uint32),
                                  mx.zeros((n, out, inp // quant.GROUP), dtype=mx.float32),
                                  mx.zeros((n, out, inp // quant.GROUP), dtype=mx.float32)]
        mx.eval([a for arrs in self.arrays.values() for a in arrs])

    def write(self, i: int, key, parts: dict):
        """Overwrite slot i with an expert's encoded parts (no dequantization, no requantization)."""
        old = self.keys[i]
        if old is not None:
            self.where.pop(old, None)
        for p in PARTS:
            buf, shape, kind, arrs = parts[p], self.shapes[p], self.kinds[p], self.arrays[p]
            if kind == "bf16":
                arrs[0][i] = mx.array(np.frombuffer(buf, dtype="<u2").reshape(shape)).view(mx.bfloat16)
            else:
                wq, scales, biases = quant.from_bytes(buf, shape, int(kind[1:]))
                arrs[0][i] = mx.array(wq)
                arrs[1][i] = mx.array(scales).astype(mx.float32)
                arrs[2][i] = mx.array(biases).astype(mx.float32)
        self.keys[i], self.where[key] = key, i
        mx.async_eval([a for arrs in self.arrays.values() for a in arrs])   # the copy runs while reads go on

    def project(self, p: str, x, slots):
        """x (N, 1, in) times part p of the experts in `slots` (numpy (N,), sorted): (N, 1, out)."""
        arrs, kind = self.arrays[p], self.kinds[p]
        if kind == "bf16":   # upcast only the routed slots, then one gather_mm
            used, inv = np.unique(slots, return_inverse=True)
            w = arrs[0][mx.array(used)].astype(mx.float32)
            return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=mx.array(inv.astype(np.uint32)), sorted_indices=True)
        slots = mx.array(slots)
        return mx.gather_qmm(x, *arrs, rhs_indices=slots, transpose=True, group_size=quant.GROUP,
                             bits=int(kind[1:]), sorted_indices=True)


class MlxEngine(Engine):
    name = "mlx"
    raw_experts = True      # the streamer hands us the pack's encoded bytes

    def __init__(self, pack: Pack, streamer: ExpertStreamer, telemetry: Telemetry, hooks: Hooks = Hooks(),
                 weights: dict | None = None, max_context: int | None = None):
        super().__init__(pack, streamer, telemetry, hooks)
        kinds = dict(pack.expert_kinds)
        layer_kinds = getattr(pack, "expert_layer_kinds", {}) or {}
        odd = sorted({k for ks in [kinds, *layer_kinds.values()] for k in ks.values()} - set(MLX_KINDS))
        if odd or not kinds or any(ks != kinds for ks in layer_kinds.values()):
            raise WorkbenchError(f"{pack.path}: --engine mlx computes experts stored as {', '.join(MLX_KINDS)} "
                                 f"(affine group-64 or bf16); this pack's experts are {', '.join(odd) or 'mixed per layer'}: "
                                 f"convert with --experts q4 (or another of those)")
        if not streamer.raw:
            raise ValueError("--engine mlx computes from the pack's encoded bytes: its streamer must be made raw")
        self.w = dense_weights(pack) if weights is None else weights     # deltas: numpy in and out
        if self.spec.attention == "mla":
            self.latent_scale = latent_softmax_scale(self.spec)
        self._mw = {}           # id(numpy array) -> (that array, its MLX copy)
        self.max_context = max_context or self.spec.max_position_embeddings
        self._rope(256)         # grows with the context
        self.cache = streamer.cache
        shapes = {p: tuple(pack.expert_shapes[p]) for p in PARTS}
        self.stacks = {}        # MoE layer -> the SlotStack of its cache pool
        by_pool = {}
        for L in self.spec.moe_layers:
            pool = self.cache.pools[L]
            if id(pool) not in by_pool:
                layers = [M for M in self.spec.moe_layers if self.cache.pools[M] is pool]
                n = min(self.cache.capacity[L], self.spec.num_experts * len(layers))
                by_pool[id(pool)] = SlotStack(n, shapes, kinds)
            self.stacks[L] = by_pool[id(pool)]
        self.wave_flushes = 0                   # staged experts computed early to free their slots (a layer in waves)
        self.reset()

    def m(self, name: str):
        """The MLX copy of w[name], made again when w[name] is replaced."""
        a = self.w[name]
        hit = self._mw.get(id(a))
        if hit is None or hit[0] is not a:
            hit = self._mw[id(a)] = (a, mx.array(np.ascontiguousarray(a, dtype=np.float32)))
        return hit[1]

    def _rope(self, n: int):
        self.cos, self.sin = rope_table(n, self.spec)
        self.cos_m, self.sin_m = mx.array(self.cos), mx.array(self.sin)

    def reset(self):
        """An empty KV cache; its buffers grow by doubling, so a decode step copies nothing."""
        (hk, dk), (hv, dv) = kv_shapes(self.spec)
        self.kv = [[mx.zeros((hk, 64, dk)), mx.zeros((hv, 64, dv))] for _ in range(self.spec.num_layers)]
        self.pos = 0

    def _kv_append(self, i: int, k, v):
        K, V = self.kv[i]
        end = self.pos + k.shape[1]
        if end > K.shape[1]:
            grow = max(end, 2 * K.shape[1])
            K2, V2 = (mx.zeros((a.shape[0], grow, a.shape[2])) for a in (K, V))
            K2[:, :self.pos], V2[:, :self.pos] = K[:, :self.pos], V[:, :self.pos]
            K, V = K2, V2
            self.kv[i] = [K, V]
        K[:, self.pos:end] = k
        V[:, self.pos:end] = v
        return K[:, :end], V[:, :end]

    def _delta(self, name, x, y):
        return y + mx.array(np.asarray(self.deltas[name](np.array(x)), dtype=np.float32)) if name in self.deltas else y

    # ------------------------------------------------------------ blocks

    def attention(self, i: int, x):
        if self.spec.attention == "mla":
            return self.latent_attention(i, x)
        s, m, p = self.spec, self.m, f"layers.{i}."
        T = x.shape[0]
        q, k, v = x @ m(p + "q").T, x @ m(p + "k").T, x @ m(p + "v").T
        if self.deltas:
            q, k, v = (self._delta(p + n, x, a) for n, a in zip("qkv", (q, k, v)))
        if s.attention_bias:
            q, k, v = q + m(p + "q_bias"), k + m(p + "k_bias"), v + m(p + "v_bias")
        if s.qk_norm == "full":
            q, k = rms_norm(q, m(p + "q_norm"), s.rms_norm_eps), rms_norm(k, m(p + "k_norm"), s.rms_norm_eps)
        if s.clip_qkv is not None:
            q, k, v = (mx.clip(a, -s.clip_qkv, s.clip_qkv) for a in (q, k, v))
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)
        k = k.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = v.reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        if s.qk_norm == "head":
            q, k = rms_norm(q, m(p + "q_norm"), s.rms_norm_eps), rms_norm(k, m(p + "k_norm"), s.rms_norm_eps)
        cos, sin = self.cos_m[self.pos:self.pos + T], self.sin_m[self.pos:self.pos + T]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        K, V = self._kv_append(i, k, v)
        S, rep = K.shape[1], s.num_heads // s.num_kv_heads
        q = q.reshape(s.num_kv_heads, rep * T, s.head_dim)       # grouped query heads share their KV head
        att = (q @ K.transpose(0, 2, 1)).reshape(s.num_kv_heads, rep, T, S) * (1.0 / float(np.sqrt(s.head_dim)))
        att = causal_softmax(att, T)
        y = (att.reshape(s.num_kv_heads, rep * T, S) @ V).reshape(s.num_heads, T, s.head_dim)
        y = y.transpose(1, 0, 2).reshape(T, -1)
        return self._delta(p + "o", y, y @ m(p + "o").T)

    def latent_attention(self, i: int, x):
        """DeepSeek's MLA, absorbed form (see NumpyEngine.latent_attention)."""
        s, m, p = self.spec, self.m, f"layers.{i}."
        T, nope = x.shape[0], s.qk_nope_head_dim
        q = x @ m(p + "q").T if not s.q_lora_rank else \
            rms_norm(x @ m(p + "q_a").T, m(p + "q_a_norm"), s.rms_norm_eps) @ m(p + "q_b").T
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)
        ckv = x @ m(p + "kv_a").T
        c = rms_norm(ckv[:, :s.kv_lora_rank], m(p + "kv_a_norm"), s.rms_norm_eps)
        cos, sin = self.cos_m[self.pos:self.pos + T], self.sin_m[self.pos:self.pos + T]
        q_pe = rope(deinterleave(q[..., nope:]), cos, sin)
        k_pe = rope(deinterleave(ckv[None, :, s.kv_lora_rank:]), cos, sin)
        C, K_pe = self._kv_append(i, c[None], k_pe)
        att = (q[..., :nope] @ m(p + "k_b")) @ C[0].T + q_pe @ K_pe[0].T
        att = causal_softmax(att * self.latent_scale, T)
        y = (att @ C[0]) @ m(p + "v_b").transpose(0, 2, 1)
        return y.transpose(1, 0, 2).reshape(T, -1) @ m(p + "o").T

    def mlp(self, x, gate, up, down):
        return (silu(x @ gate.T) * (x @ up.T)) @ down.T

    def moe(self, i: int, x, h, phase: str):
        s, m, p = self.spec, self.m, f"layers.{i}."
        t0 = time.perf_counter()
        idx, weights, needed, ev = self.streamer.begin_layer(self, i, np.array(x), np.array(h),
                                                             np.array(x @ m(p + "router").T), phase, t0)
        idx = np.asarray(idx)
        weights = np.asarray(weights, dtype=np.float32)
        stack, staged, done = self.stacks[i], [], []     # staged: in a slot, not yet computed

        def flush():
            """Run the staged experts' (token, expert) pairs through gather_qmm, from their slots."""
            if not staged:
                return
            pairs = np.flatnonzero(np.isin(idx, staged))          # flat (token, k) positions
            lut = np.zeros(s.num_experts, np.uint32)
            lut[staged] = [stack.where[(i, e)] for e in staged]
            slots = lut[idx.reshape(-1)[pairs]]
            order = np.argsort(slots, kind="stable")
            pairs, slots = pairs[order], slots[order]
            xs = x[mx.array(pairs // idx.shape[1])][:, None, :]
            hid = silu(stack.project("gate", xs, slots)) * stack.project("up", xs, slots)
            y = stack.project("down", hid, slots)[:, 0, :] * mx.array(weights.reshape(-1)[pairs])[:, None]
            done.append((pairs, y))
            staged.clear()

        def compute(e, ew):
            key = (i, e)
            slot = stack.where.get(key)
            if slot is None and isinstance(ew, Slot):
                raise RuntimeError(f"expert {key}: the cache names slot {ew.index}, which holds {stack.keys[ew.index]}")
            if slot is None:                  # arrived: stage it in a slot whose expert the cache let go
                free = [j for j, k in enumerate(stack.keys) if k is None or k not in self.cache]
                ok = [j for j in free if stack.keys[j] is None or stack.keys[j][0] != i or stack.keys[j][1] not in staged]
                if not ok and free:           # waves: compute the staged experts before reusing their slots
                    self.wave_flushes += 1
                    flush()
                    mx.eval(done[-1][1])
                    ok = free
                if not ok:
                    raise RuntimeError(f"layer {i}: no free slot for expert {e} (cache {len(self.cache.keys())} "
                                       f"entries, {stack.n} slots)")
                slot = ok[0]
                stack.write(slot, key, ew)
            self.cache.set(key, Slot(slot))   # the cache entry is the slot now; the read buffer goes
            staged.append(e)

        self.streamer.run_layer(i, needed, compute, ev)
        t0 = time.perf_counter()
        flush()
        allpairs = np.concatenate([d[0] for d in done])
        Y = mx.concatenate([d[1] for d in done])[mx.array(np.argsort(allpairs))]
        out = Y.reshape(idx.shape[0], idx.shape[1], -1).sum(1)
        if s.shared_expert_size:
            y = self.mlp(x, m(p + "shared.gate"), m(p + "shared.up"), m(p + "shared.down"))
            if s.shared_expert_gate:
                y = y / (1.0 + mx.exp(-(x @ m(p + "shared_gate").T)))
            out = out + y
        mx.eval(out)
        ev.compute_s += time.perf_counter() - t0
        ev.t_end = time.perf_counter()
        self.tel.add_event(ev)
        return out

    # ------------------------------------------------------------ forward

    def forward(self, ids, phase: str = "decode") -> np.ndarray:
        """Run tokens `ids` at the current position (extending the KV cache); returns logits (T, vocab), numpy."""
        s, m = self.spec, self.m
        ids = np.asarray(ids, dtype=np.int64)
        if self.pos + len(ids) > self.max_context:
            raise WorkbenchError(f"context of {self.pos + len(ids)} tokens exceeds the model's {self.max_context}")
        if self.pos + len(ids) > len(self.cos):
            self._rope(max(self.pos + len(ids), 2 * len(self.cos)))
        clock = time.perf_counter
        t0 = clock()
        x = m("embed")[mx.array(ids.astype(np.int32))]
        for i in range(s.num_layers):
            p = f"layers.{i}."
            x = x + self.attention(i, rms_norm(x, m(p + "attn_norm"), s.rms_norm_eps))
            xn = rms_norm(x, m(p + "mlp_norm"), s.rms_norm_eps)
            if i in s.dense_layers:
                x = x + self.mlp(xn, m(p + "dense.gate"), m(p + "dense.up"), m(p + "dense.down"))
            else:
                mx.eval(x, xn)                  # the dense work is done before the layer's clock starts
                self.dense_compute_s += clock() - t0
                x = x + self.moe(i, xn, x, phase)
                t0 = clock()
        self.pos += len(ids)
        logits = np.array(rms_norm(x, m("norm"), s.rms_norm_eps) @ m("lm_head").T)
        self.dense_compute_s += clock() - t0
        return logits
