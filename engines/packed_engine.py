"""The packed engine: the decoder (engines/decoder.py) in numpy, routed experts computed straight from the bytes
read, in the slots of the cache's slot arena (workbench/arena.py), by compiled kernels: the pack's affine group-64
and bf16 formats in engines/packed_kernels.py, ggml's quantized blocks (Q4_K, Q6_K, Q8_0, ... as an imported GGUF
stored them, or a checkpoint's experts at --experts g2..g8, this engine's default) in ggml's own CPU kernels
(engines/ggml_kernels.py).

Nothing is dequantized on load: a read lands in its expert's slot, the reader thread checks its crc, and the
cache entry is the slot's offset. Each batch of a layer's experts that is in memory together (ready_first: the
cached ones, then each arrival; wait_all: all of them) goes through one kernel call, gathered from the slots.
Each (token, expert) result goes to its own row and the rows are summed in top-k order, so the arrival order
never changes the numbers: every exact design gives the same logits at every budget.

The budget counts packed bytes: an expert costs its slot (the pack's bytes for it, 4 KiB aligned), so
`--budget 0.25` is a quarter of the packed experts and a q3 pack holds more experts than a q4 pack in the
same bytes.

Non-expert matrices stay as the pack stores them too (`rest` q4/q8: attention, the head, shared experts, dense
layers; Encoded), so they cost their packed bytes in memory, not 7x that in f32, and a decoded token's projections
run in the same kernels (K.dense), up to 16 rows (a speculative batch); a longer prompt multiplies a dequantized
copy in BLAS instead (the kernel passes over the bytes once per row: for many rows, dequantizing once costs less).
A decode step reads each matrix once, so reading fewer bytes wins; alone, one small matrix whose f32 copy stays hot
in cache is faster in BLAS, which a decode step never sees (results/kernels.md has the measurements).
Embeddings (a lookup), the router, norms, biases and tensors the loader splits stay f32, but for a full-size router
(over ROUTER_Q8_BYTES in f32), which is re-encoded in Q8_0 at load: routing and the lookahead read a quarter of
its bytes, and ggml rounds x to 8 bits for it as for every GGUF matrix.

Numerics: the kernels compute scale * (codes . x) + bias * sum(x) per group of 64 in float32, where the
numpy reference dequantizes first and multiplies in BLAS: the two agree to float32 rounding (the tests state
the tolerance). ggml rounds x to 8 bits for its GGUF dot products, as llama.cpp does: a few percent of the
logits' range off the reference (tests/test_llamacpp.py). A decoded token's attention, after its projections,
is one kernel call (K.decode_attention) where the family allows.
"""
from __future__ import annotations

import os
import weakref

# OpenMP (numba's threading layer here) keeps a kernel's threads spinning after each parallel region unless told
# otherwise; where the cores are shared (the readers, other processes) a region then waits on a spinner that is
# not running: a small GGUF matmul took 14.5 ms on two threads against 84 us on one on this loaded 2-core
# machine, 274 us with passive waiting. Set before numba starts its threads (a user's own setting stands).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from engines import ggml_kernels as G
from engines import packed_kernels as K
from engines.base import Hooks, dense_weights
from engines.decoder import Decoder
from workbench.arena import planned_slot_bytes, slot_bytes
from workbench.errors import WorkbenchError
from workbench.store import quant
from workbench.store.pack import PARTS, Pack
from workbench.streamer import ExpertStreamer
from workbench.telemetry import Telemetry


KERNEL_ROWS = 16       # rows of x up to which a projection runs in the kernel (more: BLAS on a dequantized copy)
SPLIT_BY_LOADER = ("kv_b", "lin_qkvz", "lin_ba")      # dense_weights reshapes these in f32


class Encoded:
    """A resident matrix kept as the pack encodes it: affine group-64 (codes, float16 scales and biases), computed
    in K.dense, or a raw GGUF pack's blocks (gguf:Q4_K, Q6_K, ...), in ggml's dot products (G.dense). Read as an
    array (np.asarray, .T) it is dequantized: a copy, for the few readers outside the decode step."""

    def __init__(self, buf: np.ndarray, shape, kind: str):
        self.buf, self.shape, self.kind = buf, tuple(shape), kind
        self.bits, sdt = K.affine_of(kind) or (None, "")
        self.scales = K.SCALES.get(sdt, K.F16)
        self.ggml = G.part_row(kind, shape[1]) if self.bits is None else None
        self.nbytes = buf.nbytes

    def __array__(self, dtype=None, copy=None):
        a = (quant.decode(self.buf, self.shape, self.kind) if self.bits is not None
             else G.dequantize(self.buf, self.shape, self.kind))
        return a if dtype is None else a.astype(dtype)

    @property
    def T(self):
        return np.asarray(self).T

    def __getitem__(self, ids):
        """Rows of a GGUF-blocked table (an embedding lookup), dequantized: each row is its own run of blocks."""
        ids = np.atleast_1d(np.asarray(ids, np.int64))
        rb = int(self.ggml[1])
        rows = self.buf.reshape(-1, rb)[ids.reshape(-1)]
        return G.dequantize(rows, (ids.size, self.shape[1]), self.kind).reshape(*ids.shape, self.shape[1])


def stays_encoded(name: str, t: dict) -> bool:
    """Every affine matrix outside the experts, and every GGUF-quantized one ggml computes, but what the loader
    splits. The embedding table stays encoded in GGUF blocks only (a lookup dequantizes its rows, each a run of
    blocks); an affine one is kept f32, as the head when the model ties it."""
    kind, shape = t["kind"], t["shape"]
    if len(shape) != 2 or name.endswith(SPLIT_BY_LOADER):
        return False
    if kind.startswith("gguf:"):
        return G.computes(kind, shape[1])
    return kind != "bf16" and K.affine_of(kind) is not None and name != "embed"


# A router whose float32 rows pass this is kept in Q8_0 and computed in ggml's kernel: at full size (the 80B's 512
# experts x 2048, 4 MiB a layer) reading it in f32 twice a token (routing, and the lookahead of the next layer)
# cost 50 ms of 335; the demo's (32 KB) stays in cache in f32 and exact.
ROUTER_Q8_BYTES = 1 << 20
ROUTER_KIND = "gguf:Q8_0"


def encodes_router(name: str, t: dict) -> bool:
    rows, cols = t["shape"]
    return name.endswith(".router") and 4 * rows * cols > ROUTER_Q8_BYTES and G.computes(ROUTER_KIND, cols)


def packed_weights(pack) -> dict:
    """dense_weights with the matrices that stay encoded as Encoded (a full-size router re-encoded in Q8_0)."""
    def load(name):
        t = pack.tensors[name]
        if stays_encoded(name, t):
            return Encoded(pack.tensor_bytes(name), t["shape"], t["kind"])
        if len(t["shape"]) == 2 and encodes_router(name, t):
            return Encoded(G.quantize(pack.tensor(name), ROUTER_KIND).reshape(-1), t["shape"], ROUTER_KIND)
        return pack.tensor(name)
    return dense_weights(pack, load)


class PackedExperts:
    def __init__(self, decoder: Decoder, pack: Pack, arena):
        self.decoder, self.arena, s = weakref.proxy(decoder), arena, decoder.spec   # the decoder holds these
        self.d, self.ff = s.hidden_size, s.moe_intermediate_size
        self.kernels = {L: kernel_of(pack, L, arena.layouts[L][1]) for L in s.moe_layers}
        self.low = low = decoder.low        # the router's low tier: its copies computed from its own blocks
        self.low_kernels = {L: kernel_of(low.pack, L, low.layouts[L][1]) for L in low.blocks} if low else {}

    def begin(self, i: int, x, idx, weights):
        """compute(experts, slot offsets) for the streamer: one kernel call per batch, which picks the batch's
        (token, expert) pairs itself (no per-batch index arrays in Python)."""
        self.i, self.k = i, idx.shape[1]    # the routing's top-k: a routing trace's may be less than the model's
        self.flat = np.ascontiguousarray(idx, dtype=np.int64).reshape(-1)
        self.w = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        self.X = np.ascontiguousarray(x, dtype=np.float32)
        self.Y = np.empty((self.flat.shape[0], self.d), np.float32)
        block, kernel = self.arena.blocks[i], self.kernels[i]

        def compute(es, offsets):
            self.run(block, kernel, np.array(es, np.int64), np.array(offsets, np.int64))
        return compute

    def compute_low(self, es):
        """The layer's pairs whose expert is one of `es`, from the low tier's copies."""
        offsets = self.low.offsets(self.i, es) if self.i in self.low_kernels else np.full(len(es), -1)
        if (offsets < 0).any():
            raise WorkbenchError(f"layer {self.i}: the router marked expert {es[int(np.argmin(offsets))]} for the low "
                                 f"tier, which does not hold it (its low_experts())")
        self.run(self.low.blocks[self.i], self.low_kernels[self.i], np.array(es, np.int64), offsets)

    def run(self, block, kernel, es, offsets):
        ggml, parts, heads, scales = kernel
        if ggml:
            G.moe_ready(block, es, offsets, self.flat, self.k, self.w, self.X, self.Y, parts, heads, self.d, self.ff)
        else:
            K.moe_ready(block, es, offsets, self.flat, self.k, self.w, self.X, self.Y, parts, heads, self.d, self.ff,
                        scales)

    def combine(self, needed):
        return self.Y.reshape(-1, self.k, self.d).sum(1)


def kernel_of(pack: Pack, layer: int, offsets: dict) -> tuple:
    """(whether ggml computes it, its parts table, where each expert's parts start past their slot regions, the
    affine scales' dtype or None) of one layer's experts laid out in slots at `offsets` (layer_kernel)."""
    ggml, parts = layer_kernel(pack, layer, offsets)
    if ggml:
        return ggml, parts, pack.expert_heads(layer), None
    return ggml, parts, kernel_heads(pack, layer), K.SCALES.get(K.affine_of(pack.kinds_of(layer)["gate"])[1], K.F16)


def kernel_heads(pack: Pack, layer: int) -> np.ndarray:
    """(experts, 9): where each expert's codes, scales, biases of gate, up, down start past their slot regions
    (K.moe_pairs): an MLX index's reads start at the 4 KiB boundary before each; zero in a pack."""
    h, ent = pack.expert_heads(layer), pack.expert_layers[layer][0]
    out = np.zeros((h.shape[0], 9), np.int64)
    if "runs" in ent:
        col = 0
        for i, p in enumerate(PARTS):
            n = len(ent["runs"][p])
            out[:, 3 * i:3 * i + n] = h[:, col:col + n]
            col += n
    return out


def layer_kernel(pack: Pack, layer: int, offsets: dict) -> tuple[bool, np.ndarray]:
    """(whether ggml computes it, its parts table) for one layer's experts: affine group-64 (2/3/4/8 bits, 2-byte
    scales: the pack's and MLX's) or bf16 in this module's kernels, GGUF blocks (a raw GGUF pack) in ggml's
    (engines/ggml_kernels.py). WorkbenchError if neither."""
    kinds = pack.kinds_of(layer)
    if all(K.affine_of(kinds.get(p, "")) for p in PARTS) and len({K.affine_of(kinds[p])[1] for p in PARTS} - {""}) <= 1:
        return False, K.expert_parts(pack.expert_shapes, kinds, offsets)[0]
    why = f"layer {layer}'s are {', '.join(sorted(set(map(str, kinds.values()))))}"
    if all(str(kinds.get(p)).startswith("gguf:") for p in PARTS):
        try:
            parts = G.expert_parts(pack.expert_shapes, kinds, offsets)
            if all(G.computes(kinds[p], pack.expert_shapes[p][1]) for p in PARTS):
                return True, parts
            why += " (a GGUF float type: the numpy engine computes it exactly)"
        except WorkbenchError as e:
            why += f" ({e})"
    raise WorkbenchError(f"{pack.path}: --engine packed computes experts stored as {', '.join(K.BITS)} (affine at "
                         f"group 64, a pack's or an MLX checkpoint's) or in quantized GGUF blocks that ggml's CPU "
                         f"kernels take; {why}: convert with --experts q4 (or another of those), or run it with "
                         f"--engine numpy{' or --engine mlx' if any(str(k).startswith('mlx:') for k in kinds.values()) else ''}")


class ThreadChoice:
    """The kernels' threads, by what a decode step's compute (kernels, routing) measures: one, or every core where
    one thread's token is long enough for more to pay (WORTH) and every core computed recent tokens faster. Most
    tokens run on the faster count; now and then one token runs on the other, to keep its time current as other
    processes and the readers take and leave cores mid-run: after EXPLORE tokens, and twice as many after each look
    that changes nothing (up to LONGEST). Where cores are shared a look at every core costs far more than a token
    (its threads wait for each other at each kernel's end: results/full_size.md, "Threads"): a short token never
    looks, and a count measured slower costs a few tokens in a run, not a share of it. The numbers do not depend on
    the thread count (ggml_kernels.ROWS), so neither do the logits."""
    EXPLORE, LONGEST = 16, 256
    WORTH = 0.02        # seconds of compute a token on one thread, under which every core is never tried
    SMOOTH = 0.25       # weight of the latest token in the mean of the count in use

    def __init__(self, cores: int):
        self.counts = sorted({1, cores})
        self.mean: dict[int, float] = {}
        self.best, self.every, self.next = 1, self.EXPLORE, self.EXPLORE

    def pick(self) -> int:
        if 1 not in self.mean or (self.best == 1 and self.mean[1] < self.WORTH):
            return 1
        untried = [n for n in self.counts if n not in self.mean]
        if untried:
            return untried[0]
        self.next -= 1
        if self.next > 0:
            return self.best
        return next(n for n in self.counts if n != self.best)

    def took(self, threads: int, seconds: float) -> None:
        """A decode step's compute at `threads`: into the running mean of the count in use; a look at the other
        replaces its mean (tokens ago, under other load)."""
        m = self.mean.get(threads)
        self.mean[threads] = seconds if m is None or threads != self.best else m + self.SMOOTH * (seconds - m)
        if len(self.mean) < len(self.counts):
            return
        best = min(self.counts, key=self.mean.__getitem__)
        if self.next <= 0:                  # a look at the other count: the same best waits longer for the next
            self.every = self.EXPLORE if best != self.best else min(self.LONGEST, 2 * self.every)
            self.next = self.every
        self.best = best


class PackedEngine(Decoder):
    name = "packed"
    computes_low = True
    slot_arena = True       # the session gives the cache a slot arena; the streamer reads into it

    @classmethod
    def slot_bytes(cls, pack, storage=None) -> int:
        """An expert's slot: the pack's 4 KiB-aligned bytes for it (of a spec: those of the pack at `storage`)."""
        if isinstance(pack, Pack):
            return slot_bytes(pack)
        return planned_slot_bytes(pack, storage.layout.value, storage.experts)

    @classmethod
    def needed_weights(cls, pack) -> dict:
        return packed_weights(pack)

    @classmethod
    def resident_bytes(cls, pack) -> int:
        def nbytes(n, t):
            if stays_encoded(n, t):
                return t["nbytes"]
            if len(t["shape"]) == 2 and encodes_router(n, t):
                return t["shape"][0] * G.part(ROUTER_KIND, t["shape"][1])[0]
            return 4 * int(np.prod(t["shape"]))
        return sum(nbytes(n, t) for n, t in pack.tensors.items())

    @staticmethod
    def computes(pack) -> bool:
        """Whether the kernels read this pack's experts: affine group-64 or bf16, or GGUF blocks that ggml's CPU
        kernels take (llama-cpp-python installed)."""
        try:
            for L in pack.spec.moe_layers:
                layer_kernel(pack, L, {p: 0 for p in PARTS})
        except WorkbenchError:
            return False
        return True

    def __init__(self, pack: Pack, streamer: ExpertStreamer, telemetry: Telemetry, hooks: Hooks = Hooks(),
                 weights: dict | None = None, max_context: int | None = None, threads: int | None = None):
        """threads: the cores the kernels share. By default (None) ThreadChoice's: every core where a token's compute
        is long enough for more threads to pay and they compute it faster here and now, else one: a kernel's
        threads wait at its end for the slowest, and a core shared with the readers or with other processes can
        cost more than it brings (results/full_size.md, "Threads").
        The thread that constructs the engine is the one that computes with it."""
        super().__init__(pack, streamer, telemetry, hooks)
        cores = numba.config.NUMBA_NUM_THREADS
        if threads is not None and not 1 <= threads <= cores:
            raise WorkbenchError(f"--threads {threads}: choose 1 to {cores} (this machine's cores)")
        self.choice = None if threads else ThreadChoice(cores)
        self.threads = threads or 1
        numba.set_num_threads(self.threads)
        for L in pack.spec.moe_layers:
            layer_kernel(pack, L, {p: 0 for p in PARTS})      # the reason, where the kernels cannot read it
        if streamer.arena is None:
            raise ValueError("--engine packed computes from slots: its streamer must be given the cache's slot arena")
        threadpool_limits(limits=1, user_api="blas")
        sp = pack.spec        # the attention K.decode_attention computes in one call (else the decoder's numpy)
        self.fused_attention = (sp.attention != "mla" and sp.qk_norm in ("none", "head") and sp.clip_qkv is None
                                and not sp.attn_output_gate and not self.deltas)
        self.setup(packed_weights(pack) if weights is None else weights, max_context,
                   PackedExperts(self, pack, streamer.arena))

    def decode(self, ids) -> np.ndarray:
        if self.choice is None:
            return super().decode(ids)
        self.threads = self.choice.pick()
        numba.set_num_threads(self.threads)
        n_ev, dense0 = len(self.tel.events), self.dense_compute_s
        out = super().decode(ids)
        self.choice.took(self.threads, self.dense_compute_s - dense0 +
                         sum(e.compute_s + e.router_s for e in self.tel.events[n_ev:]))
        return out

    def linear(self, x, name: str):
        w = self.w[name]
        if not isinstance(w, Encoded):
            return x @ w.T
        if x.shape[0] > KERNEL_ROWS:
            return x @ np.asarray(w).T
        y = np.empty((x.shape[0], w.shape[0]), np.float32)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if w.ggml is not None:
            G.dense(w.buf, w.shape[0], w.shape[1], w.ggml, x, y)
        else:
            K.dense(w.buf, w.shape[0], w.shape[1], w.bits, x, y, w.scales)
        return y

    def routers(self, x, h, name: str, wanted: dict) -> tuple:
        ws = [self.w[name], *(self.w[f"layers.{t}.router"] for t in wanted)]
        same = all(isinstance(w, Encoded) and w.ggml is not None and (w.kind, w.shape) == (ws[0].kind, ws[0].shape)
                   for w in ws)
        if not wanted or not same or x.shape[0] != 1 or len({k for _, _, k in wanted.values()}) != 1:
            return super().routers(x, h, name, wanted)
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
        norms, biases = (np.stack([f32(v[i]).reshape(-1) for v in wanted.values()]) for i in (0, 1))
        logits, tops = G.routers([w.buf for w in ws], *ws[0].shape, ws[0].ggml, f32(x), f32(h).reshape(1, -1), norms,
                                 self.spec.rms_norm_eps, biases, next(iter(wanted.values()))[2])
        return logits, dict(zip(wanted, tops[:, None]))

    def router_top(self, h, norm, name: str, bias, k: int) -> np.ndarray:
        w = self.w[name]
        if not isinstance(w, Encoded) or w.ggml is None or h.shape[0] > KERNEL_ROWS or norm.dtype != np.float32:
            return super().router_top(h, norm, name, bias, k)
        return G.top(w.buf, w.shape[0], w.shape[1], w.ggml, np.ascontiguousarray(h, dtype=np.float32), norm,
                     self.spec.rms_norm_eps, bias, k)

    def delta_rule(self, S, q, k, v, beta, decay):
        """The linear-attention step in one kernel call, where numpy's writes six arrays the state's size a token
        (results/overhead.md, part 3)."""
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
        out, o = np.empty(S.shape, np.float32), np.empty(v.shape, np.float32)
        K.delta_rule(f32(S), f32(q), f32(k), f32(v), f32(beta), f32(decay), out, o)
        return out, o

    def rms_norm(self, x, w):
        """A decoded token's norm in one kernel call instead of numpy's five operations (a token has many norms)."""
        if x.ndim != 2 or x.shape[0] > KERNEL_ROWS or w.dtype != np.float32:
            return super().rms_norm(x, w)
        y = np.empty(x.shape, np.float32)
        K.rms_norm(np.ascontiguousarray(x, dtype=np.float32), w, np.float32(self.spec.rms_norm_eps), y)
        return y

    def attention(self, i: int, x):
        """A decoded token's attention: projections in BLAS, the rest (qk-norm, RoPE, KV append, softmax, the
        weighted values) in one kernel call instead of some twenty small numpy operations."""
        s = self.spec
        if not self.fused_attention or x.shape[0] != 1 or s.is_linear(i):
            return super().attention(i, x)
        W, p, hd = self.W, f"layers.{i}.", s.head_dim
        q, k, v = self.linear(x, p + "q"), self.linear(x, p + "k"), self.linear(x, p + "v")
        if s.attention_bias:
            q, k, v = q + W(p + "q_bias"), k + W(p + "k_bias"), v + W(p + "v_bias")
        norm = s.qk_norm == "head"
        q_norm, k_norm = (W(p + "q_norm"), W(p + "k_norm")) if norm else (self.cos[0], self.cos[0])   # unread
        Kc, Vc = self.kv_room(i, self.pos + 1)
        y = np.empty((s.num_heads, hd), np.float32)
        K.decode_attention(q.reshape(s.num_heads, hd), k.reshape(s.num_kv_heads, hd), v.reshape(s.num_kv_heads, hd),
                           q_norm, k_norm, np.float32(s.rms_norm_eps), norm, self.cos[self.pos], self.sin[self.pos],
                           Kc, Vc, self.pos, np.float32(1.0 / np.sqrt(hd)), y)
        return self.linear(y.reshape(1, -1), p + "o")
