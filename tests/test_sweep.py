"""Sweeps: a grid file becomes cells; cells run on Ray (a local Ray of 2 CPUs, and a two-node cluster made in the
test); every cell's run record comes home; timing cells never share a node in time; a re-run resumes; a failing
cell is reported while the rest finish."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import REPO, make_checkpoint
from test_bad_input import assert_one_line_error, cli

ray = pytest.importorskip("ray")
MB = 2 ** 20
PAGE = REPO / "dashboards" / "pages" / "3_Sweeps.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Qwen3-MoE checkpoint, and a quick disk probe saved where every Ray worker finds it (the floor)."""
    import workbench.disk_probe as disk_probe
    real = disk_probe.probe_disk
    disk_probe.probe_disk = lambda path, seconds_per_point=0.3, **kw: real(path, sizes=(65536, 262144), depths=(1,),
                                                                      seconds_per_point=0.05)
    try:
        disk_probe.probe()
    finally:
        disk_probe.probe_disk = real
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("sweep") / "tiny")


def grid_file(tmp_path, model, budgets, cells=("bench", "eval ppl"), name="g") -> str:
    text = f"""
name: {name}
models: ["{model}"]
cells: [{", ".join(cells)}]
axes:
  preset: [on_demand, les]
  budget: [{", ".join(f'"{b}"' for b in budgets)}]
bench: {{tokens: 3, rounds: 2}}
eval: {{ctx: 32, chunks: 1}}
"""
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return str(p)


def no_overlap_per_node(rows):
    """Every measured round of every timing cell, per node: none starts before the previous one ended."""
    by_node = {}
    for r in rows:
        if r["kind"] == "bench":
            by_node.setdefault(r["node"], []).extend(map(tuple, r["intervals"]))
    for node, iv in by_node.items():
        iv.sort()
        for (s0, e0), (s1, e1) in zip(iv, iv[1:]):
            assert s1 >= e0, f"two timing cells overlapped on {node}: {(s0, e0)} and {(s1, e1)}"
    return by_node


# ---------------------------------------------------------------- the grid file

def test_grid_expands_to_cells_and_timing_groups(tmp_path, tiny):
    from experiments.grid import load_grid
    p = tmp_path / "g.yaml"
    p.write_text(f"models: ['{tiny}']\ncells: [bench, eval teacher, eval lm]\n"
                 "axes: {preset: [les, smol], budget: ['0.25', '0.5'], experts: [q4, q3], task: [piqa]}\n"
                 "bench: {tokens: 8}\n")
    g = load_grid(p)
    assert g.name == "g" and len(g.cells) == 3 * 2 * 2 * 2
    assert len({c.id for c in g.cells}) == len(g.cells)
    assert [c.id for c in load_grid(p).cells] == [c.id for c in g.cells]          # ids are stable
    bench = [c for c in g.cells if c.kind == "bench"]
    assert {c.get("tokens") for c in bench} == {8} and {c.get("rounds") for c in bench} == {3}
    les_q4 = next(c for c in bench if c.preset == "les" and c.name == "les experts q4")
    p = les_q4.preset_obj()
    assert p.storage.experts == "q4" and str(p.prefetch) == "lookahead:1:k"
    groups = g.groups()                                   # the arms (preset x experts) alternate within a budget
    assert sorted(len(x) for x in groups) == [4, 4] and all(len({c.budget for c in x}) == 1 for x in groups)
    assert {c.task for c in g.cells if c.kind == "eval lm"} == {"piqa"}
    assert {c.task for c in g.cells if c.kind != "eval lm"} == {None}


def test_device_axis_and_simulate_cells(tmp_path, tiny):
    """simulate cells run over devices x presets x budgets (this-machine without the axis); bench cells with a
    device emulate it, each device its own timing group; eval cells have no device."""
    from experiments.grid import load_grid
    p = tmp_path / "g.yaml"
    p.write_text(f"models: ['{tiny}']\ncells: [simulate, bench, eval ppl]\n"
                 "axes: {preset: [on_demand, les], budget: ['0.25', '0.5'], device: [iphone-les, ufs22-phone]}\n"
                 "simulate: {tokens: 16}\n")
    g = load_grid(p)
    kind = lambda k: [c for c in g.cells if c.kind == k]
    assert len(kind("simulate")) == len(kind("bench")) == 8 and len(kind("eval ppl")) == 4
    assert {(c.device, c.clock) for c in kind("simulate")} == {("iphone-les", "simulated"), ("ufs22-phone", "simulated")}
    assert {(c.device, c.clock) for c in kind("bench")} == {("iphone-les", "emulated"), ("ufs22-phone", "emulated")}
    assert {(c.device, c.clock) for c in kind("eval ppl")} == {(None, "measured")}
    assert {c.get("tokens") for c in kind("simulate")} == {16} and all(c.timing for c in kind("simulate"))
    groups = g.groups()                                # arms alternate within one kind, budget and device
    assert sorted(len(x) for x in groups) == [2] * 8
    assert all(len({(c.kind, c.budget, c.device) for c in x}) == 1 for x in groups)
    p.write_text(f"models: ['{tiny}']\ncells: [simulate, bench]\naxes: {{preset: [les]}}\n")
    sim, bench = load_grid(p).cells
    assert (sim.device, bench.device, bench.clock) == ("this-machine", None, "measured")


@pytest.mark.parametrize("text,needle", [
    ("cells: [bench]\naxes: {device: [iphone]}\n", "axes.device: --device 'iphone': no such profile"),
    ("cells: [simulate]\naxes: {preset: [smol_bias]}\n", "preset smol_bias changes routing"),
    ("cells: [simulate]\nsimulate: {trace: nope.parquet}\n", "simulate.trace: no file nope.parquet"),
    ("cells: [simulate]\nsimulate: {compute: cpu.json}\n", "simulate.compute: no file cpu.json"),
    ("cells: [bench]\naxes: {preset: [nope]}\n", "'nope': unknown"),
    ("cells: [bench]\naxes: {budget: [lots]}\n", "--budget 'lots'"),
    ("cells: [bench\n", "not valid YAML"),
    ("cells: [bench]\nbench: {tokenz: 3}\n", "bench: expected a mapping"),
    ("cells: [bench]\nbench: {tokens: many}\n", "bench.tokens: 'many' is not a number"),
])
def test_bad_grid_is_one_line_naming_the_file(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    assert_one_line_error(cli("sweep", str(p)), str(p), needle)


# ---------------------------------------------------------------- on a two-node cluster, through the CLI

@pytest.mark.slow
def test_cluster_sweep_from_the_command_line(tmp_path, tiny):
    from ray.cluster_utils import Cluster
    from workbench.runs import read_run
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * MB})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        grid = grid_file(tmp_path, tiny, ["0.25", "0.5"], name="c")
        env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "WORKBENCH_RUNS": str(tmp_path / "runs")}
        out = subprocess.run([sys.executable, "-m", "workbench", "sweep", grid, "--address", cluster.address, "--json"],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    finally:
        cluster.shutdown()
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["counts"] == {"ok": 8, "failed": 0, "resumed": 0}
    for r in res["rows"]:
        assert str(tmp_path / "runs") in r["run"] and read_run(r["run"])["config"]["sweep"]["node"] == r["node"]
    by_node = no_overlap_per_node(res["rows"])
    assert len(by_node) == 2, "the two timing groups ran one on each node"
    assert "sweep c" in out.stderr                                         # the progress bar


# ---------------------------------------------------------------- on a local Ray

@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the tests below (a Ray start-up takes seconds here)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * MB, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_local_sweep_records_resume_and_a_failing_cell(tmp_path, tiny, monkeypatch, local_ray):
    from experiments.grid import load_grid
    from workbench.runs import list_runs, read_run
    from evals.sweep import RUNNERS
    from experiments.sweep import run_grid
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    grid = load_grid(grid_file(tmp_path, tiny, ["0.5", "1KiB"]))     # 1KiB holds no expert: those cells fail
    res = run_grid(grid, RUNNERS, progress=False)
    records = set(list_runs())
    again = run_grid(grid, RUNNERS, progress=False)
    rows = {(r["kind"], r["design"], r["budget"]): r for r in res["rows"]}
    assert len(rows) == 8 and res["counts"] == {"ok": 4, "failed": 4, "resumed": 0}
    for (kind, design, budget), r in rows.items():
        if budget == "1KiB":
            assert r["status"] == "failed" and r["attempts"] == 2 and "budget" in r["error"], r
            continue
        assert r["status"] == "ok" and r["attempts"] == 1 and r["node"]
        rec = read_run(r["run"])                                   # the record came home, whole
        assert rec["config"]["sweep"]["cell"] == r["cell"] and rec["config"]["preset"]["name"] == design
        if kind == "bench":
            assert len(rec["summary"]["tok_s_rounds"]) == 2 and len(rec["events"]) > 0
            assert rec["summary"]["tok_s"] == r["tok_s"] > 0 and len(r["intervals"]) == 2
        else:
            assert rec["config"]["eval"] == "ppl" and r["ppl"] == rec["summary"]["ppl"] > 1
    assert len(records) == 4 and not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]
    no_overlap_per_node(res["rows"])
    table = pq.read_table(res["table"]).to_pylist()
    assert sorted((t["cell"], t["status"]) for t in table) == sorted((r["cell"], r["status"]) for r in res["rows"])
    # the re-run skips the finished cells (no new records) and tries the failed ones again
    assert again["counts"] == {"ok": 4, "failed": 4, "resumed": 4}
    assert set(list_runs()) == records
    assert {r["run"] for r in again["rows"] if r["resumed"]} == {r["run"] for r in res["rows"] if r["run"]}




@pytest.mark.slow
def test_ladder_is_one_timing_group_of_alternating_rungs(tmp_path, tiny, monkeypatch, local_ray):
    from experiments.ladder import les_rungs, run_ladder
    from workbench.runs import read_run
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    res = run_ladder("les", model=str(tiny), tokens=3, rounds=2)
    names = [p.name for p in les_rungs()]
    assert [r["rung"] for r in res["rungs"]] == names and res["rungs"][0]["speedup"] == 1.0
    rounds = []
    for i, r in enumerate(res["rungs"]):
        rec = read_run(r["run"])
        cfg = rec["config"]
        assert (cfg["ladder"], cfg["rung"], cfg["rung_index"], cfg["preset"]["name"]) == ("les", names[i], i, names[i])
        assert rec["summary"]["tok_s_rounds"] == r["tok_s_rounds"] and len(r["tok_s_rounds"]) == 2
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        rounds.append(cfg["sweep"]["intervals"])
    flat = [tuple(iv[r]) for r in (0, 1) for iv in rounds]
    assert flat == sorted(flat), "the rounds did not run A B C ... then A B C ..."
    assert "speculative" in res["rungs"][-1]["rung"] and res["rungs"][-1]["tokens"] == 3


@pytest.mark.slow
def test_simulate_and_emulated_cells_run_the_verbs_code(tmp_path, tiny, monkeypatch, local_ray):
    """A simulate cell is `simulate` (its record says simulated, and the virtual clock run again on the record's
    compute profile gives the same numbers); a bench cell on a device is `bench --device` (its record says emulated)."""
    from experiments.grid import load_grid
    from experiments.compute_profile import ComputeProfile
    from experiments.simulate import run
    from experiments.sweep import markdown, run_grid
    from workbench.runs import read_run
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    p = tmp_path / "d.yaml"
    p.write_text(f"models: ['{tiny}']\ncells: [simulate, bench]\n"
                 "axes: {preset: [les], budget: ['0.5'], device: [iphone-les, ufs22-phone]}\n"
                 "simulate: {tokens: 8}\nbench: {tokens: 3, rounds: 1}\n")
    res = run_grid(load_grid(p), progress=False)
    assert res["counts"] == {"ok": 4, "failed": 0, "resumed": 0}
    for r in res["rows"]:
        rec = read_run(r["run"])
        if r["kind"] == "simulate":
            cfg = rec["config"]
            assert cfg["simulated"] and rec["summary"]["simulated"] and cfg["device"] == r["device"]
            again = run(cfg["trace"], "les", "0.5", r["device"], tokens=8, record=False,
                        compute=ComputeProfile(**cfg["compute_profile"]))
            assert (again["tok_s"], again["hit_rate"]) == (r["tok_s"], r["hit_rate"])
            assert r["belady_hit_rate"] == again["belady_hit_rate"]
        else:
            assert rec["summary"]["emulated"] and rec["summary"]["device"]["name"] == r["device"]
            assert r["clock"] == "emulated" and r["tok_s"] > 0
    no_overlap_per_node(res["rows"])
    md = markdown(res, "sweep d.yaml")
    assert md.count("(SIMULATED)") == 2 and md.count("(EMULATED)") == 2


@pytest.mark.slow
def test_a_design_from_a_file_is_a_grid_cell(tmp_path, monkeypatch, local_ray):
    """A preset axis takes a design by reference: the cell runs it on a Ray worker as simulate would here."""
    import shutil
    from dataclasses import asdict
    from experiments.compute_profile import ComputeProfile
    from experiments.grid import load_grid
    from experiments.simulate import run
    from experiments.sweep import run_grid
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    shutil.copy(REPO / "examples/my_design.py", tmp_path / "mine.py")
    cpu = ComputeProfile(dense_s=2e-4, router_s=2e-5, expert_s=5e-5, dequant_s=1e-4, engine="packed",
                         reader_holds_gil=False)
    (tmp_path / "cpu.json").write_text(json.dumps(asdict(cpu)))
    ref = f"{tmp_path / 'mine.py'}:Mine"
    p = tmp_path / "d.yaml"
    p.write_text(f"models: [demo]\ncells: [simulate]\naxes: {{preset: ['{ref}'], budget: ['0.25']}}\n"
                 f"simulate: {{tokens: 12, compute: '{tmp_path / 'cpu.json'}'}}\n")
    res = run_grid(load_grid(p), progress=False)
    assert res["counts"] == {"ok": 1, "failed": 0, "resumed": 0}
    [row] = res["rows"]
    here = run("data/traces/demo-tinystories-256.parquet", ref, "0.25", "this-machine", tokens=12, compute=cpu,
               record=False)
    assert (row["tok_s"], row["hit_rate"]) == (here["tok_s"], here["hit_rate"])


def test_sweeps_page_empty_state_names_the_command(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    at = AppTest.from_file(str(PAGE), default_timeout=60).run()
    assert not at.exception and "No sweep tables" in at.info[0].value
    assert [c.value for c in at.code] == ["python -m workbench sweep benchmarks/grids/demo_budgets.yaml"]


def test_sweeps_page_draws_a_sweep_table(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest
    from experiments.grid import parse_grid
    from experiments.sweep import write_sweep_table
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    grid = parse_grid({"cells": ["bench", "eval teacher"], "axes": {"preset": ["on_demand", "les"],
                                                                    "budget": ["0.25", "0.5"]}}, "t.yaml")
    rows = []
    for i, c in enumerate(grid.cells):       # the numbers are made up: this checks the drawing, not a measurement
        failed = c.kind == "bench" and c.budget == "0.5" and c.preset == "les"
        rows.append({**c.row(), "status": "failed" if failed else "ok", "error": "boom" if failed else None,
                     "attempts": 2 if failed else 1, "node": "n1", "tok_s": 10.0 + i if c.timing and not failed else None,
                     "kl": 0.01 * i if c.kind == "eval teacher" else None, "resumed": False, "run": None})
    write_sweep_table(grid, rows)
    at = AppTest.from_file(str(PAGE), default_timeout=60).run()
    assert not at.exception and not at.info
    assert "8 cells: 7 ok, 1 failed" in at.markdown[0].value
    assert len(at.get("vega_lite_chart")) == 2 and "boom" in at.warning[0].value
    assert at.dataframe[0].value.shape[0] == 8
