"""Routing traces with the predictors' names: they round-trip, and a run driven by one routes exactly as recorded."""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from experiments.routing_trace import PREDICTORS, TraceDrive, expert_map, named_predictions
from experiments.traces import read_trace, write_trace
from workbench.errors import WorkbenchError
from workbench.spec import MoESpec

REPO = Path(__file__).resolve().parents[1]
DEMO_TRACE = REPO / "data" / "traces" / "demo-tinystories-256.parquet"


@pytest.fixture(scope="module")
def demo_trace():
    return read_trace(DEMO_TRACE)


def test_the_shipped_demo_trace_records_every_predictor_and_its_provenance(demo_trace):
    assert set(demo_trace["predictions"]) == set(PREDICTORS) | {"prerouter"}      # the demo's Edge0 heads are trained
    assert demo_trace["drafts"].shape == (len(demo_trace["ids"]), 4)
    assert demo_trace["meta"]["engine"] == "numpy" and demo_trace["meta"]["model"] == "demo"
    assert (REPO / "data" / "traces" / "PROVENANCE.md").read_text().count("demo-tinystories-256.parquet")
    np.testing.assert_array_equal(demo_trace["predictions"]["oracle"], demo_trace["topk"])
    np.testing.assert_array_equal(demo_trace["predictions"]["history"][1:], demo_trace["topk"][:-1])
    assert (demo_trace["predictions"]["lookahead:2:k"][:, :2] == -1).all()    # nothing names layers 0 and 1 two ahead


def test_lookahead_names_the_next_router_on_this_layers_input(demo_trace):
    """Independent of workbench.predict: RMS-norm with layer j+1's norm, its router, top-k by sorting."""
    from workbench.registry import resolve_pack
    from workbench.store.pack import Pack
    pack = Pack(resolve_pack("demo", "contiguous", "q4", "q4"))     # norms and routers are f32 in every pack
    spec = MoESpec.from_dict(demo_trace["meta"]["spec"])
    h = demo_trace["router_input"][:, 2].astype(np.float64)
    x = h / np.sqrt((h * h).mean(-1, keepdims=True) + spec.rms_norm_eps) * pack.tensor("layers.3.mlp_norm")
    scores = x @ pack.tensor("layers.3.router").T.astype(np.float64)
    want = np.argsort(-scores, axis=-1, kind="stable")[:, :spec.top_k]
    got = demo_trace["predictions"]["lookahead:1:k"][:, 3]
    assert (np.sort(got, -1) == np.sort(want, -1)).mean() > 0.99             # float32 vs float64 near-ties only


def test_the_predictions_computed_again_equal_the_shipped_trace(demo_trace):
    """named_predictions (what `trace` records) from the trace's router inputs and the demo's routers."""
    from experiments.traces import _weights_for
    spec = MoESpec.from_dict(demo_trace["meta"]["spec"])
    got = named_predictions(demo_trace, spec, _weights_for(demo_trace["meta"], "demo", spec))
    assert set(got) == set(PREDICTORS)
    for name in PREDICTORS:
        np.testing.assert_array_equal(got[name], demo_trace["predictions"][name], err_msg=name)


def test_trace_files_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    T, NL, k, E, d = 5, 3, 2, 6, 4
    tr = {"topk": rng.integers(0, E, (T, NL, k)), "logits": rng.standard_normal((T, NL, E)),
          "router_input": rng.standard_normal((T, NL, d)), "moe_layers": [0, 1, 2]}
    preds = {"oracle": tr["topk"].astype(np.int32), "lookahead:1:2k": rng.integers(-1, E, (T, NL, 2 * k)).astype(np.int32)}
    drafts = rng.integers(-1, 20, (T, 4)).astype(np.int32)
    write_trace(tmp_path / "t.parquet", tr, list(range(10, 15)), {"engine": "test", "model": "m"}, predictions=preds,
                drafts=drafts)
    back = read_trace(tmp_path / "t.parquet")
    np.testing.assert_array_equal(back["drafts"], drafts)
    np.testing.assert_array_equal(back["topk"], tr["topk"])
    np.testing.assert_array_equal(back["logits"], tr["logits"].astype(np.float32))
    np.testing.assert_array_equal(back["router_input"], tr["router_input"].astype(np.float32))
    assert back["ids"] == list(range(10, 15)) and back["meta"]["model"] == "m"
    for name, a in preds.items():
        np.testing.assert_array_equal(back["predictions"][name], a)


def _spec(demo_trace, **kw):
    return dataclasses.replace(MoESpec.from_dict(demo_trace["meta"]["spec"]), **kw)


def test_a_trace_from_another_shape_is_mapped_by_the_stated_rule_or_refused(demo_trace):
    r, rule = expert_map("t", {"num_experts": 32, "top_k": 4}, _spec(demo_trace, num_experts=64, top_k=8))
    assert r == 2 and "2e..2e+1" in rule
    with pytest.raises(WorkbenchError, match=r"t: a trace of 32 experts top-4 .* 128 experts top-8 \(make-model --experts 64 fits\)"):
        expert_map("t", {"num_experts": 32, "top_k": 4}, _spec(demo_trace, num_experts=128, top_k=8))
    with pytest.raises(WorkbenchError, match="top-10"):
        expert_map("t", {"num_experts": 32, "top_k": 4}, _spec(demo_trace, num_experts=80, top_k=10))
    wide = TraceDrive(DEMO_TRACE, _spec(demo_trace, num_experts=64, top_k=8, num_layers=3), "lookahead:1:k")
    assert wide.row_layer == {0: 0, 1: 1, 2: 2}
    np.testing.assert_array_equal(wide.experts(np.array([[3, -1, 0]])), [[6, 7, -1, -1, 0, 1]])


def test_a_run_driven_by_a_trace_routes_and_prefetches_exactly_as_recorded(demo_trace):
    from runtime.session import open_session
    with open_session("demo", "les", budget="0.25", drive=partial(TraceDrive, str(DEMO_TRACE))) as s:
        prompt = [5, 6, 7]
        s.generate(prompt, tokens=6)
        cfg = s.config()
        decode = [ev for ev in s.tel.events if ev.phase == "decode"]
    assert cfg["routing_trace"]["mapping"].startswith("layers: model MoE layer i replays trace MoE layer i mod 8")
    assert len(decode) == 5 * 8
    topk, la = demo_trace["topk"], demo_trace["predictions"]["lookahead:1:k"]
    for ev in decode:
        row = len(prompt) - 1 + ev.token
        assert ev.routed == sorted(set(topk[row, ev.layer].tolist()))
        if ev.layer > 0:
            assert ev.predicted == [int(e) for e in la[row, ev.layer]]


def test_a_predictor_the_trace_did_not_record_is_refused(demo_trace):
    """A trace with router inputs records its lookaheads: one it did not record is not modelled in its place."""
    with pytest.raises(WorkbenchError, match="predictor 'lookahead:3:k' is not recorded"):
        TraceDrive(DEMO_TRACE, _spec(demo_trace), "lookahead:3:k")
    d = TraceDrive(DEMO_TRACE, _spec(demo_trace), "shuffled")       # the control: drawn by each layer's usage
    counts = np.bincount(d.preds["shuffled"][:, 2].reshape(-1), minlength=32)
    usage = np.bincount(demo_trace["topk"][:, 2].reshape(-1), minlength=32)
    assert np.corrcoef(counts, usage)[0, 1] > 0.8 and "prediction" in d.source


def test_a_warm_start_on_a_trace_counts_only_rows_the_run_does_not_replay(demo_trace):
    """The pager's most-used lists come from the half of the trace that starts half its rows after the run's first:
    a run of fewer than half the trace's tokens does not warm from the routing it is measured on."""
    T = demo_trace["topk"].shape[0]
    for skip in (0, T // 2 + 3):
        d = TraceDrive(DEMO_TRACE, _spec(demo_trace), None, skip=skip)
        held = (skip + np.arange(T // 2, T)) % T
        assert not set(held) & set((skip + np.arange(T // 2)) % T)
        for L, j in d.row_layer.items():
            assert d.usage[L] == np.bincount(demo_trace["topk"][held, j].reshape(-1), minlength=32).tolist()
        assert f"rows {held[0]}-{held[-1]}" in d.source["warm_usage"]


def test_bench_with_a_missing_or_unmappable_trace_is_a_one_line_error(tmp_path, capsys):
    from cli import main
    assert main(["bench", "--routing-trace", str(tmp_path / "none.parquet"), "--no-record", "--tokens", "2"]) == 2
    assert "no such trace file" in capsys.readouterr().err
    assert main(["bench", "--preset", "smol_bias", "--routing-trace", str(DEMO_TRACE), "--no-record", "--tokens", "2"]) == 2
    assert "changes routing" in capsys.readouterr().err


@pytest.fixture(scope="module")
def edge0_trace(tmp_path_factory):
    """A short trace of the demo, whose Edge0 heads are trained (data/models/demo-moe/edge0), written by `trace`."""
    from cli import main
    out = tmp_path_factory.mktemp("t") / "t.parquet"
    assert main(["trace", "--engine", "numpy", "--model", "demo", "--data", "tinystories", "--tokens", "48",
                 "--out", str(out)]) in (0, None)
    return read_trace(out)


def test_the_prerouter_is_recorded_as_edge0s_heads_name_it_one_token_ahead(edge0_trace):
    """The recorded column equals what the engine's own Prerouter (workbench.edge0.serve) names when it is fed the
    recorded inputs token by token, layer by layer."""
    from experiments.traces import _weights_for
    from workbench.edge0.serve import Heads, Prerouter
    from workbench.predict import _rms
    from workbench.store.pack import Pack
    tr = edge0_trace
    spec = MoESpec.from_dict(tr["meta"]["spec"])
    w = _weights_for(tr["meta"], None, spec)
    pre = Prerouter(spec, w, Heads.load(spec, Pack(tr["meta"]["pack"])), skip_layers=1)
    layers, got = tr["moe_layers"], np.full_like(tr["predictions"]["prerouter"], -1)

    class Engine:
        pos = 1
    eng = Engine()
    for t in range(len(tr["ids"]) - 1):
        eng.token_index = t
        for j, L in enumerate(layers[:-1]):
            x = _rms(tr["router_input"][t, j][None].astype(np.float32), w[f"layers.{L}.mlp_norm"], spec.rms_norm_eps)
            for (target, t1), idx in pre.predict(L, {"engine": eng, "routed": tr["topk"][t, j][None], "x": x,
                                                      "phase": "decode"}).items():
                got[t1, layers.index(target)] = idx
    np.testing.assert_array_equal(got, tr["predictions"]["prerouter"])
    assert (got[1:, 1:] >= 0).all() and tr["meta"]["prerouter"].endswith("prerouter.safetensors")


def test_the_recorded_drafts_are_prompt_lookups_and_a_drive_accepts_what_the_text_continues(edge0_trace):
    from runtime.speculative import PromptLookup
    tr, spec = edge0_trace, MoESpec.from_dict(edge0_trace["meta"]["spec"])
    ids = tr["ids"]
    for t in range(len(ids)):
        d = PromptLookup().propose(ids[:t + 1], 4)
        assert tr["drafts"][t].tolist() == d + [-1] * (4 - len(d))
    drive = TraceDrive("t", spec, None, trace=tr)
    drive.prompt_len = 1                         # decode step n's input token is trace row n
    for n in range(1, len(ids) - 5):
        draft, accepted = drive.draft(n, 4)
        assert draft[:accepted] == ids[n + 1:n + 1 + accepted]
        assert accepted == len(draft) or draft[accepted] != ids[n + 1 + accepted]


def test_simulate_replays_the_prerouter_and_the_speculative_rung(edge0_trace, tmp_path):
    from experiments.traces import write_trace
    from experiments.compute_profile import ComputeProfile
    from experiments.simulate import run
    tr = edge0_trace
    path = tmp_path / "t.parquet"
    write_trace(path, {k: tr[k] for k in ("topk", "logits", "router_input", "moe_layers")}, tr["ids"], tr["meta"],
                predictions=tr["predictions"], drafts=tr["drafts"])
    cp = ComputeProfile(dense_s=1e-4, router_s=1e-5, expert_s=1e-4, dequant_s=1e-5)
    pre = run(str(path), "oracle", "0.25", "ufs22-phone", tokens=24, compute=cp, record=False, predictor="prerouter")
    assert pre["prefetch_issued"] > 0 and pre["simulated"]
    plain = run(str(path), "les", "0.25", "ufs22-phone", tokens=40, compute=cp, record=False)
    spec4 = run(str(path), get_les_speculative(), "0.25", "ufs22-phone", tokens=40, compute=cp, record=False)
    assert plain["spec_steps"] == 39 and spec4["spec_accepted"] > 0       # 39 decode tokens: fewer steps
    assert spec4["spec_steps"] + spec4["spec_accepted"] in (39, 40)       # 40: the last step's extra token dropped


def get_les_speculative():
    from workbench.presets import get_preset
    return get_preset("les").with_(name="les+speculative", speculative=4)
