"""Every benchmarks/ script (the scripts behind results/ and the README's headline numbers), run as its users run it,
`python benchmarks/NAME.py ...`, at its smallest size (the demo model, a few tokens, one round), writing into a
temporary folder: what it writes is well-formed and agrees with itself (its Markdown with its JSON, each ratio with
its parts, each verdict with its target). No speed is asserted: a few tokens on a shared machine say nothing.
full_size.py, which needs a GGUF, runs on a made 4-layer slice of Qwen3-Next-80B-A3B (180 MiB, not 27.9 GB)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py"))
TESTED = {"before_after", "forced_text", "full_size", "kernels", "ladders", "lossy", "pack_formats", "peer", "regimes",
          "router_cost", "run_setup", "server_limits", "server_load", "speculative", "targets"}


def run(script: str, *args, timeout: float = 1800) -> str:
    """`python benchmarks/<script>.py ARGS` from the repository root, this tree first on the path; its stdout."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *map(str, args)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script}.py exited {p.returncode}:\n{p.stderr[-4000:]}"
    return p.stdout


def command_line(md: str) -> str:
    """The command a results file says made it: its first `...` span."""
    return re.search(r"`(python [^`]+)`", md).group(1)


def rows_of(md: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown table rows whose first cell is `first_cell`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines()
            if line.startswith("|")]
    return [r for r in rows if r[0] == first_cell]


def same(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_every_benchmark_script_is_run_here():
    assert set(SCRIPTS) == TESTED, f"run the new script here: {sorted(set(SCRIPTS) - TESTED)}"


def check_rungs(ladder: dict, rounds: int):
    base = ladder["rungs"][0]["tok_s"]
    for r in ladder["rungs"]:
        assert len(r["tok_s_rounds"]) == rounds and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"], r["rung"]
        assert same(r["speedup"], r["tok_s"] / base), r["rung"]
        assert same(r["hit_rate"] + r["late_rate"] + r["miss_rate"], 1.0, 1e-6), r["rung"]
        record = json.loads((Path(r["run"]) / "summary.json").read_text())
        assert same(record["tok_s"], r["tok_s"]), f"{r['rung']}: the table's tok/s is not its run record's"


@pytest.mark.slow
def test_ladders(tmp_path):
    """Each ladder with the command that measured it; one left out of --only keeps its last measurement."""
    run("ladders", "--model", "demo", "--tokens", 2, "--rounds", 1, "--only", "les", "--out", tmp_path)
    les = json.loads((tmp_path / "ladders.json").read_text())["ladders"]["les"]
    run("ladders", "--model", "demo", "--tokens", 2, "--rounds", 1, "--only", "smol", "--out", tmp_path)
    res, md = json.loads((tmp_path / "ladders.json").read_text()), (tmp_path / "ladders.md").read_text()
    assert list(res["ladders"]) == ["les", "smol"] and res["ladders"]["les"] == les
    assert command_line(md) == les["command"] == ("python benchmarks/ladders.py --model demo --budget 0.25 "
                                                  "--tokens 2 --rounds 1 --only les")
    assert res["ladders"]["smol"]["command"].endswith("--only smol") and f"`{res['ladders']['smol']['command']}`" in md
    for name, ladder in res["ladders"].items():
        assert ladder["ladder"] == name and ladder["rounds"] == 1 and f"## {name}\n" in md
        check_rungs(ladder, 1)
        for r in ladder["rungs"]:
            assert re.search(rf"^{re.escape(r['rung'][:34])}\s+{r['tok_s']:.1f} ", md, re.M), r["rung"]
    bias = [r for r in res["ladders"]["smol"]["rungs"] if r.get("heldout_ppl")]
    assert bias, "the smol ladder's rungs carry their held-out perplexity"
    for r in bias:
        assert rows_of(md, r["rung"])[-1][1:] == [f"{r['heldout_miss_rate']:.3f}", f"{r['heldout_ppl']:.3f}"]


@pytest.mark.slow
def test_targets(tmp_path):
    run("targets", "--model", "demo", "--tokens", 2, "--rounds", 1, "--out", tmp_path)
    res, md = json.loads((tmp_path / "targets.json").read_text()), (tmp_path / "targets.md").read_text()
    assert command_line(md) == res["command"]
    check_rungs(res, 1)
    tok = {r["rung"]: r["tok_s"] for r in res["rungs"]}
    assert same(res["targets"]["les_over_on_demand"]["measured"], tok["les"] / tok["on_demand"])
    assert same(res["targets"]["les_over_resident"]["measured"], tok["les"] / tok["resident"])
    assert same(res["targets"]["les_over_baseline_les"]["measured"], tok["les"] / tok["les [numpy]"])
    assert "STAND-IN" in md, "without --baseline-rev the baseline is labelled a stand-in"
    for name, t in res["targets"].items():
        if isinstance(t["target"], (int, float)):
            assert t["met"] == (t["measured"] >= t["target"]), name
        line = next(line for line in md.splitlines() if line.startswith(f"- {name}: "))
        assert line.count("NOT met") == (not t["met"]), line
    rss, every = res["targets"]["cache_rss_growth_over_budget"], res["targets"]["les_at_least_on_demand_every_budget"]
    assert rss["met"] == (abs(rss["measured"] - 1) <= 0.10) and same(rss["measured"], res["memory"]["ratio"])
    assert every["met"] == (every["measured"] >= 1.0)
    check_rungs(res["budgets"], 1)


@pytest.mark.slow
def test_pack_formats(tmp_path):
    run("pack_formats", "--rounds", 1, "--tokens", 2, "--chunks", 1, "--out", tmp_path)
    res, md = json.loads((tmp_path / "pack_formats.json").read_text()), (tmp_path / "pack_formats.md").read_text()
    assert command_line(md) == res["command"] == ("python benchmarks/pack_formats.py --rounds 1 --tokens 2 "
                                                  "--budget 0.25 --chunks 1")
    arms = [(r["preset"], r["experts"]) for r in res["speed"]]
    assert sorted(arms) == sorted({(q["preset"], q["experts"]) for q in res["quality"]}) and len(set(arms)) == 4
    for r in res["speed"]:
        cells = [c for c in rows_of(md, r["preset"]) if c[1] == r["experts"]][0]
        assert cells[2] == f"{r['tok_s']:.1f}" and cells[-1] == f"{r['slot_bytes']:,}"
    for q in res["quality"]:
        assert q["kl"] >= 0 and 0 <= q["top1"] <= 1 and q["ppl"] > 1 and q["tokens"] > 0, q


@pytest.mark.slow
def test_peer(tmp_path):
    run("peer", "--model", "demo", "--tokens", 2, "--rounds", 1, "--out", tmp_path)
    res, md = json.loads((tmp_path / "peer.json").read_text()), (tmp_path / "peer.md").read_text()
    assert command_line(md) == res["command"]
    arm = {a["arm"]: a for a in res["arms"]}
    assert {"workbench resident", "llama.cpp cold", "llama.cpp warm"} <= set(arm)
    assert len(res["ratios"]) == 4
    for r in res["ratios"]:
        assert same(r["ratio"], arm[r["arm"]]["tok_s"] / arm[r["peer"]]["tok_s"])
        cells = [c for c in rows_of(md, r["arm"]) if c[1] == r["peer"]][0]
        assert cells[2] == f"{r['ratio']:.2f}" and cells[-1] == ("yes" if r["ratio"] >= res["target"] else "no")
    assert all(s["steps"] == 2 for s in res["steps"].values())
    assert f"Greedy text identical across arms: {'yes' if res['same_text'] else 'no'}" in md


def test_router_cost(tmp_path):
    run("router_cost", "--rounds", 2, "--repeat", 3, "--layers", 3, "--sweep-mib", 16, "--out", tmp_path)
    res, md = json.loads((tmp_path / "router_cost.json").read_text()), (tmp_path / "router_cost.md").read_text()
    assert command_line(md) == res["command"] == ("python benchmarks/router_cost.py --shape qwen3-next-80b-a3b "
                                                  "--rounds 2 --repeat 3 --sweep-mib 16 --layers 3")
    assert (res["rows"], res["cols"]) == (512, 2048)
    assert {(r["kind"], r["arm"]) for r in res["arms"]} == {(k, a) for k in ("Q8_0", "Q4_0")
                                                    for a in ("warm", "cold", "side by side")}
    for r in res["arms"]:
        assert len(r["us_rounds"]) == 2 and r["us_min"] <= r["us"] <= r["us_max"], r
        assert same(r["ms_per_token_2_per_layer"], 2 * 3 * r["us"] / 1e3) and same(r["gb_s"], r["bytes"] / r["us"] / 1e3)
        assert rows_of(md, r["kind"]) and any(c[1] == r["arm"] and c[3] == f"{r['us']:.0f}" for c in rows_of(md, r["kind"]))
    assert {r["bytes"] for r in res["arms"]} == {512 * 2048 // 32 * 34, 512 * 2048 // 32 * 18}    # ggml's block sizes


@pytest.mark.slow
def test_kernels(tmp_path):
    run("kernels", "--repeat", 2, "--out", tmp_path)
    res, md = json.loads((tmp_path / "kernels.json").read_text()), (tmp_path / "kernels.md").read_text()
    assert command_line(md) == res["command"] == "python benchmarks/kernels.py --repeat 2"
    assert {r["shape"] for r in res["rows"]} == {"demo", "qwen3-30b-a3b"}
    for r in res["rows"]:
        assert r["us_per_expert"] > 0 and same(r["gb_s"], r["packed_bytes"] / r["us_per_expert"] / 1e3), r
        assert math.isfinite(r["rel_err_vs_f32"]), r
    table = [line for line in md.splitlines() if re.match(r"\| (demo|qwen3-30b-a3b) \|", line)]
    assert len(table) == len(res["rows"]), "one table row per kernel timed"
    assert all(len(v) == 5 for v in res["rest_end_to_end"].values()) and "5 rounds of 2 steps" in md


def check_regimes(tmp_path, parts: list[str]) -> tuple[dict, str]:
    only = ",".join(parts)
    run("regimes", "--rounds", 1, "--tokens", 2, "--only", only, "--out", tmp_path)
    res, md = json.loads((tmp_path / "regimes.json").read_text()), (tmp_path / "regimes.md").read_text()
    cmd = f"python benchmarks/regimes.py --rounds 1 --tokens 2 --only {only} --out {tmp_path}"
    assert set(res) == {*parts, "ran"} and list(res["ran"]) == parts and all(r["cmd"] == cmd for r in res["ran"].values())
    assert [line for line in md.splitlines() if line.startswith("- ") and "`python" in line][:len(parts)] == \
        [f"- {p}: `{cmd}` ({r['when']}, load {r['load']:.1f})" for p, r in res["ran"].items()]
    assert md.rstrip().splitlines()[0] == "# The papers' regime: calibration and ladders"
    assert "## What matches, what does not, and why" in md
    return res, md


@pytest.mark.slow
def test_regimes(tmp_path):
    res, md = check_regimes(tmp_path, ["calibrate", "les", "smol"])
    assert [c["device"] for c in res["calibrate"]] == ["this-machine", "ufs22-phone"]
    assert "## Calibration: simulated vs measured, EMULATED ufs22-phone" in md
    assert "## LES's ladder, SIMULATED on the iPhone profile at MiniCPM-V 4.7's expert size" in md
    assert "## smolmaxxing's pager miss rate, SIMULATED on the UFS phone" in md


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("WB_BENCH_35B"), reason="regimes.py's ufs35b parts make a 1.7 GB "
                    "Qwen3.6-35B-A3B-shape checkpoint (its 248k-token embeddings at any layer or expert count) and "
                    "convert it to several packs and GGUFs, over 10 minutes here: WB_BENCH_35B=1 runs them")
def test_regimes_at_the_35b_expert_size(tmp_path):
    res, md = check_regimes(tmp_path, ["ufs35b", "ufs35b_gguf"])
    assert res["ufs35b"]["layers"] == res["ufs35b_gguf"]["layers"] == 4
    assert "## les vs on_demand, EMULATED UFS phone, Qwen3.6-35B-A3B expert size" in md


def made_slice(tmp_path) -> Path:
    """A 4-layer, 12-expert Qwen3-Next-80B-A3B GGUF (random weights): the full-size file's architecture, 180 MiB."""
    gguf = tmp_path / "qwen3-next-80b-a3b-4L.gguf"
    out = subprocess.run([sys.executable, "-m", "workbench", "make-model", "--shape", "qwen3-next-80b-a3b", "--layers",
                          "4", "--experts", "12", "--out", str(gguf)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return gguf


@pytest.mark.slow
def test_full_size_on_a_made_slice(tmp_path):
    gguf = made_slice(tmp_path)
    run("full_size", "--model", gguf, "--budgets", "0.5", "--designs", "on_demand,les", "--tokens", 2, "--rounds", 1,
        "--threads", 1, "--out", tmp_path)
    res = json.loads((tmp_path / "full_size_qwen3-next-80b-a3b-4L.json").read_text())
    md = (tmp_path / "full_size_qwen3-next-80b-a3b-4L.md").read_text()
    assert command_line(md) == res["command"] and not res["failed"], res["failed"]
    assert not (tmp_path / "full_size_qwen3-next-80b-a3b-4L.partial.json").exists(), "the run's checkpoint outlives it"
    assert [(r["design"], r["budget"]) for r in res["rows"]] == [("llama.cpp", "mmap, cold"), ("on_demand", "0.5"),
                                                                  ("les", "0.5")]
    assert res["file_size"] == gguf.stat().st_size and "RANDOM" in str(res["random_weights"])
    llama = res["rows"][0]
    for r in res["rows"][1:]:
        assert same(r["over_llama_cpp"], r["tok_s"] / llama["tok_s"])
        assert same(r["over_belady"], r["tok_s"] / res["bounds"]["0.5"]["belady_tok_s"])
    b = res["bounds"]["0.5"]
    assert 0 <= b["belady_misses"] <= b["accesses"] and b["best_start_misses"] <= b["belady_misses"]


@pytest.mark.slow
def test_server_load(tmp_path):
    out = tmp_path / "load.json"
    run("server_load", "--model", "demo", "--preset", "les", "--budget", "0.25", "--clients", 2, "--requests", 6,
        "--max-tokens", 2, "--warmup", 1, "--disconnect-every", 3, "--log", tmp_path / "server.log", "--out", out)
    res = json.loads(out.read_text())
    assert res["errors"] == 0 and res["server_alive_after"]
    assert res["completed"] + res["disconnects"] == 6 and res["disconnects"] == 6 // 3
    assert same(res["requests_per_s"], 6 / res["wall_s"]) and res["latency_p50_s"] <= res["latency_p99_s"]
    assert same(res["rss_growth_bytes"], res["rss_after_bytes"] - res["rss_after_warmup_bytes"])


@pytest.mark.slow
def test_server_limits(tmp_path):
    out = tmp_path / "limits.md"
    run("server_limits", "--clients", 12, "--tokens", 2, "--log", tmp_path / "server.log", "--out", out)
    res, md = json.loads(out.with_suffix(".json").read_text()), out.read_text()
    assert command_line(md) == res["command"] == f"python benchmarks/server_limits.py --clients 12 --tokens 2 --out {out}"
    burst = res["phases"]["burst"]
    assert burst["requests"] == 24 and burst["statuses"].get("200", 0) + burst["statuses"].get("429", 0) >= 24
    assert res["ok"] and list(res["phases"]) == ["burst", "oversize", "loris under the cap", "loris over the cap"]
    for name, p in res["phases"].items():
        assert p["next_request"] == 200 and p["server_running"], name
        assert rows_of(md, name), f"{name}: not in the table"
    assert "All phases clean (every answer 200 or 4xx, the next request answered): True." in md


@pytest.mark.slow
def test_before_after(tmp_path):
    """This tree against a revision (here its own HEAD), alternating: a row per tree, design and budget, with what
    issuing reads and the router cost from each run's record, and the checks computed from those rows."""
    out = tmp_path / "before_after.md"
    run("before_after", "--rev", "HEAD", "--model", "demo", "--budgets", "0.25", "--designs", "on_demand,les",
        "--tokens", 2, "--rounds", 1, "--out", out)
    md = out.read_text()
    assert command_line(md).startswith("python benchmarks/before_after.py --rev HEAD --model demo --budgets 0.25")
    rows = {(r[1], r[2]): r for r in (rows_of(md, "0.25"))}
    assert set(rows) == {(d, t) for d in ("on_demand", "les") for t in ("before (HEAD)", "after")}
    for t in ("before (HEAD)", "after"):
        od, les = rows[("on_demand", t)], rows[("les", t)]
        assert od[6] == "1.00" and float(les[6]) == pytest.approx(float(les[5]) / float(od[5]), abs=0.02)
        assert float(les[10]) > 0 and float(les[8]) > float(od[8])    # les's lookahead is in its router's time (col 7: compute)
        assert f"- {t}: lowest of floor" in md


@pytest.mark.slow
def test_lossy_levers_priced_on_the_demo(tmp_path):
    """Each arm's speed and its quality against the teacher: a row per arm and budget, the Markdown's numbers the
    JSON's, each ratio to les its own, a per-layer pool below its top-k not run and said so, a lever that acts only
    while decoding not scored by lm-eval and said so, the others paired with the teacher item by item."""
    out = tmp_path / "lossy.md"
    run("lossy", "--arms", "les,les + drop_misses,les + top_k k=3,smol_bias (q2 experts + cache bias),"
        "les + low_on_miss (q2 tier)", "--budgets", "0.1",
        "--rounds", 1, "--tokens", 4, "--chunks", 1, "--limit", 4, "--lm-budget", "0.25", "--out", out)
    res, md = json.loads(out.with_suffix(".json").read_text()), out.read_text()
    assert command_line(md) == res["command"]
    rows = {r["arm"]: r for r in res["rows"]}
    assert "below one layer's top-k" in rows["smol_bias (q2 experts + cache bias)"]["not_run"]
    les = rows["les"]
    for arm in ("les", "les + drop_misses", "les + top_k k=3"):
        r = rows[arm]
        assert same(r["over_les"], r["tok_s"] / les["tok_s"]) and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert rows_of(md, arm)[0][1] == f"{r['tok_s']:.2f}" and rows_of(md, arm)[0][7].startswith(f"{r['kl']:.4f}")
    assert rows["les + top_k k=3"]["experts_computed_per_token"] < les["experts_computed_per_token"]
    assert rows["les + drop_misses"]["kl"] > les["kl"]            # it dropped experts, and it shows
    assert res["tasks"]["les + drop_misses"] is None and "not measured" in rows_of(md, "les + drop_misses")[-1][1]
    assert res["tasks"]["les + top_k k=3"]["tinystories_ending"]["paired"]["n"] == 4
    assert les["dropped_fraction"] == 0 and rows["les + top_k k=3"]["dropped_fraction"] == 0.25
    low = rows["les + low_on_miss (q2 tier)"]              # misses computed from the resident q2 copies, not read
    assert 0 < low["low_fraction"] <= 0.75 and low["dropped_fraction"] == 0 and low["low_tier_bytes"] > 0
    assert low["bytes_read_per_token"] < les["bytes_read_per_token"] and res["tasks"]["les + low_on_miss (q2 tier)"] is None
    assert rows_of(md, "les + low_on_miss (q2 tier)")[0][6] == \
        f"{low['low_fraction']:.2f} ({low['low_tier_bytes'] / 2**20:.1f})"
    dropped = rows_of(md, "les + drop_misses")[1]           # the table of what each lever left out, layer by layer
    assert dropped[1] == f"{rows['les + drop_misses']['dropped_fraction']:.3f}" and len(dropped) == 2 + 8


def test_drafts_on_the_demo_real_and_modelled(tmp_path):
    """The drafts' held-out acceptance, a row per real draft (lookup, the draft model, the MTP head) against les, and
    on the demo's trace a row per modelled acceptance, measured and simulated, with where drafts start to pay, and
    each real draft's run predicted by the simulator: the Markdown's numbers the JSON's, each ratio its own."""
    out = tmp_path / "spec.md"
    run("speculative", "--budgets", "0.25", "--rounds", 1, "--tokens", 6, "--acceptance", "0.5,0.9",
        "--routing-trace", "data/traces/demo-tinystories-256.parquet", "--out", out)
    res, md = json.loads(out.with_suffix(".json").read_text()), out.read_text()
    assert command_line(md) == res["command"]
    assert 0 < res["heldout"]["agreement"] < 1 and 0 < res["heldout_mtp"]["agreement"] < 1
    assert f"{res['heldout_mtp']['agreement']:.3f} of positions" in md
    for part in (res["rows"], res["modelled"]["rows"]):
        les = next(r for r in part if r["arm"] == "les")
        for r in part:
            assert same(r["over_les"], r["tok_s"] / les["tok_s"])
            assert f"{r['tok_s']:.1f}" in [row[2] for row in rows_of(md, r["arm"])]
            assert (r["arm"] == "les") == (r["tokens_per_target_step"] is None)
            assert r["arm"] == "les" or (r["tokens_per_target_step"] >= 1 and r["union_growth"] >= 1)
    modelled = [r for r in res["modelled"]["rows"] if r["arm"] != "les"]
    assert [r["modelled_acceptance"] for r in modelled] == [0.5, 0.9]
    assert all(r["simulated"]["this-machine"] > 0 and r["simulated"]["ufs22-phone"] > 0 for r in modelled)
    assert "MODELLED ACCEPTANCE" in md and f"- 0.25: measured here {res['modelled']['crossover']['0.25']['measured']}" in md
    for r in res["rows"]:                   # each real draft predicted by the simulator, x les its own
        les = next(x for x in res["rows"] if x["arm"] == "les")
        assert same(r["predicted_over_les"]["ufs22-phone"], r["predicted"]["ufs22-phone"] / les["predicted"]["ufs22-phone"])
        if r["arm"] not in ("les", "les + prompt lookup, 4 a step"):
            assert 0 < r["predicted_acceptance"] <= 1
        if r["arm"] != "les":
            assert f"- {r['arm']} @0.25: {r['over_les']:.2f} measured, {r['predicted_over_les']['this-machine']:.2f}" \
                   " predicted" in md


def test_lossy_levers_on_the_emulated_phone_measure_speed_and_say_why_not_quality(tmp_path):
    from workbench.shapes import make_model
    made = make_model("qwen3-30b-a3b", layers=2, out=tmp_path / "m", experts=16)
    out = tmp_path / "phone.md"
    run("lossy", "--model", made, "--device", "ufs22-phone", "--arms", "les,les + drop_misses", "--budgets", "0.25",
        "--rounds", 1, "--tokens", 3, "--out", out)
    res, md = json.loads(out.with_suffix(".json").read_text()), out.read_text()
    assert res["device"] == "ufs22-phone" and res["random_weights"] and "EMULATED ufs22-phone" in md
    assert all(r["kl"] is None and r["tok_s"] > 0 for r in res["rows"]) and not res["tasks"]
    assert "not measured (random weights)" in rows_of(md, "les + drop_misses")[0][7] and "Pareto" not in md


def test_run_setup_on_the_demo_and_its_trace(tmp_path):
    """bench on a trace against replay of it: a row per design and budget, the Markdown's numbers the JSON's, each
    difference its own, the count within 0.01 as the rows say."""
    out = tmp_path / "agree.md"
    run("run_setup", "--model", "demo", "--trace", "data/traces/demo-tinystories-256.parquet", "--designs",
        "on_demand,les", "--budgets", "0.25", "--tokens", 8, "--out", out)
    res, md = json.loads(out.with_suffix(".json").read_text()), out.read_text()
    assert command_line(md) == res["command"]
    assert [(r["design"], r["budget"]) for r in res["rows"]] == [("on_demand", "0.25"), ("les", "0.25")]
    for r in res["rows"]:
        assert same(r["diff"], r["bench_hit_plus_late"] - r["replay_hit"])
        assert rows_of(md, r["design"])[0][5] == f"{r['diff']:+.4f}"
    assert f"{sum(abs(r['diff']) <= 0.01 for r in res['rows'])} of 2 within 0.01" in md


def test_forced_text_on_a_made_checkpoint(tmp_path, monkeypatch):
    """Free against forced text on a made checkpoint: a row each, the Markdown's numbers the JSON's, each gap to the
    real trace's LRU its own difference."""
    from workbench.shapes import make_model
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    model = make_model("qwen3-30b-a3b", layers=2, out=tmp_path / "m", experts=8)
    run("forced_text", "--models", model, "--budgets", "0.5", "--tokens", 4, "--out", tmp_path)
    res = json.loads((tmp_path / "forced_text.json").read_text())
    md = (tmp_path / "forced_text.md").read_text()
    assert command_line(md) == res["command"]
    assert [r["text"].split(":")[0] for r in res["rows"]] == ["forced text", "free"]
    for r, cells in zip(res["rows"], rows_of(md, "m")):
        assert same(r["off_by"], r["hit_rate"] - r["real_lru"]) and cells[3] == f"{r['hit_rate']:.3f}"
