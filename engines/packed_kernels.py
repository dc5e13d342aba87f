"""Compiled kernels (numba) that compute straight from the pack's encoded bytes: MLX's affine group-64
q2/q3/q4/q8 (codes, then float16 scales, then float16 biases; workbench/store/quant.py) and bf16.

No kernel library covers this layout on the CPU (ggml's q4_1 is affine but in 32-blocks with scale and min
interleaved per block and nibbles in another order; MLX's own CPU gather_qmm is the exact format but slow here:
results/kernels.md). So these are hand-written, and small: per group of 64 inputs,
    y[o] += scale[o, g] * sum_j q[o, g, j] x[g, j]  +  bias[o, g] * sum_j x[g, j]
(the affine form, so the codes are never turned into floats beside the dot product). float16 and bf16 values
are looked up in 65536-entry float32 tables: exact, and cheaper than converting bit fields in the loop.

`moe_layer` runs (token, expert) pairs a layer routed, gathered from their slots of a slot arena, in one call:
gate and up, silu * up, down, times the routing weight, each pair's result into its own row of `Y`, so the
caller sums them in a fixed order whatever order the experts arrived in.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from workbench.store import quant

GROUP = quant.GROUP
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
BF16 = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
BITS = {"q2": 2, "q3": 3, "q4": 4, "q8": 8, "bf16": 16}


def part_nbytes(shape, kind: str) -> int:
    return quant.encoded_nbytes(tuple(shape), kind)


@njit(cache=True, fastmath=True, nogil=True)
def _group_sums(x, out):
    for g in range(out.shape[0]):
        s = np.float32(0.0)
        for j in range(GROUP):
            s += x[g * GROUP + j]
        out[g] = s


@njit(cache=True, fastmath=True, nogil=True)
def qmv(buf, off, rows, cols, bits, x, xs, y, f16, bf16):
    """y[:rows] = W x for the matrix encoded at buf[off:] (affine group-64 at `bits`, or bf16 when bits == 16);
    xs holds x's group sums."""
    if bits == 16:
        for o in range(rows):
            base = off + 2 * o * cols
            acc = np.float32(0.0)
            for j in range(cols):
                acc += bf16[buf[base + 2 * j] | (np.uint32(buf[base + 2 * j + 1]) << 8)] * x[j]
            y[o] = acc
        return
    groups = cols // GROUP
    row_bytes = cols * bits // 8
    sc = off + rows * row_bytes                 # float16 scales, then biases, (rows, groups) each
    bi = sc + 2 * rows * groups
    for o in range(rows):
        acc = np.float32(0.0)
        r = off + o * row_bytes
        for g in range(groups):
            dot = np.float32(0.0)
            xg = g * GROUP
            if bits == 4:
                b0 = r + g * 32
                for k in range(32):
                    b = buf[b0 + k]
                    dot += np.float32(b & 15) * x[xg + 2 * k] + np.float32(b >> 4) * x[xg + 2 * k + 1]
            elif bits == 8:
                b0 = r + g * 64
                for k in range(64):
                    dot += np.float32(buf[b0 + k]) * x[xg + k]
            elif bits == 2:
                b0 = r + g * 16
                for k in range(16):
                    b = buf[b0 + k]
                    dot += (np.float32(b & 3) * x[xg + 4 * k] + np.float32((b >> 2) & 3) * x[xg + 4 * k + 1]
                            + np.float32((b >> 4) & 3) * x[xg + 4 * k + 2] + np.float32(b >> 6) * x[xg + 4 * k + 3])
            else:                               # 3 bits: 8 codes in each 3-byte little-endian word
                b0 = r + g * 24
                for k in range(8):
                    w = (np.uint32(buf[b0 + 3 * k]) | (np.uint32(buf[b0 + 3 * k + 1]) << 8)
                         | (np.uint32(buf[b0 + 3 * k + 2]) << 16))
                    for c in range(8):
                        dot += np.float32((w >> (3 * c)) & 7) * x[xg + 8 * k + c]
            i = 2 * (o * groups + g)
            s = f16[buf[sc + i] | (np.uint32(buf[sc + i + 1]) << 8)]
            b = f16[buf[bi + i] | (np.uint32(buf[bi + i + 1]) << 8)]
            acc += s * dot + b * xs[g]
        y[o] = acc


@njit(cache=True, fastmath=True, nogil=True)
def moe_layer(arena, slot_off, tok, dst, weight, X, Y, parts, d, ff, f16, bf16):
    """For each pair p: Y[dst[p]] = weight[p] * down(silu(gate x) * up x), x = X[tok[p]], the expert's bytes at
    arena[slot_off[p]:]. parts: (3, 2) int64 of (byte offset in the slot, bits) for gate, up, down."""
    g = np.empty(ff, np.float32)
    u = np.empty(ff, np.float32)
    y = np.empty(d, np.float32)
    xs = np.empty(max(d // GROUP, 1), np.float32)
    hs = np.empty(max(ff // GROUP, 1), np.float32)
    for p in range(slot_off.shape[0]):
        x = X[tok[p]]
        base = slot_off[p]
        if parts[0, 1] != 16 or parts[1, 1] != 16:
            _group_sums(x, xs)
        qmv(arena, base + parts[0, 0], ff, d, parts[0, 1], x, xs, g, f16, bf16)
        qmv(arena, base + parts[1, 0], ff, d, parts[1, 1], x, xs, u, f16, bf16)
        for j in range(ff):
            g[j] = g[j] / (np.float32(1.0) + np.exp(-g[j])) * u[j]
        if parts[2, 1] != 16:
            _group_sums(g, hs)
        qmv(arena, base + parts[2, 0], d, ff, parts[2, 1], g, hs, y, f16, bf16)
        w = weight[p]
        r = dst[p]
        for j in range(d):
            Y[r, j] = w * y[j]


def expert_parts(shapes: dict, kinds: dict, offsets: dict | None = None) -> tuple[np.ndarray, int]:
    """(3, 2) (byte offset, bits) of gate, up, down: at `offsets`, else laid end to end; and the expert's bytes."""
    parts, off = np.zeros((3, 2), np.int64), 0
    for i, p in enumerate(("gate", "up", "down")):
        parts[i] = (offsets[p] if offsets else off), BITS[kinds[p]]
        off += part_nbytes(shapes[p], kinds[p])
    return parts, off


def matvec(buf: np.ndarray, shape, kind: str, x: np.ndarray) -> np.ndarray:
    """W x for one encoded matrix (rows, cols) = shape; x (cols,) float32. For tests and the kernel benchmark."""
    rows, cols = shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    xs = np.empty(max(cols // GROUP, 1), np.float32)
    if kind != "bf16":
        _group_sums(x, xs)
    y = np.empty(rows, np.float32)
    qmv(np.ascontiguousarray(buf).view(np.uint8).reshape(-1), 0, rows, cols, BITS[kind], x, xs, y, F16, BF16)
    return y
