"""The lossy levers (workbench.designs.lossy): routers any design takes, each the exact router at its neutral value,
bit for bit, and each reading fewer experts when set."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from test_bad_input import assert_one_line_error, cli
from runtime.session import open_session
from workbench.designs import Router, Setup
from workbench.designs.lossy import DropMisses, LowByHotness, LowOnMiss, TopK

PROMPT, FORCED = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]


def logits_of(preset: str, budget: str, **knobs) -> np.ndarray:
    """Prefill PROMPT, then decode FORCED one token at a time: every step's logits."""
    with open_session("demo", preset, budget, prompt=None, **knobs) as s:
        out = [s.step(PROMPT, "prefill")]
        out += [s.step([t], "decode") for t in FORCED]
    return np.concatenate(out)


@pytest.mark.parametrize("knobs", [{"routing": "top_k"}, {"routing": "top_k", "k": "4"},
                                   {"routing": "top_k", "k": ",".join(["4"] * 8)},
                                   {"routing": "top_k", "mass": "1.0"}, {"routing": "drop_misses", "keep": "4"},
                                   {"routing": "low_on_miss", "keep": "4"}, {"routing": "low_by_hotness", "hottest": "1"}],
                         ids=["top_k", "k=4", "k=4 per layer", "mass=1", "drop keep=4", "low keep=4", "hottest=1"])
def test_each_lever_at_its_neutral_value_is_the_exact_router_bit_for_bit(knobs):
    exact = logits_of("on_demand", "0.1")
    assert np.array_equal(logits_of("on_demand", "0.1", **knobs), exact)


def router(cls, held=(), top_k=4, usage=None, **params):
    """A lever on a 2-layer spec whose exact router gives experts 3, 1, 0, 2 with weights .4, .3, .2, .1."""
    spec = SimpleNamespace(top_k=top_k, moe_layers=[0, 1], num_experts=8)
    exact = lambda layer, logits, bias=None: (np.array([[3, 1, 0, 2]]), np.array([[.4, .3, .2, .1]], np.float32))
    return cls(Setup(spec, exact=exact, usage=usage), {(1, e) for e in held}, **params)


def test_top_k_keeps_the_best_and_the_rows_weight():
    idx, w = router(TopK, k=2).route(1, np.zeros((1, 8)), {})
    assert idx.tolist() == [[3, 1]] and np.allclose(w, [[.4 / .7, .3 / .7]])
    idx, w = router(TopK, mass=0.85).route(1, np.zeros((1, 8)), {})     # .4 + .3 + .2 reach .9 of 1.0
    assert idx.tolist() == [[3, 1, 0]] and np.isclose(w.sum(), 1.0)


def test_top_k_may_name_a_k_per_layer():
    r = router(TopK, k="2,3")
    assert r.route(0, np.zeros((1, 8)), {})[0].tolist() == [[3, 1]]
    assert r.route(1, np.zeros((1, 8)), {})[0].tolist() == [[3, 1, 0]]


def test_drop_misses_skips_what_is_not_in_memory_beyond_the_first_keep():
    r = router(DropMisses, held=[0])
    idx, w = r.route(1, np.zeros((1, 8)), {"phase": "decode"})
    assert idx.tolist() == [[3, 0]] and np.allclose(w, [[.4 / .6, .2 / .6]])     # 3 kept as the first; 1, 2 missed
    assert router(DropMisses, held=[0], keep=2).route(1, np.zeros((1, 8)), {"phase": "decode"})[0].tolist() == \
        [[3, 1, 0]]
    for ctx, layer, params in (({"phase": "prefill"}, 1, {}), ({"phase": "decode"}, 0, {"from_layer": 1})):
        assert router(DropMisses, **params).route(layer, np.zeros((1, 8)), ctx)[0].tolist() == [[3, 1, 0, 2]]


def test_dropping_misses_reads_fewer_experts_than_its_design():
    from experiments.bench import bench
    base = bench("demo", "les", "0.1", tokens=16, record=False)
    drop = bench("demo", "les", "0.1", tokens=16, record=False, routing="drop_misses")
    assert drop["experts_read_per_token"] < 0.5 * base["experts_read_per_token"]
    routed = lambda r: sum(x["routed"] for x in r["per_layer"])
    assert routed(drop) < routed(base)
    assert base["dropped_fraction"] == 0 and all(x["dropped_fraction"] == 0 for x in base["per_layer"])
    per_layer = [x["dropped_fraction"] for x in drop["per_layer"]]
    assert 0 < drop["dropped_fraction"] <= 0.75 and max(per_layer) <= 0.75     # keep=1 of top-4: at most 3 of 4
    assert min(per_layer) < max(per_layer) or len(per_layer) == 1


def test_a_top_k_per_layer_leaves_out_what_it_says_layer_by_layer():
    from experiments.bench import bench
    ks = "4,2,4,2,4,2,4,2"          # the demo's 8 MoE layers
    r = bench("demo", "les", "0.25", tokens=6, record=False, routing="top_k", k=ks)
    assert [x["dropped_fraction"] for x in r["per_layer"]] == [0.0 if k == "4" else 0.5 for k in ks.split(",")]


@pytest.mark.parametrize("args,says", [
    (["--set", "routing=top_k", "--set", "k=9"], "k=9 is outside 0..4"),
    (["--set", "routing=top_k", "--set", "k=2,3"], "k=2,3 names 2 values; give one, or one per MoE layer"),
    (["--set", "routing=top_k", "--set", "k=two"], "k=two is not a number"),
    (["--set", "routing=top_k", "--set", "mass=1.5"], "mass=1.5 is outside (0, 1]"),
    (["--set", "routing=drop_misses", "--set", "keep=0"], "keep=0 is outside 1..4"),
    (["--set", "routing=drop_misses", "--set", "from_layer=9"], "from_layer=9 is outside"),
])
def test_a_lever_out_of_range_is_one_line(args, says, tmp_path):
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "2", "--no-record", *args)
    assert_one_line_error(res, says)


def test_a_trace_refuses_a_lever_in_one_line():
    res = cli("replay", "data/traces/demo-tinystories-256.parquet", "--preset", "les", "--set",
              "routing=drop_misses")
    assert_one_line_error(res, "routing")


def test_a_run_with_a_lever_says_it_changes_the_output():
    from experiments.bench import bench
    assert bench("demo", "les", "0.25", tokens=2, record=False, routing="top_k", k="2")["changes_output"] is True
    assert bench("demo", "les", "0.25", tokens=2, record=False)["changes_output"] is False


def test_low_on_miss_marks_the_misses_for_the_low_tier_and_keeps_the_routing():
    idx, w, low = router(LowOnMiss, held=[0]).route(1, np.zeros((1, 8)), {"phase": "decode"})
    assert idx.tolist() == [[3, 1, 0, 2]] and np.allclose(w, [[.4, .3, .2, .1]])
    assert low.tolist() == [[False, True, False, True]]        # 3 the first (kept), 0 held; 1 and 2 missed
    assert len(router(LowOnMiss, held=[1, 0, 2]).route(1, np.zeros((1, 8)), {"phase": "decode"})) == 2


def test_low_by_hotness_computes_the_least_used_experts_from_the_low_tier():
    usage = {L: np.array([0, 9, 1, 8, 7, 6, 5, 4]) for L in (0, 1)}       # hottest: 1, 3, 4, 5
    r = router(LowByHotness, usage=usage, hottest=0.5)
    assert sorted(e for L, e in r.low_experts() if L == 1) == [0, 2, 6, 7]
    idx, w, low = r.route(1, np.zeros((1, 8)), {"phase": "prefill"})
    assert low.tolist() == [[False, False, True, True]]          # 3 and 1 hot, 0 and 2 cold
    assert router(LowByHotness, usage=usage, hottest=1.0).low_experts() == []


@pytest.mark.parametrize("engine,experts", [("packed", "g2"), ("numpy", "q2")])
def test_every_expert_from_the_low_tier_is_the_run_on_the_low_pack_bit_for_bit(engine, experts):
    """hottest=0: every routed expert computed from its resident copy, none read; the same logits as the pack at that
    precision run whole, so each low-tier expert is computed from exactly its low-precision bytes."""
    low = logits_of("on_demand", "0.1", engine=engine, routing="low_by_hotness", hottest="0")
    assert np.array_equal(low, logits_of("on_demand", "0.1", engine=engine, experts=experts))
    assert not np.array_equal(low, logits_of("on_demand", "0.1", engine=engine))
    with open_session("demo", "on_demand", "0.1", prompt=None, engine=engine, routing="low_by_hotness", hottest="0") as s:
        s.step(PROMPT, "prefill")
        s.step([6], "decode")
        assert s.reader.bytes_read == 0 and s.summary()["low_fraction"] == 1.0
        assert s.summary()["low_tier_bytes"] == s.low_tier.nbytes > 0


def test_low_on_miss_reads_fewer_experts_than_its_design_and_computes_as_many():
    from experiments.bench import bench
    base = bench("demo", "les", "0.1", tokens=16, record=False)
    low = bench("demo", "les", "0.1", tokens=16, record=False, routing="low_on_miss")
    assert low["experts_read_per_token"] < 0.5 * base["experts_read_per_token"]
    assert low["dropped_fraction"] == 0 and 0 < low["low_fraction"] <= 0.75
    assert low["low_tier_bytes"] > 0 and base["low_tier_bytes"] == 0 and low["changes_output"] is True
    computed = lambda r: sum(x["routed"] + x["low"] for x in r["per_layer"]) / r["decode_steps"]
    assert computed(low) == pytest.approx(computed(base), rel=0.25)     # every choice computed, by one copy or the other


@pytest.mark.parametrize("args,says", [
    (["--set", "routing=low_on_miss", "--set", "low=q5"], "low=q5 is not a low tier's precision; choose q2 or q3"),
    (["--set", "routing=low_by_hotness", "--set", "hottest=1.5"], "hottest=1.5 is outside [0, 1]"),
    (["--set", "routing=low_on_miss", "--engine", "mlx"], "computes no low tier"),
])
def test_a_low_tier_out_of_range_is_one_line(args, says):
    if "mlx" in args:
        pytest.importorskip("mlx.core")
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "2", "--no-record", *args)
    assert_one_line_error(res, says)


def test_a_low_tier_of_a_pack_given_as_the_model_is_refused_in_one_line():
    from runtime.plan import plan
    pack = plan("demo", "les", "0.25").pack.path          # a pack holds one precision: no checkpoint to convert
    res = cli("bench", "--model", str(pack), "--preset", "les", "--tokens", "2", "--no-record", "--set",
              "routing=low_on_miss")
    assert_one_line_error(res, "needs the checkpoint it was converted from")


def test_no_room_for_the_low_copy_is_one_line_and_writes_nothing(monkeypatch, tmp_path):
    import shutil
    from workbench import low_tier
    from workbench.errors import WorkbenchError
    from workbench.presets import get_preset
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(low_tier.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(WorkbenchError, match=r"no room for its q2 copy .* GiB free"):
        low_tier.low_pack("demo", get_preset("les").storage, "q2", "packed")
    assert not list((tmp_path / "cache").rglob("*.pack"))


def test_a_capture_of_the_routing_passes_the_low_tiers_marks_on():
    """The teacher comparison and the oracle's trace wrap the router hook: what they record is the routing, and the
    low tier still computes what the router marked."""
    from runtime.capture import RoutingCapture
    with open_session("demo", "on_demand", "0.1", prompt=None, routing="low_by_hotness", hottest="0") as s:
        cap = RoutingCapture(s)
        s.step(PROMPT, "prefill")
        s.step([6], "decode")
        assert s.reader.bytes_read == 0 and s.summary()["low_fraction"] == 1.0
        assert all(a.shape == (len(PROMPT) + 1, s.spec.top_k) for a in cap.take().values())


def test_a_low_tier_the_memory_cannot_hold_is_one_line(monkeypatch):
    from workbench import low_tier
    from workbench.errors import WorkbenchError
    monkeypatch.setattr(low_tier, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(WorkbenchError, match=r"its low tier needs \d+ MiB of memory, 1 MiB available"):
        open_session("demo", "les", "0.1", prompt=None, routing="low_on_miss")


class MarksFirstRow(Router):
    """Marks the first row's best expert only (a design's own router: the test below)."""
    low = "q2"

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        mark = np.zeros(idx.shape, bool)
        mark[0, 0] = True
        return idx, w, mark


class MarksEveryRow(MarksFirstRow):
    def route(self, layer, logits, ctx):
        idx, w, _ = super().route(layer, logits, ctx)
        return idx, w, idx == idx[0, 0]


def test_an_expert_marked_on_one_row_is_computed_from_the_low_tier_on_every_row():
    one = logits_of("on_demand", "0.25", routing=f"{__file__}:MarksFirstRow")
    assert np.array_equal(one, logits_of("on_demand", "0.25", routing=f"{__file__}:MarksEveryRow"))
    assert not np.array_equal(one, logits_of("on_demand", "0.25"))


class MarksBadly(MarksFirstRow):
    def route(self, layer, logits, ctx):
        idx, w, _ = super().route(layer, logits, ctx)
        return idx, w, np.zeros(idx.shape[1])


class MarksWithoutATier(MarksFirstRow):
    low = None


@pytest.mark.parametrize("name,says", [("MarksBadly", "for its low tier, not bool as its experts"),
                                       ("MarksWithoutATier", r"not \(experts, weights\)$")])
def test_a_routers_marks_that_do_not_fit_are_one_line(name, says):
    from workbench.errors import WorkbenchError
    with pytest.raises(WorkbenchError, match=says):
        logits_of("on_demand", "0.25", routing=f"{__file__}:{name}")
