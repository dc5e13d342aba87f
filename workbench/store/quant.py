"""Numpy-only weight codecs: MLX-compatible affine quantization, bf16, f32.

Affine kinds ("q2", "q3", "q4", "q8") reproduce MLX's ``mx.quantize`` with
``group_size=64`` bit for bit, so the arrays we write can be handed straight
to ``mx.dequantize`` / ``mx.quantized_matmul`` / ``mx.gather_qmm``.

Per group of 64 consecutive values along the last axis MLX stores codes
``q`` in ``[0, 2**bits - 1]`` plus a scale and a bias, and reconstructs
``w ~= scale * q + bias``.

Packing: codes form one little-endian, least-significant-bit-first bit
stream per row.  For 2/4/8 bits that means ``32 // bits`` codes per uint32,
code ``k`` at bit ``k * bits``.  3 bits do not divide 32, so MLX packs 8 codes
into 3 bytes (a 24-bit little-endian word, code ``k`` at bit ``3 * k``) and
lays these 3-byte packs end to end; the uint32 array is just a view of those
bytes (64 codes = 24 bytes = 6 uint32 per group).  Both cases are the same
bit stream, so ``_pack`` handles all widths alike.

Buffer layout of one quantized matrix (``to_bytes``): packed codes, then
float16 scales, then float16 biases, all little-endian, row-major.

A checkpoint in MLX's own layout (mlx-lm's ``convert``; workbench/models/mlx_layout.py) holds the same
format at any width from 2 to 8 bits, any group size and scales in the model's dtype: kind
``mlx:q{bits}g{group}:{bf16|f16|f32}`` (``mlx_kind``), the same buffer layout with scales and biases in
that dtype. ``affine`` reads (bits, group, scale dtype) off any affine kind; the codes of every width are
one LSB-first bit stream, so a width without a lookup table unpacks bit by bit (``_unpack_bits``).
"""

from __future__ import annotations

import numpy as np

GROUP = 64
BITS = (2, 3, 4, 8)
KINDS = ("q2", "q3", "q4", "q8", "bf16", "f32")

_EPS = np.float32(1e-7)  # MLX's lower bound on |scale| (flat groups)
_SHIFTS = np.arange(8, dtype=np.uint64)  # code index within an 8-code pack


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


# --------------------------------------------------------------------------
# Bit packing
# --------------------------------------------------------------------------

def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes (..., n) < 2**bits into uint32 (..., n * bits // 32)."""
    lead, n = q.shape[:-1], q.shape[-1]
    # 8 codes always fill exactly `bits` bytes; build them in a uint64.
    q8 = q.reshape(*lead, n // 8, 8).astype(np.uint64)
    packs = np.bitwise_or.reduce(q8 << (_SHIFTS * bits), axis=-1)
    raw = packs.astype("<u8").view(np.uint8).reshape(*lead, n // 8, 8)
    raw = np.ascontiguousarray(raw[..., :bits])
    return raw.reshape(*lead, n * bits // 8).view("<u4").astype(np.uint32, copy=False)


def _code_table(chunk_bits: int, bits: int) -> np.ndarray:
    """float32 codes held in every possible chunk_bits-wide chunk of the stream."""
    chunk = np.arange(1 << chunk_bits, dtype=np.uint32)[:, None]
    shifts = np.arange(0, chunk_bits, bits, dtype=np.uint32)
    return ((chunk >> shifts) & np.uint32((1 << bits) - 1)).astype(np.float32)


# Unpacking is a table lookup per chunk: a byte for 2/4/8 bits, half a 3-byte
# pack (12 bits = 4 codes) for 3 bits.  np.take on these is ~3x faster than
# shifting and masking every code.
_TABLES = {bits: _code_table(12 if bits == 3 else 8, bits) for bits in BITS}


def _unpack(wq: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of _pack: uint32 (..., m) -> float32 codes (..., m * 32 // bits)."""
    raw = np.ascontiguousarray(wq, dtype="<u4").view(np.uint8)
    lead, n = raw.shape[:-1], wq.shape[-1] * 32 // bits
    if bits == 3:
        b = raw.reshape(*lead, -1, 3).astype(np.uint32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        raw = np.stack([word & np.uint32(0xFFF), word >> 12], axis=-1)
    return np.take(_TABLES[bits], raw, axis=0).reshape(*lead, n)


# --------------------------------------------------------------------------
# Affine quantization
# --------------------------------------------------------------------------

def _check_affine_shape(shape: tuple, kind: str) -> None:
    if len(shape) < 1 or shape[-1] % GROUP != 0:
        raise ValueError(
            f"affine kind {kind!r} needs the last dimension divisible by "
            f"{GROUP}; got shape {tuple(shape)} (use 'bf16' instead)"
        )


def _scales_biases(g: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group float32 scale and bias, exactly as MLX computes them."""
    n_bins = np.float32((1 << bits) - 1)
    w_min, w_max = g.min(axis=-1), g.max(axis=-1)
    # Anchor the grid at the endpoint with the larger magnitude.  A negative
    # scale anchors it at w_max and counts downwards.
    use_min = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, _EPS)
    scale = np.where(use_min, scale, -scale)
    edge = np.where(use_min, w_min, w_max)
    # Nudge the scale so that 0.0 falls exactly on a code (edge = q0 * scale).
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nz, edge / q0, scale)
    bias = np.where(nz, edge, np.float32(0))
    return scale.astype(np.float32), bias.astype(np.float32)


def quantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize float (out, in) to MLX affine group-64 format.

    Returns (wq uint32 (out, in*bits/32), scales f16 (out, in/64),
    biases f16 (out, in/64)), identical to ``mx.quantize(w, 64, bits)``
    (with its float32 scales/biases rounded to float16).
    """
    _check_bits(bits)
    w = np.asarray(w, dtype=np.float32)
    _check_affine_shape(w.shape, f"q{bits}")
    lead, n = w.shape[:-1], w.shape[-1]
    g = w.reshape(*lead, n // GROUP, GROUP)
    scale, bias = _scales_biases(g, bits)
    # Codes use the float32 scale/bias; only the stored copies are float16.
    q = np.rint((g - bias[..., None]) / scale[..., None])
    q = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(w.shape)
    return _pack(q, bits), scale.astype(np.float16), bias.astype(np.float16)


def dequantize(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of quantize: float32 (out, in) = scale * q + bias per group."""
    _check_bits(bits)
    codes = _unpack(wq, bits)  # fresh float32 array, safe to scale in place
    lead, n = codes.shape[:-1], codes.shape[-1]
    g = codes.reshape(*lead, n // GROUP, GROUP)
    s = np.asarray(scales, dtype=np.float32)[..., None]
    b = np.asarray(biases, dtype=np.float32)[..., None]
    g *= s
    g += b
    return g.reshape(*lead, n)


# --------------------------------------------------------------------------
# Flat byte buffers for one quantized matrix
# --------------------------------------------------------------------------

def _sizes(shape: tuple, bits: int) -> tuple[int, int]:
    """(bytes of packed codes, bytes of one of scales/biases)."""
    numel = int(np.prod(shape))
    return numel * bits // 8, numel // GROUP * 2


def _as_bytes(buf) -> np.ndarray:
    """Flat uint8 view of a numpy array or any bytes-like object."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def nbytes(shape: tuple, bits: int) -> int:
    """Size of the to_bytes buffer for a matrix of this shape."""
    _check_bits(bits)
    _check_affine_shape(tuple(shape), f"q{bits}")
    n_wq, n_sb = _sizes(shape, bits)
    return n_wq + 2 * n_sb


def to_bytes(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """Concatenate wq, scales, biases into one contiguous uint8 buffer."""
    parts = [
        np.ascontiguousarray(wq, dtype="<u4").reshape(-1).view(np.uint8),
        np.ascontiguousarray(scales, dtype="<f2").reshape(-1).view(np.uint8),
        np.ascontiguousarray(biases, dtype="<f2").reshape(-1).view(np.uint8),
    ]
    return np.concatenate(parts)


def from_bytes(buf, shape: tuple, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a to_bytes buffer back into (wq, scales, biases) for shape (out, in).

    The returned arrays are views into ``buf`` (no copy).
    """
    shape = tuple(shape)
    buf = _as_bytes(buf)
    expected = nbytes(shape, bits)
    if buf.size != expected:
        raise ValueError(
            f"buffer has {buf.size} bytes, expected {expected} for shape {shape} at {bits} bits"
        )
    n_wq, n_sb = _sizes(shape, bits)
    lead, n = shape[:-1], shape[-1]
    wq = buf[:n_wq].view("<u4").reshape(*lead, n * bits // 32)
    scales = buf[n_wq:n_wq + n_sb].view("<f2").reshape(*lead, n // GROUP)
    biases = buf[n_wq + n_sb:].view("<f2").reshape(*lead, n // GROUP)
    return wq, scales, biases


# --------------------------------------------------------------------------
# bfloat16
# --------------------------------------------------------------------------

def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round-to-nearest-even like torch."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to even.
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0  # torch's canonical NaN
    return out


def from_bf16(h: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------
# Dispatch by kind, used by the pack writer / reader
# --------------------------------------------------------------------------

def _bits_of(kind: str) -> int | None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return int(kind[1:]) if kind.startswith("q") else None


SCALE_DTYPES = {"f16": "<f2", "bf16": "<u2", "f32": "<f4"}


def mlx_kind(bits: int, group: int, scales: str) -> str:
    return f"mlx:q{bits}g{group}:{scales}"


def affine(kind: str) -> tuple[int, int, str] | None:
    """(bits, group size, scale dtype) of an affine kind (q2..q8: group 64, float16), None for any other."""
    if kind in ("q2", "q3", "q4", "q8"):
        return int(kind[1:]), GROUP, "f16"
    if kind.startswith("mlx:q"):
        q, sdt = kind[5:].split(":")
        bits, group = q.split("g")
        return int(bits), int(group), sdt
    return None


def affine_nbytes(shape: tuple, kind: str) -> int:
    """Bytes of one affine matrix of `shape` at `kind` (codes, then scales, then biases)."""
    bits, group, sdt = affine(kind)
    numel = int(np.prod(shape))
    return numel * bits // 8 + 2 * (numel // group) * np.dtype(SCALE_DTYPES[sdt]).itemsize


def affine_split(buf, shape: tuple, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint32 (..., in*bits/32), scales, biases float32 (..., in/group)) of one affine buffer of any kind."""
    bits, group, sdt = affine(kind)
    buf, shape = _as_bytes(buf), tuple(shape)
    if shape[-1] % group or (shape[-1] * bits) % 32 or buf.size != affine_nbytes(shape, kind):
        raise ValueError(f"buffer has {buf.size} bytes, not a {kind} matrix of shape {shape}")
    lead, n = shape[:-1], shape[-1]
    n_wq = int(np.prod(shape)) * bits // 8
    n_sb = (buf.size - n_wq) // 2
    wq = buf[:n_wq].view("<u4").reshape(*lead, n * bits // 32)
    sb = [buf[n_wq + i * n_sb:n_wq + (i + 1) * n_sb].view(SCALE_DTYPES[sdt]) for i in (0, 1)]
    sb = [from_bf16(a) if sdt == "bf16" else a.astype(np.float32) for a in sb]
    return wq, *(a.reshape(*lead, n // group) for a in sb)


def _unpack_bits(wq: np.ndarray, bits: int) -> np.ndarray:
    """Codes of any width from their LSB-first bit stream: uint32 (..., m) -> float32 (..., m * 32 // bits)."""
    raw = np.ascontiguousarray(wq, dtype="<u4").view(np.uint8)
    b = np.unpackbits(raw, axis=-1, bitorder="little")
    b = b.reshape(*raw.shape[:-1], -1, bits).astype(np.float32)
    return b @ (np.float32(2) ** np.arange(bits, dtype=np.float32))


def affine_decode(buf, shape: tuple, kind: str) -> np.ndarray:
    """float32 (shape) = scale * code + bias per group, for any affine kind."""
    bits, group, _ = affine(kind)
    wq, s, b = affine_split(buf, shape, kind)
    codes = _unpack(wq, bits) if bits in BITS else _unpack_bits(wq, bits)
    g = codes.reshape(*codes.shape[:-1], -1, group)
    g *= s[..., None]
    g += b[..., None]
    return g.reshape(shape)


def encoded_nbytes(shape: tuple, kind: str) -> int:
    """Size in bytes of encode(w, kind) for w of this shape."""
    if kind.startswith("mlx:"):
        return affine_nbytes(tuple(shape), kind)
    if kind == "f16":
        return 2 * int(np.prod(shape))
    bits = _bits_of(kind)
    shape = tuple(shape)
    if bits is not None:
        _check_affine_shape(shape, kind)
        return nbytes(shape, bits)
    return int(np.prod(shape)) * (2 if kind == "bf16" else 4)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """Encode a float32 array as a flat uint8 buffer of the given kind."""
    bits = None if kind == "f16" else _bits_of(kind)
    w = np.asarray(w, dtype=np.float32)
    if bits is not None:
        _check_affine_shape(w.shape, kind)
        return to_bytes(*quantize(w, bits))
    if kind == "bf16":
        return to_bf16(w).astype("<u2").reshape(-1).view(np.uint8)
    return np.ascontiguousarray(w, dtype="<f2" if kind == "f16" else "<f4").reshape(-1).view(np.uint8)


def decode(buf, shape: tuple, kind: str) -> np.ndarray:
    """Decode an encode() buffer (or a checkpoint's own: an mlx: kind, f16) back to float32 of the given shape."""
    if kind.startswith("mlx:"):
        return affine_decode(buf, shape, kind)
    if kind == "f16":
        return _as_bytes(buf).view("<f2").astype(np.float32).reshape(shape)
    bits = _bits_of(kind)
    shape = tuple(shape)
    buf = _as_bytes(buf)
    expected = encoded_nbytes(shape, kind)
    if buf.size != expected:
        raise ValueError(
            f"buffer has {buf.size} bytes, expected {expected} for shape {shape} kind {kind!r}"
        )
    if bits is not None:
        return dequantize(*from_bytes(buf, shape, bits), bits)
    if kind == "bf16":
        return from_bf16(buf.view("<u2")).reshape(shape)
    return buf.view("<f4").astype(np.float32).reshape(shape)
