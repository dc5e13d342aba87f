"""import-trace: a real model's routing, recorded elsewhere, in the workbench's trace format; every design runs on it,
predicting with a stated, modelled recall where the trace holds no router inputs."""
from __future__ import annotations

import json
from collections import OrderedDict
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from cli import main
from experiments.routing_trace import TraceDrive
from experiments.traces import read_trace
from workbench.spec import MoESpec

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "data" / "traces" / "qwen3-30b-a3b-bigmoeonedge.parquet"
SHARED_CSV = REPO.parent / "shared" / "data" / "routing" / "bigmoeonedge-qwen3-30b-a3b" / "qwen.route.csv"
HEADER = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"


def route_csv(tokens, n_layer=3, n_expert=8, k=2) -> str:
    """A route_trace v1 file: tokens = [(phase, step, {layer: [(expert, weight), ...]})]."""
    lines = ["# route_trace v1", f"# model=/m/Test.gguf arch=qwen3moe n_layer={n_layer} n_expert={n_expert} "
                                 f"n_expert_used={k}"]
    lines += [f"# layer={L} expert_bytes=100 dense_bytes=10" for L in range(n_layer)] + [HEADER]
    for phase, step, layers in tokens:
        for L, slots in layers.items():
            lines += [f"0,{phase},{step},{L},{s},{e},{w},0,100" for s, (e, w) in enumerate(slots)]
    return "\n".join(lines) + "\n"


def small_tokens():
    """Two prompt tokens (the first without the last layer, as llama.cpp writes them) and three decode tokens."""
    rng = np.random.default_rng(0)
    full = lambda n: {L: [(int(e), round(float(w), 4)) for e, w in zip(rng.permutation(8)[:2], (0.6, 0.4))]
                      for L in range(n)}
    return [(0, 0, full(2)), (0, 1, full(3)), (1, 2, full(3)), (1, 3, full(3)), (1, 4, full(3))]


def test_a_route_trace_is_imported_element_wise(tmp_path):
    toks = small_tokens()
    (tmp_path / "r.csv").write_text(route_csv(toks))
    assert main(["import-trace", str(tmp_path / "r.csv"), "--shape", "qwen3-30b-a3b", "--out",
                 str(tmp_path / "t.parquet")]) in (0, None)
    tr = read_trace(tmp_path / "t.parquet")
    kept = toks[1:]                                                    # the prompt token lacking layer 2 is left out
    want = np.array([[[e for e, _ in t[2][L]] for L in range(3)] for t in kept])
    np.testing.assert_array_equal(tr["topk"], want)
    np.testing.assert_allclose(tr["weights"], [[[w for _, w in t[2][L]] for L in range(3)] for t in kept])
    assert tr["logits"] is None and tr["router_input"] is None and tr["ids"] == [-1] * 4
    spec = MoESpec.from_dict(tr["meta"]["spec"])
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size) == (3, 8, 2, 2048, 768)
    imp = tr["meta"]["imported"]
    assert imp["format"] == "route_trace v1" and imp["file"] == "r.csv" and imp["left_out"] == 1
    assert (imp["prompt_tokens"], imp["decode_tokens"]) == (1, 3) and "layer 2" in imp["left_out_why"]
    np.testing.assert_array_equal(tr["predictions"]["oracle"], want)
    np.testing.assert_array_equal(tr["predictions"]["history"][1:], want[:-1])


def test_the_plain_csv_and_json_lines_formats_give_the_same_trace(tmp_path):
    rng = np.random.default_rng(1)
    topk = np.stack([rng.permutation(128)[:6] for _ in range(5 * 4)]).reshape(5, 4, 6)
    w = rng.dirichlet(np.ones(6), (5, 4)).round(5)
    rows = [(t, L) for t in range(5) for L in range(4)]
    rng.shuffle(rows)                                                  # any order of rows
    (tmp_path / "p.csv").write_text("# a comment\ntoken,layer,experts,weights\n" + "".join(
        f"{t},{L},{' '.join(map(str, topk[t, L]))},{' '.join(map(str, w[t, L]))}\n" for t, L in rows))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"token": t, "layer": L, "experts": topk[t, L].tolist(),
                                                          "weights": w[t, L].tolist()}) + "\n" for t, L in rows))
    for name in ("p.csv", "p.jsonl"):
        assert main(["import-trace", str(tmp_path / name), "--shape", "qwen3-30b-a3b", "--out",
                     str(tmp_path / (name + ".parquet"))]) in (0, None)
        tr = read_trace(tmp_path / (name + ".parquet"))
        np.testing.assert_array_equal(tr["topk"], topk)
        np.testing.assert_allclose(tr["weights"], w, rtol=1e-6)
        assert MoESpec.from_dict(tr["meta"]["spec"]).num_experts == 128          # the shape's
    (tmp_path / "n.csv").write_text("token,layer,experts\n0,0,3 4\n0,1,5 6\n")
    assert main(["import-trace", str(tmp_path / "n.csv"), "--shape", "qwen3-30b-a3b", "--out",
                 str(tmp_path / "n.parquet")]) in (0, None)
    assert read_trace(tmp_path / "n.parquet")["weights"] is None           # none in the file: none recorded


ROUTE_BAD = [  # (what is done to the good file's lines, the row named, what the message says)
    (lambda ls: ls.__setitem__(0, "# route_trace v2"), 1, "is not '# route_trace v1'"),
    (lambda ls: ls.__setitem__(5, HEADER.replace("slot", "pos")), 6, "expected the header"),
    (lambda ls: ls.__setitem__(6, "0,0,0,0,0,x,0.5,0,100"), 7, "expert 'x' is not an integer"),
    (lambda ls: ls.__setitem__(6, "0,0,0,0,0,9,0.5,0,100"), 7, "expert 9 is outside 0..7"),
    (lambda ls: ls.__setitem__(6, "0,0,0,0,0,1,nan,0,100"), 7, "weight 'nan' is not finite"),
    (lambda ls: ls.__setitem__(6, "0,0,0,0,0,1"), 7, "6 fields, expected 9"),
    (lambda ls: ls.__setitem__(6, "0,2,0,0,0,1,0.5,0,100"), 7, "phase 2"),
    (lambda ls: ls.pop(-1), None, "has slots [0], expected 0..1"),                  # a decode token short of a slot
    (lambda ls: [ls.pop(-1), ls.pop(-1)], None, "lacks layer 2"),                   # a decode token short of a layer
]


@pytest.mark.parametrize("case", range(len(ROUTE_BAD)))
def test_a_malformed_file_is_one_line_naming_the_file_and_row_and_writes_nothing(tmp_path, capsys, case):
    change, row, says = ROUTE_BAD[case]
    lines = route_csv(small_tokens()).splitlines()
    change(lines)
    bad, out = tmp_path / "bad.csv", tmp_path / "t.parquet"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["import-trace", str(bad), "--shape", "qwen3-30b-a3b", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and says in err and "Traceback" not in err, err
    assert row is None or f"row {row}:" in err
    assert "row " in err and not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_a_malformed_plain_file_or_an_unknown_model_is_one_line(tmp_path, capsys):
    cases = [("token,layer,experts\n0,0,1 2\n0,1,1 2 3\n", "row 3: 3 experts, the rows before have 2"),
             ('{"token": 0, "layer": 0, "experts": [1, 2]}\n{"token": 0, "layer": 0, "experts": [1, 3]}\n',
              "row 2: token 0 layer 0 again (first at row 1)"),
             ('{"token": 0, "layer": 0, "experts": [1, 2]}\nnot json\n', "row 2: not JSON"),
             ("token,layer,experts\n0,0,1 200\n", "expert 200 is outside qwen3-30b-a3b's 0..127"),
             ("token,layer,experts\n0,0,1 2\n1,1,1 2\n", "token 0 lacks layer 1")]
    for text, says in cases:
        (tmp_path / "p.csv").write_text(text)
        assert main(["import-trace", str(tmp_path / "p.csv"), "--shape", "qwen3-30b-a3b", "--out",
                     str(tmp_path / "t.parquet")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and str(tmp_path / "p.csv") in err, (says, err)
        assert not (tmp_path / "t.parquet").exists()


def test_a_trace_of_a_model_with_no_built_in_shape_replays_for_every_design(tmp_path, capsys):
    """30 layers x 96 experts, top-5: no shape of workbench/shapes.py. It imports as its own layers, experts and
    top-k; replay runs every design on it and gives Belady's bound; bytes are not reported, simulate asks a shape."""
    from experiments.leaderboard import BUILTIN, FIELD, run
    from experiments.simulate import replay
    rng = np.random.default_rng(5)
    toks = [(1, t, {L: list(zip(rng.permutation(96)[:5].tolist(), [0.2] * 5)) for L in range(30)}) for t in range(24)]
    (tmp_path / "r.csv").write_text(route_csv(toks, n_layer=30, n_expert=96, k=5))
    assert main(["import-trace", str(tmp_path / "r.csv"), "--out", str(tmp_path / "t.parquet")]) in (0, None)
    meta = read_trace(tmp_path / "t.parquet")["meta"]
    assert (meta["shape"], meta["spec"]["num_layers"], meta["num_experts"], meta["top_k"]) == (None, 30, 96, 5)
    assert meta["expert_size"].startswith("unknown")
    rows = replay(tmp_path / "t.parquet", BUILTIN + FIELD, "0.25")["presets"]
    assert len(rows) == len(BUILTIN + FIELD) and all(0 <= r["hit_rate"] <= 1 for r in rows)
    od = next(r for r in rows if r["preset"] == "on_demand")
    assert od["hit_rate"] <= od["belady_hit_rate"] + 1e-12 and od["cache_slots"] == int(0.25 * 30 * 96)
    lb = run([str(tmp_path / "t.parquet")], ("on_demand", "les"), ("0.25",), devices=("ufs22-phone",))
    assert all(r["bytes_per_token"] is None and r["belady_hit_rate"] > 0 for r in lb["rows"])
    assert main(["simulate", "--trace", str(tmp_path / "t.parquet"), "--preset", "les", "--model", "demo"]) == 2
    assert "pass --shape" in capsys.readouterr().err


# ---------------------------------------------------------------- the shipped Qwen3-30B-A3B trace

@pytest.fixture(scope="module")
def qwen():
    return read_trace(QWEN)


def test_the_shipped_qwen_trace_is_the_real_routing_with_its_license_and_provenance(qwen):
    spec = MoESpec.from_dict(qwen["meta"]["spec"])
    assert qwen["topk"].shape == (129, 48, 6) and spec.family == "qwen3_moe"
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size) == (48, 128, 6, 2048)
    imp = qwen["meta"]["imported"]
    assert imp["format"] == "route_trace v1" and (imp["prompt_tokens"], imp["decode_tokens"]) == (1, 128)
    assert imp["left_out"] == 27 and "Qwen3-30B-A3B" in imp["model"]
    np.testing.assert_allclose(qwen["weights"].sum(-1), 1.0, atol=1e-4)     # normalized top-6 weights, best first
    assert (np.diff(qwen["weights"], axis=-1) <= 1e-6).all()
    prov = (REPO / "data" / "traces" / "PROVENANCE.md").read_text()
    assert QWEN.name in prov and "Apache" in prov and imp["sha256"] in prov
    assert "Apache License" in (REPO / "data" / "traces" / "LICENSE-qwen3-30b-a3b-bigmoeonedge").read_text()
    # its statistics, as its provenance gives them: next-token reuse 0.38 of a layer's top-6 over the decode tokens
    dec = qwen["topk"][1:]
    reuse = np.mean([len(set(dec[t, L]) & set(dec[t - 1, L])) / 6 for t in range(1, 128) for L in range(48)])
    assert abs(reuse - 0.38) < 0.01
    for fraction, hit in ((0.15, 0.657), (0.25, 0.805)):      # and a per-layer LRU's hits
        h, r = lru_hits([(True, L, list(dec[t, L])) for t in range(128) for L in range(48)], int(fraction * 128))
        assert abs(h / r - hit) < 0.001


@pytest.mark.skipif(not SHARED_CSV.is_file(), reason="the source CSV lies outside the repository")
def test_the_shipped_trace_is_what_import_trace_makes_of_the_source(tmp_path, qwen):
    assert main(["import-trace", str(SHARED_CSV), "--out", str(tmp_path / "q.parquet")]) in (0, None)
    again = read_trace(tmp_path / "q.parquet")
    np.testing.assert_array_equal(again["topk"], qwen["topk"])
    np.testing.assert_array_equal(again["weights"], qwen["weights"])
    assert again["meta"]["imported"]["sha256"] == qwen["meta"]["imported"]["sha256"]


def lru_hits(accesses, cap: int) -> tuple[int, int]:
    """An independent per-layer LRU: accesses = [(counted, layer, [experts])] in order; (hits counted, routed)."""
    pools: dict = {}
    hits = routed = 0
    for counted, layer, experts in accesses:
        pool = pools.setdefault(layer, OrderedDict())
        for e in experts:
            if counted:
                routed += 1
                hits += e in pool
        for e in experts:
            pool[e] = True
            pool.move_to_end(e)
        while len(pool) > cap:
            pool.popitem(last=False)
    return hits, routed


@pytest.mark.parametrize("budget", ["0.1", "0.25", "0.5"])
def test_on_demand_on_the_imported_trace_hits_as_an_independent_per_layer_lru(qwen, budget):
    """The issue's target: replay's and the simulator's on_demand hit rate = a plain per-layer LRU's, within 0.01."""
    from experiments.compute_profile import ComputeProfile
    from experiments.simulate import replay, run
    from workbench.presets import get_preset
    topk, T = qwen["topk"], qwen["topk"].shape[0]
    cap = int(float(budget) * 128)
    preset = get_preset("on_demand").with_(cache_scope="per_layer")
    # both: the prompt's rows read first (uncounted, together), then each decode token's
    prompt, tokens = 4, T - 3
    acc = [(False, L, sorted(set(topk[:prompt, L].reshape(-1)))) for L in range(48)]
    acc += [(True, L, sorted(set(topk[t, L]))) for t in range(prompt, prompt + tokens - 1) for L in range(48)]
    hits, routed = lru_hits(acc, cap)
    replayed = replay(str(QWEN), ["on_demand"], budget, tokens=tokens, prompt=prompt,
                      knobs={"cache_scope": "per_layer"})["presets"][0]
    assert replayed["pool_slots"] == cap
    assert abs(replayed["hit_rate"] - hits / routed) < 0.01, (replayed["hit_rate"], hits / routed)
    cp = ComputeProfile(dense_s=1e-4, router_s=1e-5, expert_s=1e-4, dequant_s=1e-5)
    sim = run(str(QWEN), preset, budget, "ufs22-phone", tokens=tokens, prompt=prompt, compute=cp, record=False)
    assert sim["pool_slots"] == cap and sim["hits"] + sim["late"] + sim["misses"] == routed
    assert abs(sim["hit_rate"] - hits / routed) < 0.01, (sim["hit_rate"], hits / routed)


def test_a_modelled_lookahead_names_the_true_experts_at_the_stated_recall(qwen):
    spec = MoESpec.from_dict(qwen["meta"]["spec"])
    topk = qwen["topk"]
    for name, width, recall in (("lookahead:1:k", 6, None), ("lookahead:2:2k", 12, 0.66), ("prerouter", 6, 0.88)):
        d = TraceDrive(QWEN, spec, name, trace=qwen, recall=recall)
        table = d.preds[name]
        assert table.shape == (129, 48, width) and (table >= 0).all()
        assert all(len(set(row)) == width for row in table.reshape(-1, width)), "no expert named twice"
        got = np.mean([len(set(table[t, L]) & set(topk[t, L])) / 6 for t in range(129) for L in range(48)])
        want = 0.77 if recall is None else recall
        assert abs(got - want) < 0.015, (name, got)
        assert "modelled prediction" in d.source["prediction"] and d.source["modelled_recall"] == want
        np.testing.assert_array_equal(TraceDrive(QWEN, spec, name, trace=qwen, recall=recall).preds[name], table)
    sh = TraceDrive(QWEN, spec, "shuffled", trace=qwen).preds["shuffled"]
    assert sh.shape == (129, 48, 6) and "shuffled" in TraceDrive(QWEN, spec, "shuffled", trace=qwen).source["prediction"]


def test_the_drive_mixes_with_the_traces_router_weights(qwen):
    spec = MoESpec.from_dict(qwen["meta"]["spec"])
    d = TraceDrive(QWEN, spec, None, trace=qwen)

    class Engine:
        token_index = 0
    idx, w = d.route(3, np.zeros((5, 1)), {"engine": Engine(), "phase": "prefill"})
    np.testing.assert_array_equal(idx, qwen["topk"][:5, 3])
    np.testing.assert_array_equal(w, qwen["weights"][:5, 3])
    assert d.source["mixing_weights"] == "the trace's router weights"


def test_simulate_runs_every_design_on_the_imported_trace_and_says_the_prediction_is_modelled(qwen):
    from experiments.compute_profile import ComputeProfile
    from experiments.simulate import run
    from workbench.errors import WorkbenchError
    from workbench.presets import PRESETS, get_preset
    cp = ComputeProfile(dense_s=1e-4, router_s=1e-5, expert_s=1e-4, dequant_s=1e-5, engine="packed",
                        reader_holds_gil=False)
    for name, p in PRESETS.items():
        if not p.exact:                     # routing changed by the design: a trace replays exact routing
            with pytest.raises(WorkbenchError, match="changes routing"):
                run(str(QWEN), name, "0.25", "ufs22-phone", tokens=6, compute=cp, record=False)
            continue
        for budget in ("0.1", "4GiB"):
            res = run(str(QWEN), name, budget, "ufs22-phone", tokens=6, compute=cp, record=False)
            assert res["simulated"] and res["decode_steps"] == 5
            if p.prefetch.predictor is None:            # demand fetching: never above Belady's bound
                assert res["hit_rate"] <= res["belady_hit_rate"] + 1e-9, (name, budget)
            modelled = str(p.prefetch).startswith("lookahead")
            assert ("modelled prediction" in res["routing_trace"].get("prediction", "")) == modelled, name
    les = get_preset("les").with_(lookahead_recall="0.5")
    res = run(str(QWEN), les, "0.25", "ufs22-phone", tokens=6, compute=cp, record=False)
    assert res["routing_trace"]["modelled_recall"] == 0.5 and "recall 0.5" in res["routing_trace"]["prediction"]
    with pytest.raises(WorkbenchError, match="pass --model"):
        run(str(QWEN), "les", "0.25", "ufs22-phone", tokens=6, record=False)
    with pytest.raises(WorkbenchError, match="lookahead_recall 1.5 must be in 0..1"):
        get_preset("les").with_(lookahead_recall="1.5")


def test_replay_runs_every_preset_on_the_imported_trace_and_says_its_lookahead_is_modelled(capsys):
    assert main(["replay", str(QWEN), "--preset", "on_demand,les,smol,oracle", "--budget", "0.25", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["preset"]: r for r in res["presets"]}
    assert res["routing_check"] is None and set(rows) == {"on_demand", "les", "smol", "oracle"}
    assert rows["oracle"]["prefetch_recall"] == 1.0 and abs(rows["les"]["prefetch_recall"] - 0.77) < 0.03
    assert rows["on_demand"]["hit_rate"] <= rows["les"]["hit_rate"] + rows["les"]["late_rate"]


def test_a_made_top8_checkpoint_runs_the_top6_trace_as_traced_on_every_engine(tmp_path, monkeypatch):
    """The trace's top-6 routed on a top-8 model: 6 experts a token, the trace's weights; the packed engine's output
    equals the numpy engine's (the reference) on the same routing."""
    from runtime.session import open_session
    from workbench.shapes import make_model
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(2)
    toks = [(1, t, {L: list(zip(rng.permutation(8)[:6].tolist(), rng.dirichlet(np.ones(6)).round(4).tolist()))
                    for L in range(2)}) for t in range(12)]
    (tmp_path / "r.csv").write_text(route_csv(toks, n_layer=2, n_expert=8, k=6))
    trace = tmp_path / "t.parquet"
    assert main(["import-trace", str(tmp_path / "r.csv"), "--shape", "qwen3-30b-a3b", "--out", str(trace)]) in (0, None)
    model = make_model("qwen3-30b-a3b", layers=2, out=tmp_path / "m", experts=8)
    logits = {}
    for engine in ("numpy", "packed"):
        with open_session(str(model), "les", budget="0.5", engine=engine, experts="bf16",
                     drive=partial(TraceDrive, str(trace))) as s:
            logits[engine] = s.step([1, 2, 3], "prefill")
            s.generate([1, 2, 3], tokens=4)
            cfg = s.config()
            decode = [ev for ev in s.tel.events if ev.phase == "decode"]
        assert "top-6 routed on the model's top-8" in cfg["routing_trace"]["mapping"]
        assert "modelled prediction" in cfg["routing_trace"]["prediction"]
        tr = read_trace(trace)
        for ev in decode:
            assert ev.routed == sorted(set(tr["topk"][2 + ev.token, ev.layer].tolist()))
    np.testing.assert_allclose(logits["packed"], logits["numpy"], rtol=2e-3, atol=2e-3)


def test_the_les_ladder_on_a_trace_runs_the_rungs_a_trace_can_drive_and_names_the_one_it_cannot():
    """Speculative verification decodes several tokens at once, which a recorded trace cannot: that rung is listed as
    not run, with why, and every other rung runs on the trace's routing."""
    from experiments.ladder import run_ladder, table
    res = run_ladder("les", "demo", tokens=4, rounds=1, routing_trace=str(REPO / "data/traces/demo-tinystories-256.parquet"))
    assert [r["rung"] for r in res["rungs"]] == ["on_demand", "+lookahead", "+ready_first & contiguous",
                                                 "+mixed precision (q3/q4)"]
    assert [r["rung"] for r in res["not_run"]] == ["+speculative verification"]
    assert "+speculative verification" in table(res) and "not run: the routing trace" in table(res)
