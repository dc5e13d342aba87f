"""The ablation notebooks (notebooks/*.ipynb) run top to bottom at the small setting, so they cannot rot.

Each notebook reads WB_NB_SMALL=1 in its first cell and shrinks tokens, rounds and text; its figures go to
WB_NB_FIGURES (a temporary directory here, so the committed notebooks/figures are never touched) and its run
records to the suite's temporary WORKBENCH_RUNS (conftest). The kernel is this interpreter (the project's venv):
a kernelspec naming sys.executable is registered in a temporary JUPYTER_PATH.
"""
from __future__ import annotations

import ast
import json
import os
import statistics
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
KERNEL = "moe-workbench-tests"

FIGURES = {
    "les_ablation": {"les_ladder", "les_cache_window", "les_lookahead_recall"},
    "edge0_prerouter": {"edge0_recall", "edge0_ab", "edge0_quality", "edge0_merge_retention"},
    "smol_pager": {"smol_pool_size", "smol_prefetch_depth", "smol_bias_sweep", "smol_warm_start"},
    "where_time_goes": {"time_split_designs", "time_split_tokens", "disk_profile", "floor", "time_split_full_size"},
    "regimes": {"regimes_calibration", "regimes_les_ladder", "regimes_ufs35b", "regimes_full_size"},
    "sweep_grid": {"sweep_tok_s", "sweep_kl"},
    "designs_leaderboard": {"leaderboard_hit_rate", "leaderboard_of_belady"},
    "lossy_levers": {"lossy_pareto"},
}
PARAMETERS = ("MODEL", "BUDGET", "TOKENS", "ROUNDS", "SMALL")


def read(name: str):
    return nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)


# the results/ tables whose numbers a notebook's figures show too: `make figures` remakes both
SHARES = {"les_ablation": ["results/ladders.md"], "smol_pager": ["results/ladders.md"],
          "regimes": ["results/regimes.md"], "edge0_prerouter": [], "sweep_grid": [], "where_time_goes": [],
          "designs_leaderboard": [], "lossy_levers": []}
MAX_NOTEBOOK_BYTES = 2_000_000      # reviewable: tables and charts, not megabytes of per-token data


# what no output may show: a warning (tqdm's "IProgress not found" when ipywidgets is missing, any other), or an
# absolute path of this machine (nbhelpers.shown prints paths relative to the repo or as $WORKBENCH_RUNS/...)
NOISE = ("Warning", "IProgress", "Missing packages")
MACHINE = (str(REPO), "/root/", "/home/", "/tmp/", "/work/")


def leaks(cells) -> list[str]:
    """Each warning or machine path the code cells' outputs show, with its cell and a little context."""
    found = []
    for i, c in enumerate(c for c in cells if c.cell_type == "code"):
        for o in c.get("outputs", []):
            data = {k: v for k, v in o.get("data", {}).items() if k != "image/png"}    # base64: no text to read
            text = o.get("text", "") + json.dumps(data) + "\n".join(o.get("traceback", []))
            for s in NOISE + MACHINE:
                if s in text:
                    at = text.index(s)
                    found.append(f"code cell {i}: {s!r} in ...{text[max(0, at - 60):at + 60]}...")
    return found


def stored_with_outputs(nb) -> bool:
    return any(c.outputs or c.execution_count for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_stored_whole_or_empty_and_parameterised(name):
    """A notebook is committed either as run top to bottom (`make notebook-outputs`: every code cell executed once,
    in order, none failed, a chart shown, small enough to review) or with no outputs at all: never half run."""
    nb = read(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if stored_with_outputs(nb):
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not run top to bottom"
        assert not [o for c in code for o in c.outputs if o.output_type == "error"], f"{name}: stored with an error"
        shown = {m for c in code for o in c.outputs for m in o.get("data", {})}
        assert shown & {"image/png", "application/vnd.vegalite.v5+json", "application/vnd.vegalite.v4+json"}, \
            f"{name}: stored without a chart"
        assert (NB_DIR / f"{name}.ipynb").stat().st_size < MAX_NOTEBOOK_BYTES
        assert "full setting" in "".join(o.get("text", "") for o in code[1].outputs), f"{name}: not the full setting"
    else:
        for c in code:
            assert c.outputs == [] and c.execution_count is None, f"{name}: cell {c.get('id')} is half run"
    first = code[0].source
    for p in PARAMETERS:
        assert f"\n{p} = " in f"\n{first}", f"{name}: the first code cell does not set {p}"
    assert "WB_NB_SMALL" in first
    assert nb.metadata["kernelspec"]["name"] == "python3"


def _nbhelpers():
    sys.path.insert(0, str(NB_DIR))
    try:
        import nbhelpers
    finally:
        sys.path.remove(str(NB_DIR))
    return nbhelpers


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_stored_outputs_show_no_warning_and_no_machine_path(name):
    """What a reader sees on GitHub: no warnings, nobody's absolute paths (`make notebook-outputs` regenerates them)."""
    found = leaks(read(name).cells)
    assert not found, f"{name}: " + "\n".join(found)


def _committed_at(path: str) -> int | None:
    import subprocess
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct", "--", path], capture_output=True,
                         text=True).stdout.strip()
    return int(out) if out else None


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_a_run_notebooks_figures_are_stamped_and_not_older_than_the_results_they_share(name):
    if not stored_with_outputs(read(name)):
        pytest.skip(f"{name} is stored without outputs: its figures predate the stamps")
    nbh = _nbhelpers()
    for fig in sorted(FIGURES[name]):
        png = NB_DIR / "figures" / f"{fig}.png"
        st = nbh.read_stamp(png)
        assert st and st["engine"] and st["model"] and st["cpu"] and st["commit"] and st["date"], (png, st)
        made = _committed_at(f"notebooks/figures/{fig}.png")
        for table in SHARES[name]:
            shared = _committed_at(table)
            if made is not None and shared is not None:
                assert made >= shared, f"{png} is older than {table}: run `make figures`"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_small_setting_changes_only_what_it_should(name, monkeypatch):
    """The first cell's `if SMALL:` block shrinks the run; at the full setting none of it applies."""
    source = [c for c in read(name).cells if c.cell_type == "code"][0].source
    tree = ast.parse(source)
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "SMALL")
    shrunk = {t.id for s in block.body for tgt in s.targets for t in ast.walk(tgt) if isinstance(t, ast.Name)}
    assert {"TOKENS", "ROUNDS"} <= shrunk
    top = [t.id for s in tree.body if isinstance(s, ast.Assign) for tgt in s.targets for t in ast.walk(tgt)
           if isinstance(t, ast.Name)]
    assert len(top) == len(set(top)), f"{name}: a parameter is set twice outside the `if SMALL:` block"
    runs = {}
    for small in ("", "1"):
        monkeypatch.setenv("WB_NB_SMALL", small)
        ns: dict = {}
        exec(compile(source, f"{name}: first cell", "exec"), ns)
        runs[bool(small)] = ns
    assert runs[True]["SMALL"] and not runs[False]["SMALL"]
    for v in shrunk:
        assert runs[True][v] != runs[False][v], f"{name}: {v} is the same at the full and the small setting"
    assert runs[True]["TOKENS"] <= 4 and runs[True]["ROUNDS"] == 1


def test_published_numbers_come_from_the_dashboard_module():
    nbhelpers = _nbhelpers()
    from dashboards.published import published
    assert nbhelpers.published("les") is published("les")
    assert nbhelpers.published("les_cache") is published("les_cache")
    assert nbhelpers.published("no such ladder") is None
    assert nbhelpers.paper_label(nbhelpers.published("les")).startswith("paper: ")
    assert nbhelpers.ours_label("packed").startswith("ours: ") and nbhelpers.ours_label("packed").endswith("packed engine")


def test_a_stamp_says_what_made_a_figure_and_travels_in_its_png(tmp_path):
    import altair as alt
    import pandas as pd
    nbh = _nbhelpers()
    rows = [{"engine": "packed", "model": "demo", "emulated": True, "device": {"name": "ufs22-phone", "read_mb_s": 470.0},
             "random_weights": False}]
    st = nbh.stamp(rows, simulated=True)
    assert st["engine"] == "packed" and st["model"] == "demo" and st["labels"] == ["EMULATED ufs22-phone", "SIMULATED"]
    chart = alt.Chart(pd.DataFrame({"a": ["x"], "b": [1]}), title="t").mark_bar().encode(x="a", y="b")
    shown = nbh.save(chart, "f", tmp_path, st)
    assert nbh.read_stamp(tmp_path / "f.png") == st
    assert shown.chart.title.subtitle == nbh.stamp_lines(st) and "SIMULATED" in shown.chart.title.subtitle[-1]
    bundle = shown._repr_mimebundle_()         # the cell's output: the PNG for repository browsers, the chart for Lab
    assert bundle["image/png"] and bundle["application/vnd.vegalite.v5+json"]["title"]["subtitle"] == nbh.stamp_lines(st)
    assert nbh.read_stamp(tmp_path / "f.png") != nbh.stamp(rows)          # unlabelled: no SIMULATED


def test_a_path_is_shown_relative_to_the_repo_or_a_named_root(tmp_path, monkeypatch):
    nbh = _nbhelpers()
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("WB_NB_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    assert nbh.shown(REPO / "notebooks" / "figures") == "notebooks/figures"
    assert nbh.shown(tmp_path / "runs" / "sweeps" / "t.parquet") == "$WORKBENCH_RUNS/sweeps/t.parquet"
    assert nbh.shown(tmp_path / "figures") == "$WB_NB_FIGURES"
    assert nbh.shown(tmp_path / "cache" / "models" / "m") == "$WORKBENCH_CACHE/models/m"
    assert nbh.shown(Path.home() / "elsewhere") == "~/elsewhere"
    assert nbh.run_id(tmp_path / "runs" / "20261203T115843Z-les-ce0b19") == "20261203T115843Z-les-ce0b19"


def test_the_full_size_sections_read_the_realistic_routing_files_and_pool_their_rounds(tmp_path, monkeypatch):
    """Every results/full_size_* file on realistic routing (made with real statistics, or the real trace), none on
    the earlier made routing; a file added later on realistic routing appears; rounds pool across files."""
    nbh = _nbhelpers()
    results = tmp_path / "results"
    results.mkdir()
    for name in ("full_size_qwen3-next-80b-a3b-realistic-4GiB.json", "full_size_qwen3-next-80b-a3b-realistic-2-8GiB.json",
                 "full_size_qwen3-next-80b-a3b-realistic-2-8GiB-round2.json",
                 "full_size_qwen3-30b-a3b-q2_k_s-real-trace.json", "full_size_qwen3-next-80b-a3b-designs-4GiB.json",
                 "full_size_qwen3.6-35b-a3b.json"):
        (results / name).write_bytes((REPO / "results" / name).read_bytes())
    later = json.loads((REPO / "results" / "full_size_qwen3.6-35b-a3b.json").read_text())     # as a later file will be
    (results / "full_size_qwen3.6-35b-a3b-realistic-3GiB.json").write_text(json.dumps(later))
    monkeypatch.setattr(nbh, "REPO", tmp_path)
    files = nbh.full_size_files()
    assert files == {"full_size_qwen3-next-80b-a3b-realistic-2-8GiB-round2.json": "made, with real statistics",
                     "full_size_qwen3-next-80b-a3b-realistic-2-8GiB.json": "made, with real statistics",
                     "full_size_qwen3-next-80b-a3b-realistic-4GiB.json": "made, with real statistics",
                     "full_size_qwen3.6-35b-a3b-realistic-3GiB.json": "made, with real statistics",
                     "full_size_qwen3-30b-a3b-q2_k_s-real-trace.json": "the real Qwen3-30B-A3B trace"}
    full = nbh.full_size().set_index(["model", "budget", "design"])
    assert set(full.routing) == set(files.values())
    for model, budget, design, names in (("qwen3-next-80b-a3b", "2GiB", "les", ["realistic-2-8GiB", "realistic-2-8GiB-round2"]),
                                         ("qwen3-next-80b-a3b", "4GiB", "oracle", ["realistic-4GiB"]),
                                         ("qwen3-30b-a3b-q2_k_s", "8GiB", "smol", ["real-trace"]),
                                         ("qwen3.6-35b-a3b", "3GiB", "les", ["realistic-3GiB"])):
        fs = [json.loads(next(results.glob(f"full_size_*-{n}.json")).read_text()) for n in names]
        runs = [x for f in fs for d, b, rs in f["arms"] if (d, b) == (design, budget) for x in rs]
        llama = [x["tok_s"] for f in fs for d, _, rs in f["arms"] if d == "llama.cpp" for x in rs]
        row = full.loc[(model, budget, design)]
        assert row["rounds"] == len(runs) and row["tok/s"] == statistics.median(x["tok_s"] for x in runs)
        assert row["llama.cpp tok/s"] == statistics.median(llama)
        assert row["llama.cpp same work"] == (names != ["real-trace"])     # on the trace llama.cpp routes itself
    assert "llama.cpp" not in set(full.index.get_level_values("design"))


@pytest.fixture(scope="module")
def venv_kernel(tmp_path_factory):
    """A kernelspec for this interpreter, in a JUPYTER_PATH of its own."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "moe-workbench (tests)", "language": "python"}))
    return root


def snapshot(d: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in d.glob("*")} if d.exists() else {}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_at_the_small_setting(name, venv_kernel, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("WB_NB_SMALL", "1")
    monkeypatch.setenv("WB_NB_FIGURES", str(figures))
    monkeypatch.setenv("JUPYTER_PATH", str(venv_kernel))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    runs = tmp_path / "runs"
    monkeypatch.setenv("WORKBENCH_RUNS", str(runs))
    committed = snapshot(NB_DIR / "figures")
    nb = read(name)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    NotebookClient(nb, timeout=900, kernel_name=KERNEL, resources={"metadata": {"path": str(NB_DIR)}}).execute()

    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable, "the kernel is not this interpreter"
    found = leaks(nb.cells[:-1])            # the notebook's own cells, as `make notebook-outputs` would store them
    assert not found, f"{name}: " + "\n".join(found)
    conclusion = [o for o in nb.cells[-2].outputs if "text/markdown" in o.get("data", {})]
    assert conclusion and "Conclusion" in conclusion[0]["data"]["text/markdown"], f"{name}: no conclusion shown"
    assert {p.stem for p in figures.glob("*.png")} == FIGURES[name]
    assert all(p.stat().st_size > 1000 for p in figures.glob("*.png"))
    assert snapshot(NB_DIR / "figures") == committed, "the small setting wrote into notebooks/figures"
    nbh = _nbhelpers()
    ran = {json.loads((r / "config.json").read_text()).get("engine") for r in runs.glob("*/") if (r / "config.json").exists()} - {None}
    for png in figures.glob("*.png"):
        st = nbh.read_stamp(png)
        assert st, f"{png.name}: no stamp"
        if st.get("source"):            # drawn from results/ files: it names them, and they exist
            assert all((REPO / src.split(" (")[0]).is_file() for src in st["source"]), st["source"]
            continue
        assert set(st["engine"].split(", ")) <= ran, f"{png.name}: stamped {st['engine']}, ran {ran}"
