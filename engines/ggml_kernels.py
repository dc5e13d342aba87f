"""ggml's CPU kernels on a pack's GGUF blocks: experts kept as an imported GGUF stored them (kinds "gguf:<TYPE>",
e.g. gguf:Q4_K, Q6_K, Q8_0), computed from the slot bytes as read.

The kernels are llama.cpp's own, from the libggml-base / libggml-cpu that llama-cpp-python installs: for each
GGUF type ggml's CPU backend gives a dot product of one row of that type with a vector in a companion type
(`ggml_get_type_traits_cpu`: vec_dot, vec_dot_type; k-quants pair with Q8_K, the 32-blocks with Q8_0) and the
function that quantizes a float32 vector to the companion type (from_float). This module calls those two
function pointers from a compiled loop (numba, through an LLVM intrinsic that calls an address), so a layer's
(token, expert) pairs run in one call: quantize x once per pair and part, then one vec_dot per output row.

Not exact: ggml rounds the activations to 8 bits (Q8_K / Q8_0) before its integer dot products, as llama.cpp does
(about 1e-2 relative to the dequantized float32 product; tests/test_ggml_kernels.py states the tolerance).
Needs llama-cpp-python (`pip install 'moe-workbench[llamacpp]'`), as raw GGUF packs already do.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from engines.packed_kernels import rms_norm, slots_of
from workbench.errors import WorkbenchError
from workbench.routing import topk_rows
from workbench.store.ggml_blocks import library, quantize, type_id  # noqa: F401 (quantize: G.quantize)


class _Traits(ctypes.Structure):          # struct ggml_type_traits_cpu (ggml-cpu.h)
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class _TypeTraits(ctypes.Structure):      # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _libs():
    base = ctypes.CDLL(library("ggml-base"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(library("ggml-cpu"), mode=ctypes.RTLD_GLOBAL)
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]
    base.ggml_blck_size.restype, base.ggml_blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    base.ggml_get_type_traits.restype, base.ggml_get_type_traits.argtypes = ctypes.POINTER(_TypeTraits), [ctypes.c_int]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_cpu_init()                     # its conversion tables, before any kernel runs
    return base, cpu


@lru_cache(maxsize=None)
def part(kind: str, cols: int) -> tuple[int, int, int, int]:
    """(bytes of one row of `cols` values, vec_dot, from_float of its companion type, bytes of x in that type) for
    a GGUF kind; WorkbenchError where ggml's CPU backend has no dot product for it or the row does not split."""
    base, cpu = _libs()
    t = type_id(kind)
    tr = cpu.ggml_get_type_traits_cpu(t).contents
    vt = tr.vec_dot_type
    from_float = cpu.ggml_get_type_traits_cpu(vt).contents.from_float
    if not tr.vec_dot or not from_float:
        raise WorkbenchError(f"{kind}: ggml's CPU backend has no dot product for this type")
    if cols % base.ggml_blck_size(t) or cols % base.ggml_blck_size(vt):
        raise WorkbenchError(f"{kind}: a row of {cols} values does not split into its blocks")
    return int(base.ggml_row_size(t, cols)), int(tr.vec_dot), int(from_float), int(base.ggml_row_size(vt, cols))


def computes(kind: str, cols: int) -> bool:
    """Whether this is a quantized GGUF kind whose rows of `cols` values ggml's dot products take (llama-cpp-python
    installed). Not F32, F16 or BF16: ggml rounds x to their type, where float32 BLAS on them is exact and fast."""
    try:
        part(kind, cols)
        return bool(_libs()[0].ggml_get_type_traits(type_id(kind)).contents.is_quantized)
    except (WorkbenchError, KeyError, OSError):
        return False


# ---------------------------------------------------------------- calling the two function pointers

@intrinsic
def _vec_dot(typingctx, fn, n, s, x, y):
    """ggml_vec_dot_t(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc),
    one row (nrc 1: the strides are unused)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn, n, s, x, y = args
        p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i32, p, i64, p, i64, p, i64, i32])
        zero = ir.Constant(i64, 0)
        builder.call(builder.inttoptr(fn, fnty.as_pointer()),
                     [builder.trunc(n, i32), builder.inttoptr(s, p), zero, builder.inttoptr(x, p), zero,
                      builder.inttoptr(y, p), zero, ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _from_float(typingctx, fn, x, y, k):
    """ggml_from_float_t(const float *x, void *y, int64_t k)."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn, x, y, k = args
        p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [p, p, ir.IntType(64)])
        builder.call(builder.inttoptr(fn, fnty.as_pointer()), [builder.inttoptr(x, p), builder.inttoptr(y, p), k])
        return context.get_dummy_value()
    return sig, codegen


# ---------------------------------------------------------------- kernels

# parts: int64 (3, 5), per gate, up, down: byte offset in the slot, row bytes, vec_dot, from_float, x bytes.
# The output rows of every matrix are cut into runs of ROWS that the threads share (numba's prange): each row is
# one vec_dot whatever thread computes it, so the result does not depend on the thread count.
ROWS = 32


@njit(cache=True, nogil=True)
def _matvec(addr, rows, cols, p, x, qx, y):
    """y[:rows] = W x, W's rows of part p at address addr (one thread)."""
    _from_float(p[3], x.ctypes.data, qx.ctypes.data, cols)
    for o in range(rows):
        _vec_dot(p[2], cols, y.ctypes.data + 4 * o, addr + o * p[1], qx.ctypes.data)


@njit(cache=True, nogil=True)
def _rows(fn, cols, y_addr, w_addr, row_bytes, qx_addr, first, last):
    for o in range(first, last):
        _vec_dot(fn, cols, y_addr + 4 * o, w_addr + o * row_bytes, qx_addr)


@njit(cache=True, nogil=True, parallel=True)
def moe_ready(block, experts, offsets, flat, k, weight, X, Y, parts, heads, d, ff):
    """As packed_kernels.moe_ready, for GGUF blocks: the pairs of a layer whose expert is in a batch in memory
    (experts[i], its slot at byte offsets[i] of block); pair p of the flat top-k is token p // k, its result
    (times its routing weight) row p of Y. heads (experts, 3): where expert e's gate, up, down start past their
    slot regions' starts (Pack.expert_heads: 0 in a pack, the GGUF's own offsets in a GGUF index)."""
    slot_of = slots_of(flat, experts, offsets)
    todo = np.empty(flat.shape[0], np.int64)
    n = 0
    for p in range(flat.shape[0]):
        if slot_of[flat[p]] >= 0:
            todo[n] = p
            n += 1
    at = np.empty((n, 3), np.int64)                   # where pair i's gate, up, down rows start
    for i in range(n):
        e = flat[todo[i]]
        for j in range(3):
            at[i, j] = block.ctypes.data + slot_of[e] + parts[j, 0] + heads[e, j]
    qb = max(parts[0, 4], parts[1, 4], parts[2, 4])
    qx = np.empty((n, 3, qb), np.uint8)               # x in gate's and up's companion types, then gate*up in down's
    H = np.empty((n, 2, ff), np.float32)
    for i in prange(n):
        for j in range(2):
            _from_float(parts[j, 3], X[todo[i] // k].ctypes.data, qx[i, j].ctypes.data, d)
    runs = (ff + ROWS - 1) // ROWS
    for t in prange(n * 2 * runs):
        i, j, r = t // (2 * runs), t // runs % 2, t % runs
        _rows(parts[j, 2], d, H[i, j].ctypes.data, at[i, j], parts[j, 1], qx[i, j].ctypes.data,
              r * ROWS, min(ff, (r + 1) * ROWS))
    for i in prange(n):
        g, u = H[i, 0], H[i, 1]
        for j in range(ff):
            g[j] = g[j] / (np.float32(1.0) + np.exp(-g[j])) * u[j]
        _from_float(parts[2, 3], g.ctypes.data, qx[i, 2].ctypes.data, ff)
    runs = (d + ROWS - 1) // ROWS
    for t in prange(n * runs):
        i, r = t // runs, t % runs
        p, first, last = todo[i], r * ROWS, min(d, (r + 1) * ROWS)
        _rows(parts[2, 2], ff, Y[p].ctypes.data, at[i, 2], parts[2, 1], qx[i, 2].ctypes.data, first, last)
        for j in range(first, last):
            Y[p, j] = weight[p] * Y[p, j]


@njit(cache=True, nogil=True, parallel=True)
def _dense(addr, rows, cols, p, X, Y):
    qx = np.empty((X.shape[0], p[4]), np.uint8)
    for r in prange(X.shape[0]):
        _from_float(p[3], X[r].ctypes.data, qx[r].ctypes.data, cols)
    runs = (rows + ROWS - 1) // ROWS
    for t in prange(X.shape[0] * runs):
        r, c = t // runs, t % runs
        _rows(p[2], cols, Y[r].ctypes.data, addr, p[1], qx[r].ctypes.data, c * ROWS, min(rows, (c + 1) * ROWS))


# One row through a matrix of at most this many bytes (a router) runs on the calling thread: waking numba's others
# for it costs more than they save (results/miss_and_cores.md).
ONE_THREAD_BYTES = 2 << 20


@njit(cache=True, nogil=True)
def _product(addr, rows, cols, p, X, Y):
    if X.shape[0] == 1 and rows * p[1] <= ONE_THREAD_BYTES:
        _matvec(addr, rows, cols, p, X[0], np.empty(p[4], np.uint8), Y[0])
    else:
        _dense(addr, rows, cols, p, X, Y)


@njit(cache=True, nogil=True)
def _top(addr, rows, cols, p, H, norm, eps, bias, X, logits, top):
    rms_norm(H, norm, eps, X)
    _product(addr, rows, cols, p, X, logits)
    for r in range(X.shape[0]):
        for o in range(rows):
            logits[r, o] += bias[o]
    topk_rows(logits, top.shape[1], top)


def top(buf: np.ndarray, rows: int, cols: int, p: np.ndarray, H: np.ndarray, norm: np.ndarray, eps, bias: np.ndarray,
        k: int) -> np.ndarray:
    """The k largest of W x + bias, x each row of H RMS-normed with weight `norm` (packed_kernels.rms_norm), best
    first (topk_rows' order): a router's choice in one call, where the norm, dense, the sum and the top-k each paid
    Python's overhead per call (W as for dense; H, norm, bias float32)."""
    out = np.empty((H.shape[0], k), np.int64)
    _top(buf.ctypes.data, rows, cols, p, H, norm, np.float32(eps), bias, np.empty_like(H),
         np.empty((H.shape[0], rows), np.float32), out)
    return out


@njit(cache=True, nogil=True, parallel=True)
def _routers(addrs, rows, cols, p, X, H, norms, eps, biases, logits, tops):
    xs = np.empty((addrs.shape[0], cols), np.float32)
    xs[0] = X[0]
    for j in range(1, addrs.shape[0]):
        rms_norm(H, norms[j - 1], eps, xs[j:j + 1])
    for j in prange(addrs.shape[0]):
        _matvec(addrs[j], rows, cols, p, xs[j], np.empty(p[4], np.uint8), logits[j])
    for j in range(1, addrs.shape[0]):
        for o in range(rows):
            logits[j, o] += biases[j - 1, o]
        topk_rows(logits[j:j + 1], tops.shape[1], tops[j - 1:j])


def routers(bufs: list, rows: int, cols: int, p: np.ndarray, x: np.ndarray, h: np.ndarray, norms: np.ndarray, eps,
            biases: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A MoE layer's router and the lookahead's, side by side on the engine's threads (one product each), for one
    row: (W0 x (1, rows), for each later router Wj (j >= 1) the k largest of Wj rms_norm(h, norms[j-1]) +
    biases[j-1], best first (len(bufs) - 1, k)): what dense(W0, x) and top(Wj, h, ...) give, in one call. Every W
    (rows, cols) in the same GGUF blocks (p = part_row()); x, h, norms, biases float32. Out of cache, as a decode step
    meets them, two routers' products take about the time of one side by side (results/router_cost.md)."""
    logits = np.empty((len(bufs), rows), np.float32)
    tops = np.empty((len(bufs) - 1, k), np.int64)
    _routers(np.array([b.ctypes.data for b in bufs], np.int64), rows, cols, p, x, h, norms, np.float32(eps), biases,
             logits, tops)
    return logits[:1], tops


def dense(buf: np.ndarray, rows: int, cols: int, p: np.ndarray, X: np.ndarray, Y: np.ndarray) -> None:
    """Y[r] = W X[r] for each row of X (float32, C order), W (rows, cols) in GGUF blocks at buf, p = part_row()."""
    _product(buf.ctypes.data, rows, cols, p, X, Y)


def part_row(kind: str, cols: int) -> np.ndarray:
    """One matrix's row of a parts table (at offset 0)."""
    return np.array((0, *part(kind, cols)), np.int64)


def dequantize(buf: np.ndarray, shape, kind: str) -> np.ndarray:
    """The matrix in float32, by ggml's own to_float (C, where the gguf package's numpy decoding is slow)."""
    base, _ = _libs()
    to_float = base.ggml_get_type_traits(type_id(kind)).contents.to_float
    if not to_float:
        raise WorkbenchError(f"{kind}: ggml has no conversion to float for this type")
    out = np.empty(shape, np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(to_float)(
        np.ascontiguousarray(buf).ctypes.data, out.ctypes.data, out.size)
    return out


def expert_parts(shapes: dict, kinds: dict, offsets: dict) -> np.ndarray:
    """The (3, 5) parts table of one layer's experts: gate, up, down at `offsets` in the slot."""
    out = np.zeros((3, 5), np.int64)
    for i, p in enumerate(("gate", "up", "down")):
        out[i] = (offsets[p], *part(kinds[p], shapes[p][1]))
    return out


def matvec(buf: np.ndarray, shape, kind: str, x: np.ndarray) -> np.ndarray:
    """W x for one matrix in GGUF blocks (rows, cols) = shape; x (cols,) float32. For tests and benchmarks."""
    rows, cols = shape
    p = part_row(kind, cols)
    buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    if buf.nbytes != rows * p[1]:
        raise ValueError(f"{kind} ({rows}, {cols}): {buf.nbytes} bytes, not {rows * p[1]}")
    y = np.empty(rows, np.float32)
    _matvec(buf.ctypes.data, rows, cols, p, np.ascontiguousarray(x, np.float32), np.empty(p[4], np.uint8), y)
    return y
