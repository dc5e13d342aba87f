"""Specification of workbench.store.quant.

Affine kinds must be byte-compatible with MLX (group_size=64), bf16 must round
like torch, and every kind must round-trip through encode/decode with the
size that encoded_nbytes promises.
"""

import numpy as np
import pytest

from workbench.store import quant as Q

BITS = [2, 3, 4, 8]
SHAPES = [(8, 128), (16, 256)]


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def groups(a):
    """(out, in) -> (out, in // 64, 64)."""
    return a.reshape(a.shape[0], -1, 64)


# ---------------------------------------------------------------- quantize


@pytest.mark.parametrize("bits", BITS)
def test_quantize_shapes_and_dtypes_match_mlx_convention(bits):
    wq, scales, biases = Q.quantize(rand((16, 256)), bits)
    assert wq.dtype == np.uint32 and wq.shape == (16, 256 * bits // 32)
    assert scales.dtype == np.float16 and scales.shape == (16, 4)
    assert biases.dtype == np.float16 and biases.shape == (16, 4)


@pytest.mark.parametrize("bits", BITS)
def test_roundtrip_error_bounds(bits):
    """Codes below the top one are within scale/2; the top code within scale.

    MLX snaps the grid so that 0.0 is exactly representable, which can shrink
    the step and clip the far end of the range into the top code: that costs
    up to one full step there (see test_zero_snap_clips_top_code).  On top
    comes the float16 rounding of the stored scale and bias.
    """
    w = rand((64, 256), seed=bits)
    wq, scales, biases = Q.quantize(w, bits)
    err = groups(np.abs(Q.dequantize(wq, scales, biases, bits) - w))
    top = (1 << bits) - 1
    codes = groups(Q._unpack(wq, bits))

    s = np.abs(scales.astype(np.float32))[..., None]
    b = np.abs(biases.astype(np.float32))[..., None]
    fp16 = 2.0**-10 * (top * s + b) + 1e-6  # |code*ds + db|, with margin
    assert np.all(err[codes < top] <= (s / 2 + fp16).repeat(64, -1)[codes < top])
    assert np.all(err <= s + fp16)


def test_zero_snap_clips_top_code():
    # Range [-1, 0.9] at 2 bits: step (1.9/3) is nudged to 0.5 so that the grid
    # -1, -0.5, 0, 0.5 hits 0 exactly; 0.9 is clipped to 0.5 (error 0.4 > 0.25).
    w = np.linspace(-1, 0.9, 64, dtype=np.float32)[None]
    w[0, 20] = 0.0
    wq, scales, biases = Q.quantize(w, 2)
    assert scales[0, 0] == 0.5 and biases[0, 0] == -1.0
    d = Q.dequantize(wq, scales, biases, 2)
    assert d[0, 20] == 0.0
    assert d[0, -1] == 0.5


def test_flat_groups_are_exact_in_float16():
    w = np.zeros((2, 128), np.float32)
    w[1, 64:] = 0.3
    d = Q.dequantize(*Q.quantize(w, 4), 4)
    assert np.all(d[0] == 0.0) and np.all(d[1, :64] == 0.0)
    assert np.all(d[1, 64:] == np.float32(np.float16(0.3)))


@pytest.mark.parametrize("bits", BITS)
def test_packing_is_a_little_endian_lsb_first_bit_stream(bits):
    """Code i of a row sits at bit bits*i of the row's bytes.  For 3 bits that
    means 8 codes per 3-byte pack, packs laid end to end (and straddling the
    uint32 words), not 10 codes per uint32."""
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 128)).astype(np.uint8)
    wq = Q._pack(codes, bits)
    assert wq.dtype == np.uint32 and wq.shape == (3, 128 * bits // 32)
    for row, packed in zip(codes, wq):
        stream = sum(int(c) << (bits * i) for i, c in enumerate(row))
        assert int.from_bytes(packed.astype("<u4").tobytes(), "little") == stream
    np.testing.assert_array_equal(Q._unpack(wq, bits), codes)


def test_bad_bits_rejected():
    with pytest.raises(ValueError):
        Q.quantize(rand((1, 64)), 5)


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("bits", BITS)
def test_to_bytes_layout_and_roundtrip(bits):
    wq, scales, biases = Q.quantize(rand((16, 256)), bits)
    buf = Q.to_bytes(wq, scales, biases)
    assert buf.dtype == np.uint8 and buf.size == Q.nbytes((16, 256), bits)
    assert buf.size == wq.nbytes + scales.nbytes + biases.nbytes
    assert buf[: wq.nbytes].tobytes() == wq.tobytes()  # wq, scales, biases
    assert buf[-biases.nbytes :].tobytes() == biases.tobytes()
    for got, want in zip(Q.from_bytes(buf, (16, 256), bits), (wq, scales, biases)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_from_bytes_rejects_wrong_size():
    buf = Q.to_bytes(*Q.quantize(rand((8, 128)), 4))
    with pytest.raises(ValueError):
        Q.from_bytes(buf[:-1], (8, 128), 4)


# ---------------------------------------------------------------- bf16


def test_bf16_round_to_nearest_even_without_torch():
    one = 0x3F800000
    x = np.array([one, one + 0x8000, one + 0x18000, one + 0x8001], np.uint32).view(np.float32)
    # exact, tie -> even (down), tie -> even (up), above tie -> up
    assert Q.to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81]


def test_bf16_matches_torch_bit_patterns():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([
        (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(np.float32),
        rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, 1e-45], np.float32),
    ])
    assert x.dtype == np.float32
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = Q.to_bf16(x)
    # NaN payloads differ between torch's scalar (0x7FC0) and SIMD (0xFFFF)
    # paths; we always write 0x7FC0.  Everything else is bit-exact.
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(got[nan] == 0x7FC0) and nan.any()
    back = torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(Q.from_bf16(want).view(np.uint32), back.view(np.uint32))


# ---------------------------------------------------------------- encode


@pytest.mark.parametrize("kind", Q.KINDS)
def test_encode_decode_sizes_and_values(kind):
    w = rand((16, 256))
    buf = Q.encode(w, kind)
    assert buf.dtype == np.uint8 and buf.size == Q.encoded_nbytes(w.shape, kind)
    out = Q.decode(buf.tobytes(), w.shape, kind)  # any bytes-like is accepted
    assert out.dtype == np.float32 and out.shape == w.shape
    if kind == "f32":
        np.testing.assert_array_equal(out, w)
    elif kind == "bf16":
        np.testing.assert_array_equal(out, Q.from_bf16(Q.to_bf16(w)))
    else:
        bits = int(kind[1:])
        np.testing.assert_array_equal(out, Q.dequantize(*Q.quantize(w, bits), bits))


def test_encoded_sizes():
    assert Q.encoded_nbytes((16, 256), "f32") == 16 * 256 * 4
    assert Q.encoded_nbytes((16, 256), "bf16") == 16 * 256 * 2
    for bits in BITS:  # codes + fp16 scale and bias per 64 values
        assert Q.encoded_nbytes((16, 256), f"q{bits}") == 16 * 256 * bits // 8 + 16 * 4 * 4


@pytest.mark.parametrize("kind", ["q2", "q3", "q4", "q8"])
def test_affine_kinds_need_in_divisible_by_64(kind):
    w = rand((4, 96))
    for call in (lambda: Q.encode(w, kind), lambda: Q.encoded_nbytes(w.shape, kind)):
        with pytest.raises(ValueError) as e:
            call()
        assert all(s in str(e.value) for s in ("(4, 96)", kind, "64"))
    assert Q.decode(Q.encode(w, "bf16"), w.shape, "bf16").shape == w.shape  # the fallback


def test_unknown_kind_and_bad_buffer_rejected():
    with pytest.raises(ValueError, match="kind"):
        Q.encode(rand((1, 64)), "q5")
    with pytest.raises(ValueError, match="bytes"):
        Q.decode(np.zeros(10, np.uint8), (1, 64), "f32")


# ---------------------------------------------------------------- MLX


@pytest.fixture(scope="module")
def mx():
    return pytest.importorskip("mlx.core")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_bytes_equal_mlx(mx, bits, shape):
    w = rand(shape, seed=bits)
    wq, scales, biases = Q.quantize(w, bits)

    # float32 input: MLX keeps float32 scales/biases; ours are those in float16.
    mq, ms, mb = (np.array(a) for a in mx.quantize(mx.array(w), group_size=64, bits=bits))
    assert mq.dtype == np.uint32 and wq.tobytes() == mq.tobytes()
    assert scales.tobytes() == ms.astype(np.float16).tobytes()
    assert biases.tobytes() == mb.astype(np.float16).tobytes()

    # float16 input: MLX returns float16 scales/biases, all three byte-equal.
    w16 = w.astype(np.float16)
    mq, ms, mb = (np.array(a) for a in mx.quantize(mx.array(w16), group_size=64, bits=bits))
    ours = Q.quantize(w16.astype(np.float32), bits)
    for a, b in zip(ours, (mq, ms, mb)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_equals_mlx(mx, bits, shape):
    wq, scales, biases = Q.quantize(rand(shape, seed=10 + bits), bits)
    # float32 scales so that MLX also computes (and returns) in float32
    want = mx.dequantize(
        mx.array(wq), mx.array(scales.astype(np.float32)), mx.array(biases.astype(np.float32)),
        group_size=64, bits=bits,
    )
    np.testing.assert_array_equal(Q.dequantize(wq, scales, biases, bits), np.array(want))


@pytest.mark.parametrize("bits", BITS)
def test_mlx_matmul_kernels_accept_our_bytes(mx, bits):
    w = rand((64, 128), seed=bits)
    x = rand((3, 128), seed=99)
    wq, scales, biases = Q.from_bytes(Q.encode(w, f"q{bits}"), w.shape, bits)
    want = x @ Q.dequantize(wq, scales, biases, bits).T
    args = [mx.array(np.array(a)) for a in (wq, scales.astype(np.float32), biases.astype(np.float32))]
    got = mx.quantized_matmul(mx.array(x), *args, transpose=True, group_size=64, bits=bits)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)
    stacked = [mx.stack([a, a]) for a in args]  # two "experts", pick the second
    got = mx.gather_qmm(mx.array(x), *stacked, rhs_indices=mx.array([1]), transpose=True,
                        group_size=64, bits=bits)
    np.testing.assert_allclose(np.array(got).reshape(want.shape), want, rtol=1e-4, atol=1e-4)
