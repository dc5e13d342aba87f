"""Compiled kernels (numba) that compute straight from the pack's encoded bytes: MLX's affine group-64
q2/q3/q4/q8 (codes, then float16 scales, then float16 biases; workbench/store/quant.py) and bf16; and the same
codes as a checkpoint in MLX's layout keeps them (group 64, scales and biases in bfloat16 or float16, each where it
lies in its slot: the parts table's offsets, a bf16 table in place of the float16 one: BF16).

No kernel library computes this layout exactly on the CPU: ggml's q4_1 takes the q4 bytes rearranged, but
quantizes the activations to q8_1 (about 1e-2 off the exact result); MLX's own CPU gather_qmm is the exact format
but slow here (results/kernels.md). So these are hand-written, and small: per group of 64 inputs,
    y[o] += scale[o, g] * sum_j q[o, g, j] x[g, j]  +  bias[o, g] * sum_j x[g, j]
(the affine form, so the codes are never turned into floats beside the dot product). float16 scales and biases
are looked up in a 65536-entry float32 table (exact); a bf16 value is its bits shifted into a float32's high half.
What makes them fast (results/kernels.md): x is reordered once per call to the order the codes lie in their
bytes (_phases), and each group's codes are sliced before the loop, so LLVM vectorizes unpack and dot product.
And past a byte's lowest code, codes are not masked out of their byte: with s_i = floor(byte / 2^(b i)) the
byte's shifts, code_i = s_i - 2^b s_(i+1), so sum_(i>=1) code_i x_i = s_1 x_1 + sum_(i>=2) s_i (x_i - 2^b x_(i-1)),
whose coefficients _phases makes once per x; such a code costs a multiply, a floor and a multiply-add (q2: 3 of a
byte's 4 codes, q3: 5 of a word's 8). A byte's lowest code is masked, as q4's are: telescoping from s_0, the byte
itself (up to 255 against a code of at most 7), moved the logits 2-3x further from the f32 reference.

`moe_layer` runs (token, expert) pairs a layer routed, gathered from their slots of a slot arena, in one call:
gate and up, silu * up, down, times the routing weight, each pair's result into its own row of `Y`, so the
caller sums them in a fixed order whatever order the experts arrived in. `decode_attention` is a decoded
token's attention after its projections (engines/packed_engine.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from workbench.store import quant

GROUP = quant.GROUP
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
BF16 = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)      # a scale's 2 bytes -> float32
SCALES = {"f16": F16, "bf16": BF16}
BITS = {"q2": 2, "q3": 3, "q4": 4, "q8": 8, "bf16": 16}


def part_nbytes(shape, kind: str) -> int:
    return quant.encoded_nbytes(tuple(shape), kind)


WIDTH = {2: 64, 3: 80, 4: 64, 8: 64}     # coefficients _phases makes per group of 64 inputs


@njit(cache=True, nogil=True)
def xp_len(cols):
    """Room for x in phase order (_phases) at any width: a q3 group takes 80 coefficients."""
    return cols + cols // 4


@njit(cache=True, fastmath=True, nogil=True)
def _phases(x, bits, xp, xs):
    """Per group of 64 inputs, the coefficients each byte's shifts multiply (see the module's docstring), in the
    order the kernels read them: for each shift of a byte, one coefficient per byte of the group (or of a q3
    group's 3-byte words), so each inner loop reads codes and coefficients contiguously and vectorizes; and each
    group's sum of x (the bias term). bf16 rows are not grouped: x is copied as it is.
        q8: x_j                       q4 (byte k: x_k low nibble, x_(32+k) high): x_k, x_(32+k)
        q2 (byte k: x_k, x_(16+k), x_(32+k), x_(48+k)): for its low code and shifts by 2, 4, 6: x_k,
            x_(16+k), x_(32+k) - 4 x_(16+k), x_(48+k) - 4 x_(32+k)
        q3 (word k: codes x_(8k+q), q = 0..7 at bits 3q, across its bytes b0 b1 b2): b0's low code and its shifts
            by 3 and 6: x0, x1, x2 - 8 x1; b1's bit 0 (code 2's bit 2) and its shifts by 1, 4, 7: 4 x2, x3,
            x4 - 8 x3, x5 - 8 x4; b2's bits 0-1 (code 5's bits 1-2) and its shifts by 2, 5: 2 x5, x6, x7 - 8 x6"""
    if bits == 16:
        xp[:x.shape[0]] = x
        return
    for g in range(xs.shape[0]):
        xg = x[g * GROUP:(g + 1) * GROUP]
        s = np.float32(0.0)
        for j in range(GROUP):
            s += xg[j]
        xs[g] = s
        if bits == 8:
            o = xp[g * GROUP:(g + 1) * GROUP]
            o[:] = xg
        elif bits == 4:
            o = xp[g * GROUP:(g + 1) * GROUP]
            for k in range(32):
                o[k], o[32 + k] = xg[2 * k], xg[2 * k + 1]
        elif bits == 2:
            o = xp[g * GROUP:(g + 1) * GROUP]
            for k in range(16):
                o[k], o[16 + k] = xg[4 * k], xg[4 * k + 1]
                for c in range(2, 4):
                    o[16 * c + k] = xg[4 * k + c] - np.float32(4) * xg[4 * k + c - 1]
        else:
            o = xp[g * 80:(g + 1) * 80]
            for k in range(8):
                q = xg[8 * k:8 * k + 8]
                e = np.float32(8)
                o[k], o[8 + k], o[16 + k] = q[0], q[1], q[2] - e * q[1]
                o[24 + k], o[32 + k], o[40 + k], o[48 + k] = np.float32(4) * q[2], q[3], q[4] - e * q[3], q[5] - e * q[4]
                o[56 + k], o[64 + k], o[72 + k] = np.float32(2) * q[5], q[6], q[7] - e * q[6]


def _affine_kernel(bits: int):
    """The affine group-64 matrix at buf[off:] times x, for one code width: each group's codes and inputs are
    sliced before the inner loop (no index arithmetic in it) and the width is fixed, so LLVM vectorizes the
    unpack and the dot product."""
    gb = GROUP * bits // 8                      # bytes of one group's codes
    width = WIDTH[bits]                         # its coefficients in xp (_phases)

    @njit(cache=True, fastmath=True, nogil=True)
    def kernel(buf, off, sc, bi, rows, cols, xp, xs, y, f16):
        """Codes at buf[off:], 2-byte scales at buf[sc:] and biases at buf[bi:], (rows, groups) each."""
        groups = cols // GROUP
        for o in range(rows):
            acc = np.float32(0.0)
            for g in range(groups):
                c = buf[off + (o * groups + g) * gb: off + (o * groups + g + 1) * gb]
                xg = xp[g * width: (g + 1) * width]
                dot = np.float32(0.0)
                # A byte is split in float32, exactly (integers below 2^8; the floor of a product by a power of two).
                # Integer shifts and masks are widened to 64-bit lanes by numba's integer typing, 8 a vector instead
                # of float32's 16: slower (benchmarks/kernels.py times the kernels).
                if bits == 4:
                    for k in range(32):
                        f = np.float32(c[k])
                        hi = np.floor(f * np.float32(1 / 16))
                        dot += (f - np.float32(16) * hi) * xg[k] + hi * xg[32 + k]
                elif bits == 8:
                    for k in range(64):
                        dot += np.float32(c[k]) * xg[k]
                elif bits == 2:
                    for k in range(16):
                        f = np.float32(c[k])
                        a = np.floor(f * np.float32(1 / 4))
                        dot += ((f - np.float32(4) * a) * xg[k] + a * xg[16 + k]
                                + np.floor(f * np.float32(1 / 16)) * xg[32 + k]
                                + np.floor(f * np.float32(1 / 64)) * xg[48 + k])
                else:                           # 3 bits: 8 codes in each 3-byte little-endian word
                    for k in range(8):
                        b0, b1, b2 = np.float32(c[3 * k]), np.float32(c[3 * k + 1]), np.float32(c[3 * k + 2])
                        s1, u1, v1 = (np.floor(b0 * np.float32(1 / 8)), np.floor(b1 * np.float32(1 / 2)),
                                      np.floor(b2 * np.float32(1 / 4)))
                        dot += ((b0 - np.float32(8) * s1) * xg[k] + s1 * xg[8 + k]
                                + np.floor(b0 * np.float32(1 / 64)) * xg[16 + k]
                                + (b1 - np.float32(2) * u1) * xg[24 + k] + u1 * xg[32 + k]
                                + np.floor(b1 * np.float32(1 / 16)) * xg[40 + k]
                                + np.floor(b1 * np.float32(1 / 128)) * xg[48 + k]
                                + (b2 - np.float32(4) * v1) * xg[56 + k] + v1 * xg[64 + k]
                                + np.floor(b2 * np.float32(1 / 32)) * xg[72 + k])
                i = 2 * (o * groups + g)
                s = f16[np.uint32(buf[sc + i]) | (np.uint32(buf[sc + i + 1]) << np.uint32(8))]
                b = f16[np.uint32(buf[bi + i]) | (np.uint32(buf[bi + i + 1]) << np.uint32(8))]
                acc += s * dot + b * xs[g]
            y[o] = acc
    return kernel


_q2, _q3, _q4, _q8 = (_affine_kernel(b) for b in (2, 3, 4, 8))


@njit(cache=True, fastmath=True, nogil=True)
def qmv(buf, off, rows, cols, bits, xp, xs, y, f16, words):
    """y[:rows] = W x for the matrix encoded at buf[off:] (affine group-64 at `bits`, or bf16 when bits == 16);
    xp, xs: x in phase order and its group sums (_phases). words: uint32 scratch of `cols` (bf16 rows widened
    to float32 bit patterns, then read as float32)."""
    sc = off + rows * cols * bits // 8          # the pack's layout: codes, then scales, then biases
    qmv_at(buf, off, sc, sc + 2 * rows * (cols // GROUP), rows, cols, bits, xp, xs, y, f16, words)


@njit(cache=True, fastmath=True, nogil=True)
def qmv_at(buf, off, sc, bi, rows, cols, bits, xp, xs, y, f16, words):
    """qmv with the scales at buf[sc:] and the biases at buf[bi:] wherever they lie."""
    if bits == 4:
        _q4(buf, off, sc, bi, rows, cols, xp, xs, y, f16)
    elif bits == 8:
        _q8(buf, off, sc, bi, rows, cols, xp, xs, y, f16)
    elif bits == 3:
        _q3(buf, off, sc, bi, rows, cols, xp, xs, y, f16)
    elif bits == 2:
        _q2(buf, off, sc, bi, rows, cols, xp, xs, y, f16)
    if bits != 16:
        return
    wf = words.view(np.float32)
    for o in range(rows):
        row = buf[off + 2 * o * cols: off + 2 * (o + 1) * cols]
        for j in range(cols):
            words[j] = (np.uint32(row[2 * j]) << np.uint32(16)) | (np.uint32(row[2 * j + 1]) << np.uint32(24))
        acc = np.float32(0.0)
        for j in range(cols):
            acc += wf[j] * xp[j]
        y[o] = acc


@njit(cache=True, fastmath=True, nogil=True)
def dense(buf, rows, cols, bits, X, Y, f16):
    """Y[t] = W X[t] for each row t of X, W the (rows, cols) matrix encoded in buf (a resident projection)."""
    xp = np.empty(xp_len(cols), np.float32)
    xs = np.empty(max(cols // GROUP, 1), np.float32)
    words = np.empty(cols, np.uint32)
    for t in range(X.shape[0]):
        _phases(X[t], bits, xp, xs)
        qmv(buf, 0, rows, cols, bits, xp, xs, Y[t], f16, words)


@njit(cache=True, fastmath=True, nogil=True)
def moe_layer(arena, slot_off, tok, dst, weight, X, Y, parts, d, ff, f16):
    """For each pair p: Y[dst[p]] = weight[p] * down(silu(gate x) * up x), x = X[tok[p]], the expert's bytes at
    arena[slot_off[p]:]. parts: (3, 4) int64 of (byte offset in the slot of the codes, bits, of the scales, of the
    biases) for gate, up, down (expert_parts)."""
    moe_pairs(arena, slot_off, np.zeros((slot_off.shape[0], 9), np.int64), tok, dst, weight, X, Y, parts, d, ff, f16)


@njit(cache=True, fastmath=True, nogil=True)
def moe_pairs(arena, slot_off, heads, tok, dst, weight, X, Y, parts, d, ff, f16):
    """moe_layer, with pair p's codes, scales and biases of part i at heads[p, 3 i + j] bytes past their offsets
    (j = 0, 1, 2): a checkpoint's bytes read into the slot from the 4 KiB boundary before where they lie."""
    g = np.empty(ff, np.float32)
    u = np.empty(ff, np.float32)
    y = np.empty(d, np.float32)
    xp = np.empty(xp_len(d), np.float32)
    hp = np.empty(xp_len(ff), np.float32)
    xs = np.empty(max(d // GROUP, 1), np.float32)
    hs = np.empty(max(ff // GROUP, 1), np.float32)
    words = np.empty(max(d, ff), np.uint32)
    same = parts[1, 1] == parts[0, 1]
    last = -1                                   # the token whose x is in xp (a token's top-k pairs share it)
    for p in range(slot_off.shape[0]):
        base, h = slot_off[p], heads[p]
        if tok[p] != last or not same:
            _phases(X[tok[p]], parts[0, 1], xp, xs)
            last = tok[p]
        qmv_at(arena, base + parts[0, 0] + h[0], base + parts[0, 2] + h[1], base + parts[0, 3] + h[2], ff, d,
               parts[0, 1], xp, xs, g, f16, words)
        if not same:
            _phases(X[tok[p]], parts[1, 1], xp, xs)
        qmv_at(arena, base + parts[1, 0] + h[3], base + parts[1, 2] + h[4], base + parts[1, 3] + h[5], ff, d,
               parts[1, 1], xp, xs, u, f16, words)
        for j in range(ff):
            g[j] = g[j] / (np.float32(1.0) + np.exp(-g[j])) * u[j]
        _phases(g, parts[2, 1], hp, hs)
        qmv_at(arena, base + parts[2, 0] + h[6], base + parts[2, 2] + h[7], base + parts[2, 3] + h[8], d, ff,
               parts[2, 1], hp, hs, y, f16, words)
        w = weight[p]
        r = dst[p]
        for j in range(d):
            Y[r, j] = w * y[j]


@njit(cache=True, nogil=True)
def slots_of(flat, experts, offsets):
    """Per expert id the flat top-k routes to: its slot's byte offset if it is in this batch (experts[i] at
    offsets[i]), else -1."""
    n = 0
    for p in range(flat.shape[0]):
        n = max(n, flat[p] + 1)
    slot_of = np.full(n, -1, np.int64)
    for i in range(experts.shape[0]):
        if experts[i] < n:
            slot_of[experts[i]] = offsets[i]
    return slot_of


@njit(cache=True, fastmath=True, nogil=True)
def moe_ready(arena, experts, offsets, flat, k, weight, X, Y, parts, heads, d, ff, f16):
    """moe_pairs on the pairs of a layer whose expert is in a batch that is in memory (experts[i], its slot at byte
    offsets[i]): pair p of the flat top-k is token p // k, and its result goes to row p of Y. heads: (experts, 9),
    where each expert's codes, scales, biases lie past their offsets (zeros for a pack; moe_pairs)."""
    slot_of = slots_of(flat, experts, offsets)
    pairs = np.empty(flat.shape[0], np.int64)
    m = 0
    for p in range(flat.shape[0]):
        if slot_of[flat[p]] >= 0:
            pairs[m] = p
            m += 1
    pairs = pairs[:m]
    moe_pairs(arena, slot_of[flat[pairs]], heads[flat[pairs]], pairs // k, pairs, weight[pairs], X, Y, parts, d, ff,
              f16)


def affine_of(kind: str) -> tuple[int, str] | None:
    """(bits, scale dtype) of a kind these kernels compute (group 64, 2-byte scales; bf16: (16, "")), else None."""
    if kind == "bf16":
        return 16, ""
    a = quant.affine(kind)
    if a is None or a[0] not in (2, 3, 4, 8) or a[1] != GROUP or a[2] not in SCALES:
        return None
    return a[0], a[2]


def expert_parts(shapes: dict, kinds: dict, offsets: dict | None = None) -> tuple[np.ndarray, int]:
    """(3, 4) (byte offset of the codes, bits, of the scales, of the biases) of gate, up, down: at `offsets` ({part:
    offset}, the codes then the scales then the biases from there, or {part: (codes, scales, biases) offsets}),
    else laid end to end; and the expert's bytes."""
    parts, off = np.zeros((3, 4), np.int64), 0
    for i, p in enumerate(("gate", "up", "down")):
        (rows, cols), bits = shapes[p], affine_of(kinds[p])[0]
        at = offsets[p] if offsets else off
        codes, sb = rows * cols * bits // 8, 2 * rows * (cols // GROUP)
        if isinstance(at, tuple):           # where each of its reads landed: codes (then scales, biases)
            at = at if len(at) == 3 else (at[0], at[0] + codes, at[0] + codes + sb)
            parts[i] = (at[0], bits, at[1], at[2])
        else:
            parts[i] = (at, bits, at + codes, at + codes + sb)
        off += part_nbytes(shapes[p], kinds[p])
    return parts, off


def matvec(buf: np.ndarray, shape, kind: str, x: np.ndarray) -> np.ndarray:
    """W x for one encoded matrix (rows, cols) = shape; x (cols,) float32. For tests and the kernel benchmark."""
    rows, cols = shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    xp, xs = np.empty(xp_len(cols), np.float32), np.empty(max(cols // GROUP, 1), np.float32)
    _phases(x, affine_of(kind)[0], xp, xs)
    y = np.empty(rows, np.float32)
    bits, sdt = affine_of(kind)
    qmv(np.ascontiguousarray(buf).view(np.uint8).reshape(-1), 0, rows, cols, bits, xp, xs, y, SCALES.get(sdt, F16),
        np.empty(cols, np.uint32))
    return y


@njit(cache=True, fastmath=True, nogil=True)
def rms_norm(x, w, eps, y):
    """y = w * RMSNorm(x) per row of x (rows, n), in float32 as _head_norm_rope's."""
    rows, n = x.shape
    for i in range(rows):
        ss = np.float32(0.0)
        for j in range(n):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        for j in range(n):
            y[i, j] = w[j] * (x[i, j] * r)


@njit(cache=True, fastmath=True, nogil=True)
def _head_norm_rope(a, w, eps, cos, sin, norm):
    """One head in place: RMSNorm with weight w (when norm), then rotate-half RoPE on its first len(cos) dims."""
    hd, rd = a.shape[0], cos.shape[0]
    if norm:
        ss = np.float32(0.0)
        for j in range(hd):
            ss += a[j] * a[j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(hd) + eps)
        for j in range(hd):
            a[j] = w[j] * (a[j] * r)
    h = rd // 2
    for j in range(h):
        lo, hi = a[j], a[j + h]
        a[j] = lo * cos[j] - hi * sin[j]
        a[j + h] = hi * cos[j + h] + lo * sin[j + h]


@njit(cache=True, fastmath=True, nogil=True)
def decode_attention(q, k, v, q_norm, k_norm, eps, norm, cos, sin, K, V, pos, scale, y):
    """One token's grouped-query attention after its q/k/v projections: per-head RMSNorm (Qwen3's qk-norm, when
    norm) and RoPE on q and k, k and v appended to the KV cache K, V (kv heads, capacity, head dim) at `pos`, then
    softmax(q K^T * scale) V over the pos + 1 keys. q: (heads, hd), k, v: (kv heads, hd); y: (heads, hd)."""
    H, hd = q.shape
    Hk = k.shape[0]
    rep = H // Hk
    for g in range(Hk):
        _head_norm_rope(k[g], k_norm, eps, cos, sin, norm)
        K[g, pos] = k[g]
        V[g, pos] = v[g]
    S = pos + 1
    att = np.empty(S, np.float32)
    for hh in range(H):
        a = q[hh]
        _head_norm_rope(a, q_norm, eps, cos, sin, norm)
        Kg, Vg = K[hh // rep], V[hh // rep]
        m = -np.inf
        for s in range(S):
            dot = np.float32(0.0)
            for j in range(hd):
                dot += a[j] * Kg[s, j]
            att[s] = dot * scale
            m = max(m, att[s])
        tot = np.float32(0.0)
        for s in range(S):
            att[s] = np.exp(att[s] - m)
            tot += att[s]
        for j in range(hd):
            y[hh, j] = 0.0
        for s in range(S):
            p = att[s] / tot
            for j in range(hd):
                y[hh, j] += p * Vg[s, j]


@njit(cache=True, fastmath=True, nogil=True)
def delta_rule(S, q, k, v, beta, decay, out, o):
    """One token of the gated delta rule (engines/hybrid.py) in two passes over the state instead of numpy's six
    arrays of its size: per value head h, out[h] = decay S[h] + k (beta (v - (decay S[h])^T k))^T, o[h] = out[h]^T q.
    S, out: (heads, key dim, value dim); q, k: (heads, key dim); v, o: (heads, value dim); beta, decay: (heads,)."""
    H, dk, dv = S.shape
    kS = np.empty(dv, np.float32)
    for h in range(H):
        g = decay[h]
        kS[:] = 0.0
        for i in range(dk):
            ki = k[h, i] * g
            for j in range(dv):
                kS[j] += ki * S[h, i, j]
        for j in range(dv):
            kS[j] = (v[h, j] - kS[j]) * beta[h]          # delta
            o[h, j] = 0.0
        for i in range(dk):
            ki, qi = k[h, i], q[h, i]
            for j in range(dv):
                s = g * S[h, i, j] + ki * kS[j]
                out[h, i, j] = s
                o[h, j] += qi * s
