"""The MLX engine: the decoder (engines/decoder.py) on MLX arrays, experts computed straight from the pack's bytes.

The Apple-silicon path (Edge0 was built on it); on Linux `mlx[cpu]` runs it on the CPU, slowly, for
correctness. Same families, flags, hooks, predictors and telemetry as the numpy engine: the decoder is the
same code; what is MLX's own is the array conversions and the expert-compute object (MlxExperts).

Experts are never requantized: the streamer hands over each part's encoded bytes (`raw_experts`,
Pack.decode_expert(raw=True)), and affine q2/q3/q4/q8 parts are the codes, scales and biases of
`mx.quantize(w, 64, bits)` byte for byte (workbench/store/quant.py), so `mx.gather_qmm` computes from
them as they are (the float16 scales and biases are upcast, exactly, to float32 when staged). bf16 parts
stay bf16 and go through `mx.gather_mm` (an fp32 product of exact upcasts of the routed slots).
A checkpoint in MLX's own layout (an mlx: kind: any width and group, scales in the model's dtype) is computed
the same way, from its codes, scales and biases as they lie in its file (workbench/models/mlx_layout.py).
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
non-expert weights (the predictors read it); each has one MLX copy, made on first use.

Numerics: fp32 throughout; MLX's kernels sum in other orders than numpy's, so the two engines agree to
float32 rounding (the tests: within 2e-5), not bit for bit.
"""
from __future__ import annotations

import weakref
import mlx.core as mx
import numpy as np

from engines.base import Hooks, dense_weights
from engines.decoder import Decoder
from workbench.errors import WorkbenchError
from workbench.store import quant
from workbench.store.pack import PARTS, Pack
from workbench.streamer import ExpertStreamer
from workbench.telemetry import Telemetry

MLX_KINDS = ("q2", "q3", "q4", "q8", "bf16")     # expert kinds computed from their bytes as they are (and mlx: ones)
MLX_BITS = (2, 3, 4, 5, 6, 8)                     # the widths mx.gather_qmm computes


def _computed(kind: str) -> bool:
    a = quant.affine(kind)
    return kind in MLX_KINDS or (a is not None and a[0] in MLX_BITS)


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
                bits, group, _ = quant.affine(kinds[p])
                # scales and biases upcast (exactly) from the pack's float16 to x's float32 once, at staging:
                # the kernels take one dtype for x, scales and biases, and a per-call cast would copy the stack
                self.arrays[p] = [mx.zeros((n, out, inp * bits // 32), dtype=mx.uint32),
                                  mx.zeros((n, out, inp // group), dtype=mx.float32),
                                  mx.zeros((n, out, inp // group), dtype=mx.float32)]
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
                wq, scales, biases = quant.affine_split(buf, shape, kind)     # scales, biases: float32, exact
                arrs[0][i] = mx.array(wq)
                arrs[1][i] = mx.array(scales)
                arrs[2][i] = mx.array(biases)
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
        bits, group, _ = quant.affine(kind)
        return mx.gather_qmm(x, *arrs, rhs_indices=slots, transpose=True, group_size=group, bits=bits,
                             sorted_indices=True)


class MlxExperts:
    """Routed experts from the staged slots: an arriving expert is written into a free slot of its pool's stack,
    and one gather_qmm per projection runs the layer's (token, expert) pairs from their slots."""

    def __init__(self, decoder: Decoder, pack: Pack, cache):
        self.decoder, self.cache, spec = weakref.proxy(decoder), cache, decoder.spec   # the decoder holds these
        kinds = dict(pack.expert_kinds)
        shapes = {p: tuple(pack.expert_shapes[p]) for p in PARTS}
        self.stacks = {}        # MoE layer -> the SlotStack of its cache pool
        by_pool = {}
        for L in spec.moe_layers:
            pool = cache.pools[L]
            if id(pool) not in by_pool:
                layers = [M for M in spec.moe_layers if cache.pools[M] is pool]
                n = min(cache.capacity[L], spec.num_experts * len(layers))
                by_pool[id(pool)] = SlotStack(n, shapes, kinds)
            self.stacks[L] = by_pool[id(pool)]
        self.wave_flushes = 0   # staged experts computed early to free their slots (a layer in waves)

    def begin(self, i: int, x, idx, weights):
        """compute(experts, encoded parts) for the streamer: stage each arriving expert in a slot."""
        s, silu = self.decoder.spec, self.decoder.silu
        idx = np.asarray(idx)
        weights = np.asarray(weights, dtype=np.float32)
        stack, staged, done = self.stacks[i], [], []     # staged: in a slot, not yet computed
        self.idx, self.done = idx, done

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
        self.flush = flush

        def stage(e, ew):
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

        def compute(es, ews):
            for e, ew in zip(es, ews):
                stage(e, ew)
        return compute

    def combine(self, needed):
        self.flush()
        idx, done = self.idx, self.done
        allpairs = np.concatenate([d[0] for d in done])
        Y = mx.concatenate([d[1] for d in done])[mx.array(np.argsort(allpairs))]
        return Y.reshape(idx.shape[0], idx.shape[1], -1).sum(1)


def _kinds(pack) -> set:
    return {k for ks in [pack.expert_kinds, *(getattr(pack, "expert_layer_kinds", {}) or {}).values()]
            for k in ks.values()}


class MlxEngine(Decoder):
    name = "mlx"
    raw_experts = True      # the streamer hands us the pack's encoded bytes
    xp = mx

    @staticmethod
    def computes(pack) -> bool:
        """Whether its kernels take this pack's experts: one of MLX_KINDS per part, the same in every layer."""
        kinds = dict(pack.expert_kinds)
        layer_kinds = getattr(pack, "expert_layer_kinds", {}) or {}
        return bool(kinds) and all(map(_computed, _kinds(pack))) and all(ks == kinds for ks in layer_kinds.values())

    def __init__(self, pack: Pack, streamer: ExpertStreamer, telemetry: Telemetry, hooks: Hooks = Hooks(),
                 weights: dict | None = None, max_context: int | None = None):
        super().__init__(pack, streamer, telemetry, hooks)
        if not self.computes(pack):
            odd = sorted(k for k in _kinds(pack) if not _computed(k))
            raise WorkbenchError(f"{pack.path}: --engine mlx computes experts stored as {', '.join(MLX_KINDS)} "
                                 f"(affine group-64 or bf16); this pack's experts are {', '.join(odd) or 'mixed per layer'}: "
                                 f"convert with --experts q4 (or another of those)")
        if not streamer.raw:
            raise ValueError("--engine mlx computes from the pack's encoded bytes: its streamer must be made raw")
        self._mw = {}           # weight name -> its MLX copy
        self.setup(dense_weights(pack) if weights is None else weights, max_context,
                   MlxExperts(self, pack, streamer.cache))

    def W(self, name: str):
        if name not in self._mw:
            self._mw[name] = mx.array(np.ascontiguousarray(self.w[name], dtype=np.float32))
        return self._mw[name]

    def to_numpy(self, a):
        return np.array(a)

    def from_numpy(self, a):
        return mx.array(a.astype(np.float32) if a.dtype == np.float64 else a)

    def sync(self, *arrays):
        mx.eval(*arrays)

    def scalar(self, v: float):
        return float(v)

    def embed(self, ids: np.ndarray):
        return self.W("embed")[mx.array(ids.astype(np.int32))]
