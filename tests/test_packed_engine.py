"""The packed engine (engines/packed_engine.py): experts computed from their packed bytes in the slots of the
cache's slot arena, against the numpy reference engine, and exact paths against all-resident.

Tolerance: logits within ATOL = 2e-5 absolute of the numpy engine's (the tiny models' logits are below ~4;
observed differences ~1e-6). The kernels sum scale * (codes . x) + bias * sum(x) per group of 64 in float32
where the reference dequantizes and multiplies in BLAS, so the two agree to float32 rounding, not bit for bit.
Against itself the packed engine is exact: every budget, layout, cache and execution path gives the logits
of every expert resident, bit for bit.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from conftest import FAMILIES
from engines import packed_kernels as K
from workbench.arena import slot_bytes
from workbench.errors import WorkbenchError
from workbench.io import ALIGN, ChecksumError, Reader, aligned_empty
from runtime.session import open_session
from workbench.store import quant

TOKENS = [3, 17, 42, 99, 7, 200, 31, 5, 128, 64, 250, 1, 77, 13]
SPLIT = 9          # prefill TOKENS[:SPLIT], then decode one token at a time
ATOL = 2e-5


def run(path, preset, engine="packed", **kw):
    """Prefill then decode TOKENS; logits (len(TOKENS), vocab) and the closed session. Experts affine q4 unless
    kw names them: these tests hold the affine kernels to the reference (ggml's blocks, the packed engine's default
    elsewhere, are held to theirs in tests/test_llamacpp.py)."""
    kw.setdefault("experts", "q4")
    with open_session(str(path), preset, engine=engine, **kw) as s:
        s.engine.reset()
        rows = [s.step(TOKENS[:SPLIT], "prefill")]
        rows += [s.step([t], "decode") for t in TOKENS[SPLIT:]]
        return np.concatenate(rows), s


@pytest.mark.parametrize("kind", ["q2", "q3", "q4", "q8", "bf16"])
def test_kernel_is_the_dequantized_matrix_times_x(kind):
    rng = np.random.default_rng(1)
    for shape in [(64, 64), (128, 256), (256, 128), (96, 192)]:
        w, x = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
        buf = quant.encode(w, kind)
        ref = quant.decode(buf, shape, kind).astype(np.float64) @ x
        np.testing.assert_allclose(K.matvec(buf, shape, kind, x), ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_resident_matrices_stay_encoded_and_project_as_their_dequantized_copies(tiny_models):
    """rest q4: attention, head and dense MLP matrices are held as the pack's bytes (Encoded), and a projection of
    one row, of a speculative batch and of a prompt (BLAS past KERNEL_ROWS) is x times the dequantized matrix."""
    from engines.packed_engine import KERNEL_ROWS, Encoded
    with open_session(str(tiny_models["qwen3_moe"]), "resident", engine="packed") as s:
        w = s.engine.w
        encoded = {n for n, v in w.items() if isinstance(v, Encoded)}
        assert "layers.0.q" in encoded and "layers.0.o" in encoded and not {"embed", "layers.0.router"} & encoded
        for name in ("layers.0.q", "layers.1.o", "lm_head" if "lm_head" in encoded else "layers.0.k"):
            f32 = s.pack.tensor(name)
            assert w[name].nbytes == s.pack.tensors[name]["nbytes"] < f32.nbytes
            np.testing.assert_array_equal(np.asarray(w[name]), f32)
            for rows in (1, KERNEL_ROWS, KERNEL_ROWS + 1):
                x = np.random.default_rng(rows).standard_normal((rows, f32.shape[1])).astype(np.float32)
                ref = x.astype(np.float64) @ f32.T.astype(np.float64)
                np.testing.assert_allclose(s.engine.linear(x, name), ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_numpy(tiny_models, family):
    """Resident and streaming at a quarter of the experts (waves at prefill)."""
    for preset, kw in [("resident", {}), ("on_demand", dict(budget="0.25"))]:
        ref, _ = run(tiny_models[family], preset, "numpy", **kw)
        out, _ = run(tiny_models[family], preset, **kw)
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0, err_msg=f"{family} {preset}")


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_attention_kernel_is_the_decoders(tiny_models, family):
    """A decoded token's attention in one kernel call (families with per-head or no qk-norm; OLMoE's full qk-norm
    and latent attention keep the decoder's numpy) gives the decoder's output and KV cache, to float32 rounding."""
    from engines.decoder import Decoder
    with open_session(str(tiny_models[family]), "resident", engine="packed") as s:
        e = s.engine
        assert e.fused_attention == (family in ("qwen3_moe", "qwen2_moe", "mixtral", "dots1"))
        e.reset()
        s.step(TOKENS[:SPLIT], "prefill")
        x = np.random.default_rng(0).standard_normal((1, e.spec.hidden_size)).astype(np.float32)
        for i in range(e.spec.num_layers):
            saved = [a.copy() for a in e.kv[i]]
            out, kv = e.attention(i, x), [a[:, :e.pos + 1].copy() for a in e.kv[i]]
            e.kv[i] = saved
            ref = Decoder.attention(e, i, x)
            np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
            for a, b in zip(kv, e.kv[i]):
                np.testing.assert_allclose(a, b[:, :e.pos + 1], atol=1e-5, rtol=0)


def test_delta_rule_kernel_is_the_decoders():
    """The linear-attention step in one kernel call gives the decoder's numpy state and outputs, to float32
    rounding, over a chain of tokens at the 80B's head shape (value heads 32, key and value dims 128) and with
    uneven dims, q and k L2-normalised as the layer's; the state it was given is left as it was (a checkpoint may
    hold it)."""
    from engines.hybrid import GatedDeltaNet
    from engines.packed_engine import PackedEngine
    rng = np.random.default_rng(0)
    for H, dk, dv in [(32, 128, 128), (3, 5, 7)]:
        S = ref = rng.standard_normal((H, dk, dv)).astype(np.float32)
        for _ in range(4):
            q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in rng.standard_normal((2, H, dk), np.float32))
            v = rng.standard_normal((H, dv)).astype(np.float32)
            beta, decay = rng.uniform(0, 1, (2, H)).astype(np.float32)
            given, kept = S, S.copy()
            S, o = PackedEngine.delta_rule(None, S, q, k, v, beta, decay)
            ref, o_ref = GatedDeltaNet.delta_rule(None, ref, q, k, v, beta, decay)
            np.testing.assert_array_equal(given, kept)
            np.testing.assert_allclose(S, ref, atol=1e-5, rtol=1e-4)
            np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("experts,rest,layout", [("q2", "q4", "contiguous"), ("q3", "q4", "native"),
                                                 ("q4", "q8", "native"), ("q8", "q4", "contiguous"),
                                                 ("bf16", "bf16", "contiguous")])
def test_every_expert_precision_matches_numpy(tiny_models, experts, rest, layout):
    kw = dict(budget="0.5", experts=experts, rest=rest, layout=layout)
    ref, _ = run(tiny_models["qwen3_moe"], "on_demand", "numpy", **kw)
    out, _ = run(tiny_models["qwen3_moe"], "on_demand", **kw)
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0, err_msg=str(kw))


STORAGE = [("contiguous", "q4"), ("native", "q4"), ("contiguous", "q3"), ("contiguous", "q2"), ("native", "bf16")]
PATHS = [dict(budget="0.25"), dict(budget="0.5", execution="ready_first"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:1:2k"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:2:k", cache_scope="per_layer"),
         dict(budget="0.25", execution="ready_first", predictor="history", cache_policy="lfu")]


@pytest.mark.parametrize("layout,experts", STORAGE)
def test_every_exact_path_equals_resident(tiny_models, layout, experts):
    model = tiny_models["qwen3_moe"]
    ref, _ = run(model, "resident", layout=layout, experts=experts)
    for path in PATHS:
        out, s = run(model, "on_demand", layout=layout, experts=experts, **path)
        np.testing.assert_array_equal(out, ref, err_msg=str(path))
        assert s.summary()["misses"] > 0, "the path streamed nothing: the comparison would be empty"


def test_demo_greedy_output_is_all_residents():
    """The demo model: greedy tokens of every exact streaming design equal all-resident's, at each budget."""
    ref = {}
    for experts in ("q4", "q3"):
        with open_session("demo", "resident", engine="packed", experts=experts) as s:
            ref[experts] = s.generate("Once upon a time", tokens=12)["tokens"]
    for preset, experts in [("on_demand", "q4"), ("les", "q3"), ("smol", "q4")]:
        for budget in ("0.125", "0.25", "0.5"):
            with open_session("demo", preset, budget=budget, engine="packed", experts=experts) as s:
                assert s.generate("Once upon a time", tokens=12)["tokens"] == ref[experts], (preset, budget)
                assert s.summary()["misses"] > 0


def test_budget_counts_packed_bytes(tiny_models):
    """0.25 keeps a quarter of the experts at their packed size; the arena is the cache's memory; a byte budget
    holds more q3 experts than q4 experts. (Contiguous layout: one aligned span per expert; the native layout's
    three parts take an aligned region each.)"""
    with open_session(str(tiny_models["qwen3_moe"]), "on_demand", budget="0.25", engine="packed", layout="contiguous") as s:
        n = s.pack.num_expert_total
        assert s.slot_bytes == slot_bytes(s.pack) < s.pack.expert_nbytes + ALIGN
        assert sum(s.cache.capacity[L] for L in s.spec.moe_layers[:1]) == n // 4
        assert s.arena.nbytes == n // 4 * s.slot_bytes <= s.budget_bytes
        s.generate(TOKENS, tokens=4)
        assert s.summary()["cache_bytes"] <= s.arena.nbytes
    slots = {}                  # the demo's experts: 14 pages at q4, 11 at q3
    for experts in ("q4", "q3"):
        with open_session("demo", "on_demand", budget="24MiB", engine="packed", experts=experts, layout="contiguous") as s:
            slots[experts] = s.cache.capacity[s.spec.moe_layers[0]]
    assert slots["q3"] >= 1.25 * slots["q4"]


class ThroughPython(Reader):
    """A reader that changes how a read is made (as the emulated and faulty ones do) reads on Python threads."""
    def _preadv(self, views, pos):
        return super()._preadv(views, pos)


@pytest.mark.parametrize("kind", [Reader, ThroughPython], ids=["gil-free", "python"])
def test_reads_land_in_their_buffers_checked_and_demand_goes_first(tmp_path, kind):
    data = np.random.default_rng(0).integers(0, 256, 256 * ALIGN, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    with kind(path, workers=1) as r:
        bufs = [aligned_empty(ALIGN) for _ in range(3)]       # adjacent ranges: one preadv, scattered
        crc = zlib.crc32(data[ALIGN + 8:ALIGN + 100])     # a run of a's second buffer
        got = r.submit_into([("a", [(0, bufs[0]), (ALIGN, bufs[1])]), ("b", [(2 * ALIGN, bufs[2])])],
                            checks={"a": ([(1, 8, 100)], crc)})
        assert got["a"].result() == bufs[:2] and got["b"].result() == bufs[2:]
        np.testing.assert_array_equal(np.concatenate(bufs), data[:3 * ALIGN])
        assert r.merged >= 2 and r.stats()["bytes_read"] == 3 * ALIGN
        prefetch = r.submit_into([(i, [(2 * i * ALIGN, aligned_empty(ALIGN))]) for i in range(100)], priority=1)
        demand = r.submit_into([("d", [(ALIGN, aligned_empty(ALIGN))])], priority=0)
        r.wait([*prefetch.values(), demand["d"]], 10, every=True)
        landed = sorted(f.t_end for f in prefetch.values())
        assert demand["d"].t_end < landed[-1], "the demand read waited behind every prefetch"
        whole = ([(0, 0, ALIGN)], zlib.crc32(data[:ALIGN]))   # in two runs, crc order across the buffers
        split = ([(0, 0, 5), (0, 5, ALIGN)], whole[1])
        ok = r.submit_into([("w", [(0, aligned_empty(ALIGN))]), ("s", [(ALIGN * 9, aligned_empty(ALIGN))])],
                           checks={"w": whole, "s": (split[0], zlib.crc32(data[9 * ALIGN:10 * ALIGN]))})
        assert ok["w"].result() and ok["s"].result()
        bad = r.submit_into([("x", [(0, aligned_empty(ALIGN))])], checks={"x": ([(0, 0, ALIGN)], whole[1] ^ 1)})
        with pytest.raises(ChecksumError, match="crc32 of 'x'"):
            bad["x"].result()
        past = r.submit_into([("e", [(256 * ALIGN, aligned_empty(ALIGN))])])
        with pytest.raises(EOFError, match="read past end of file"):
            past["e"].result()


def test_a_corrupt_expert_is_an_error_not_garbage(tiny_models, tmp_path):
    import shutil
    with open_session(str(tiny_models["olmoe"]), "resident", engine="packed") as s:
        src, (off, _) = s.pack_path, s.pack.expert_reads(s.spec.moe_layers[0], 3)[0]
    bad = tmp_path / "bad.pack"
    shutil.copy(src, bad)
    with open(bad, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(WorkbenchError, match="checksum mismatch in expert 3"):
        open_session(str(bad), "resident", engine="packed")


def test_refuses_experts_it_cannot_compute(tiny_models):
    from engines.packed_engine import PackedEngine
    with open_session(str(tiny_models["mixtral"]), "resident", budget="0.5", engine="packed") as s:
        for kind, why in [("f32", "f32"), ("gguf:Q4_K", "does not split into its blocks")]:   # rows of 64, not 256
            s.pack.expert_kinds = {p: kind for p in ("gate", "up", "down")}
            with pytest.raises(WorkbenchError, match="--engine packed computes experts stored as") as e:
                PackedEngine(s.pack, s.streamer, s.tel)
            assert str(s.pack.path) in str(e.value) and why in str(e.value)


@pytest.mark.parametrize("preset", ["on_demand", "les"])
def test_measured_speed_never_beats_the_floor(tiny_models, preset):
    """floor_tok_s = 1 / max(compute + router per token, bytes read per token / the disk's best bandwidth at the
    read size): a run faster than that by more than noise (20%) mis-counts its time or its bytes."""
    from experiments.bench import bench
    r = bench(str(tiny_models["qwen3_moe"]), preset, budget="0.25", tokens=16, engine="packed", record=False)
    assert r["bytes_read_per_token"] > 0 and r["floor_read_s_per_token"] > 0
    assert r["tok_s"] <= 1.2 * r["floor_tok_s"], r


def test_a_full_size_router_is_kept_in_q8_and_routes_and_predicts_as_the_f32_one(monkeypatch):
    """Above ROUTER_Q8_BYTES the router (and the lookahead that applies it) runs in ggml's Q8_0 kernel: here forced
    on the demo, whose decode then routes the same experts, and whose lookahead names the same, on nearly every
    layer of every token (ggml rounds x to 8 bits; the experts the two name are counted)."""
    pytest.importorskip("llama_cpp")
    import engines.packed_engine as P
    from runtime.session import open_session
    got = {}
    for q8 in (False, True):
        if q8:
            monkeypatch.setattr(P, "ROUTER_Q8_BYTES", 0)
        with open_session("demo", "les", budget="all", tokens=12) as s:
            router = s.engine.w["layers.3.router"]
            assert isinstance(router, P.Encoded) == q8
            s.generate("Once upon a time", tokens=12)
            ev = [e for e in s.tel.events if e.phase == "decode"]
            got[q8] = ([e.routed for e in ev], [e.predicted for e in ev])
    (routed, predicted), (routed8, predicted8) = got[False], got[True]
    same = lambda a, b: sum(len(set(x) & set(y)) for x, y in zip(a, b)) / sum(len(x) for x in a)
    assert same(routed, routed8) >= 0.95 and same(predicted, predicted8) >= 0.95
    assert any(predicted8)


def test_the_lookahead_beside_the_layers_router_names_what_it_names_apart(monkeypatch):
    """With routers in Q8_0 (forced on the demo), the packed engine computes a layer's router and the lookahead's
    in one call (PackedEngine.routers): every decoded token routes and predicts exactly what the two computed apart
    (the decoder's routers) do."""
    pytest.importorskip("llama_cpp")
    import engines.packed_engine as P
    from engines.decoder import Decoder
    from runtime.session import open_session
    monkeypatch.setattr(P, "ROUTER_Q8_BYTES", 0)
    calls, routers = [], P.G.routers
    monkeypatch.setattr(P.G, "routers", lambda *a: calls.append(1) or routers(*a))
    got = []
    for apart in (False, True):
        if apart:
            monkeypatch.setattr(P.PackedEngine, "routers", Decoder.routers)
        with open_session("demo", "les", budget="0.25", tokens=12) as s:
            out = s.generate("Once upon a time", tokens=12)
            ev = [e for e in s.tel.events if e.phase == "decode"]
            got.append((out["tokens"], [e.routed for e in ev], [e.predicted for e in ev]))
    assert got[0] == got[1] and any(got[0][2])
    assert len(calls) == 11 * 7     # 11 decoded tokens x the 7 MoE layers with a later one: the side-by-side path
