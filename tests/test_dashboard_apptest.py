"""The dashboard as a user meets it, through Streamlit's AppTest (no browser, no server).

The live page starts real runs of the demo model in background threads; the tests poll with
at.run() the way the page's own fragments do, and read what the page shows.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dashboards import common as C  # noqa: E402  (the same module the pages import)
from dashboards import kiosk as K  # noqa: E402
from dashboards import rounds as R  # noqa: E402
from workbench.presets import PRESETS  # noqa: E402
from workbench.runs import read_run, write_run  # noqa: E402

LIVE = str(REPO / "dashboards" / "live.py")
LADDERS = str(REPO / "dashboards" / "pages" / "1_Ladders.py")
QUALITY = str(REPO / "dashboards" / "pages" / "2_Quality.py")
pytestmark = pytest.mark.skipif(not (REPO / "data" / "models" / "demo-moe" / "config.json").exists(),
                                reason="the demo model (data/models/demo-moe) is not there")


@pytest.fixture(autouse=True)
def runs_root(tmp_path, monkeypatch):
    """Every test writes its run records to its own folder."""
    root = tmp_path / "runs"
    monkeypatch.setenv("WORKBENCH_RUNS", str(root))
    return root


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    """The page bound as `make demo` binds it (this machine only), no booth file; bound(address) rebinds it.
    Every booth loop a test started is stopped after it."""
    from streamlit import config
    old = config.get_option("server.address")
    monkeypatch.delenv(K.BOOTH_ENV, raising=False)
    config.set_option("server.address", "127.0.0.1")
    yield lambda address: config.set_option("server.address", address)
    config.set_option("server.address", old)
    R.reset()


def app(path: str, **query) -> AppTest:
    at = AppTest.from_file(path, default_timeout=60)
    at.query_params.update(query)
    return at.run()


def ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def start(at: AppTest, designs, tokens=6, model="demo", budget="0.25") -> AppTest:
    at.text_input(key="model").set_value(model)
    at.multiselect(key="designs").set_value(designs)
    at.text_input(key="budget").set_value(budget)
    at.number_input(key="tokens").set_value(tokens)
    return ok(at.button(key="start").click().run())


def poll(at: AppTest, until, timeout=60.0) -> AppTest:
    deadline = time.time() + timeout
    while True:
        ok(at.run())
        if until(at):       # designs finish on their own threads: one more run draws what `until` saw
            return ok(at.run())
        if time.time() > deadline:
            raise AssertionError(f"timed out; errors on the page: {[e.value for e in at.error]}")
        time.sleep(0.3)


def finished(at: AppTest) -> bool:
    return not any(r.active for r in C.get_runs(at.session_state["run_ids"]))


def errors(at: AppTest) -> str:
    return " | ".join(e.value for e in at.error)


# ---------------------------------------------------------------- live page

def test_live_page_loads_with_its_defaults():
    at = ok(app(LIVE))
    assert at.text_input(key="model").value == "demo"
    # edge0 once it exists and is trained for the model, else the resident ceiling in its place
    expected = ["on_demand", "les", "smol", "edge0" if C.edge0_ready("demo") else "resident"]
    assert at.multiselect(key="designs").value == expected
    assert set(at.multiselect(key="designs").options) == set(PRESETS)
    assert at.text_input(key="budget").value == "0.25"
    assert at.text_area(key="prompt").value.strip()
    assert at.number_input(key="tokens").value > 0
    assert [b.label for b in at.sidebar.button] == ["Start", "Stop"]
    assert "Start" in at.info[0].value and not at.error


@pytest.fixture(scope="module")
def two_designs(tmp_path_factory):
    """One finished run of two designs (6 tokens), shared by the tests that read it."""
    root = tmp_path_factory.mktemp("runs")
    old = os.environ.get("WORKBENCH_RUNS")
    os.environ["WORKBENCH_RUNS"] = str(root)
    try:
        at = start(app(LIVE), ["on_demand", "les"], tokens=6)
        poll(at, finished)
        ok(at.run())
        yield at
    finally:
        os.environ.pop("WORKBENCH_RUNS") if old is None else os.environ.__setitem__("WORKBENCH_RUNS", old)


def test_a_run_puts_numbers_in_session_state_and_writes_records(two_designs):
    at = two_designs
    assert not at.error, errors(at)
    nums = at.session_state["numbers"]
    assert set(nums) == {"on_demand", "les"}
    for design, n in nums.items():
        assert n["status"] == "done" and n["tokens"] == 6 and n["tok_s"] > 0
        assert 0.0 <= n["hit_rate"] <= 1.0 and n["budget_bytes"] > 0 and n["cache_bytes"] <= n["budget_bytes"]
    assert nums["les"]["prefetch_recall"] is not None and nums["on_demand"]["prefetch_recall"] is None
    records = at.session_state["records"]
    assert set(records) == {"on_demand", "les"}
    for design, path in records.items():
        assert Path(path, "summary.json").exists()
        assert any(path in s.value for s in at.success), "the run directory is shown on the page"
    texts = " ".join(m.value for m in at.markdown)
    assert "on_demand · tokens: 6" in texts and "les · tokens: 6" in texts
    assert len(at.get("vega_lite_chart")) == 2 * len(C.LIVE_CHARTS)


@pytest.mark.macos
def test_an_emulated_device_is_chosen_on_the_page_and_labelled_everywhere(runs_root, surface):
    at = app(LIVE)
    assert at.selectbox(key="device").value.startswith("this machine") and "ufs22-phone" in at.selectbox(key="device").options
    at.selectbox(key="device").set_value("ufs22-phone")
    at = poll(start(at, ["on_demand"], tokens=3), finished)
    ok(at.run())
    assert not at.error, errors(at)
    assert any("EMULATED ufs22-phone" in c.value for c in at.caption)
    rec = read_run(at.session_state["records"]["on_demand"])
    assert rec["summary"]["emulated"] and rec["config"]["device"]["name"] == "ufs22-phone"
    assert "emulated:ufs22-phone" in rec["config"]["reader_mode"]
    # the design's own process: on the macOS surface too (its reads F_NOCACHE, its CPU from sysctl)
    assert rec["config"]["reader_mode"].startswith("f_nocache+pread") == (surface == "macos")
    assert (rec["env"]["cpu"] == "Apple M4 Pro") == (surface == "macos")


def test_a_routing_trace_drives_the_designs_from_the_page(runs_root):
    at = app(LIVE)
    at.text_input(key="routing_trace").set_value(str(REPO / "data/traces/demo-tinystories-256.parquet"))
    at = poll(start(at, ["les"], tokens=3), finished)
    ok(at.run())
    assert not at.error, errors(at)
    assert any("Routing and prefetches replayed from" in c.value for c in at.caption)
    rec = read_run(at.session_state["records"]["les"])
    assert rec["config"]["routing_trace"]["mapping"].startswith("layers: model MoE layer i replays")


def test_the_oracle_on_the_page_prefetches_the_routing_of_what_it_decodes(runs_root):
    """Booth mode's second round shows the oracle: its process captures the true routing of the same prompt and
    tokens first, so every expert it routes was named ahead (without it, the oracle prefetched nothing)."""
    at = poll(start(app(LIVE), ["oracle"], tokens=6), finished)
    assert not at.error, errors(at)
    n = at.session_state["numbers"]["oracle"]
    assert n["status"] == "done" and n["prefetch_recall"] == 1.0


def test_numbers_on_the_page_equal_the_run_record(two_designs):
    at = two_designs
    per_design = len(C.display_numbers({}))
    metrics = [(m.label, m.value) for m in at.metric]
    assert len(metrics) == 2 * per_design
    for i, design in enumerate(["on_demand", "les"]):
        rec = read_run(at.session_state["records"][design])
        summary = rec["summary"]
        shown = dict(metrics[i * per_design:(i + 1) * per_design])
        assert shown == C.display_numbers(summary)
        assert all(v != "—" for k, v in shown.items() if k != "prefetch recall")
        state = at.session_state["numbers"][design]
        for k in C.NUMBER_KEYS:
            assert state[k] == summary[k], k
        assert summary["tokens"] == 6 and rec["config"]["preset"]["name"] == design
        assert len(rec["tokens"]) == summary["decode_steps"] + 1       # the prefill and each decode step


def test_a_starting_design_already_has_its_running_layout(runs_root):
    """Placeholders, not a different layout, until the first token: the page does not reflow when it lands."""
    at = start(app(LIVE), ["on_demand", "les"], tokens=2)
    per_design = len(C.display_numbers({}))
    assert len(at.metric) == 2 * per_design and len(at.get("progress")) == 2
    starting = [r for r in C.get_runs(at.session_state["run_ids"]) if r.snapshot() is None]
    shown = [m.value for m in at.metric]
    assert shown.count("—") >= len(starting) * per_design
    poll(at, finished)


@pytest.mark.skipif(sys.platform != "linux", reason="process priorities are read from /proc")
def test_each_design_generates_in_its_own_process_at_a_lower_priority_than_the_page(runs_root):
    at = start(app(LIVE), ["on_demand", "les"], tokens=2000)
    runs = C.get_runs(at.session_state["run_ids"])
    poll(at, lambda a: all(r.generated > 2 for r in runs), timeout=90)
    pids = {r.process.pid for r in runs}
    tasks = [stat for pid in pids for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
    nice = {int(stat.read_text().rsplit(")", 1)[1].split()[16]) for stat in tasks}
    assert C.cores_note(2) in [c.value for c in at.caption]
    ok(at.button(key="stop").click().run())
    poll(at, finished, timeout=30)
    assert len(pids) == 2 and os.getpid() not in pids, "one process per design, none of them the page's"
    assert len(tasks) > 2 * 2, "each design reads its experts through its own reader pool"
    assert nice == {C.WORKER_NICE}, "the designs and their reader pools yield the CPU to the page"
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0, "the page itself is not lowered"


def test_the_page_says_when_designs_share_a_core():
    assert "share cores" in C.cores_note(3, 2) and "3 designs on 2 cores" in C.cores_note(3, 2)
    assert "share" not in C.cores_note(2, 2) and "at most one each" in C.cores_note(2, 2)


def test_unknown_model_path_shows_an_error_not_a_traceback():
    at = start(app(LIVE), ["on_demand"], model="/nonexistent/model-dir")
    assert "no such model" in errors(at)
    assert not at.session_state["run_ids"]


def test_budget_too_small_shows_an_error():
    at = start(app(LIVE), ["on_demand", "les"], budget="1KiB", tokens=2)
    poll(at, lambda a: len(a.error) == 2, timeout=60)
    assert all("budget" in e.value for e in at.error), errors(at)


def test_corrupt_pack_shows_an_error(tmp_path):
    bad = tmp_path / "broken.pack"
    bad.write_bytes(b"MOEPACK\0" + (1).to_bytes(4, "little") + (40).to_bytes(8, "little") + b"{not json" + b"\0" * 64)
    at = start(app(LIVE), ["on_demand"], model=str(bad))
    poll(at, lambda a: len(a.error) >= 1, timeout=30)
    assert "corrupt" in errors(at) or "broken.pack" in errors(at), errors(at)


@pytest.mark.macos
def test_stop_ends_the_runs_without_records(runs_root):
    at = start(app(LIVE), ["on_demand", "les"], tokens=2000)
    poll(at, lambda a: len(a.session_state["numbers"]) == 2, timeout=60)
    ok(at.button(key="stop").click().run())
    poll(at, finished, timeout=30)
    assert {n["status"] for n in at.session_state["numbers"].values()} == {"stopped"}
    assert not at.session_state["records"] and not list(runs_root.glob("*/summary.json"))
    assert len(at.warning) == 2 and not at.error


def test_stop_ends_a_design_whose_step_outlasts_it(monkeypatch):
    """A Stop clicked while a design is inside a long step (its first steps after a round starts: kernels compiled,
    a slow read, CPU starved at nice 19) ends it within seconds, not when the step ends: the worker is asked to stop
    at its next token, and ended by the page when that token does not come within STOP_GRACE_S."""
    import slow_worker
    monkeypatch.setattr(C.worker, "run_design", slow_worker.run_design)
    run = C.DesignRun("demo", "on_demand", "0.25", "Once upon a time", 8).start()
    deadline = time.time() + 60
    while run.generated < 1:
        assert time.time() < deadline and run.active, (run.status, run.error)
        time.sleep(0.05)
    run.stop()
    stopped = time.time()
    while run.active and time.time() - stopped < 15:
        time.sleep(0.05)
    assert run.status == "stopped" and not run.error, (run.status, run.error)
    assert time.time() - stopped < C.STOP_GRACE_S + 5, f"stopped after {time.time() - stopped:.0f} s"
    run.thread.join(15)
    assert not run.process.is_alive()


def test_booth_mode_has_only_start_and_stop_and_loops_unattended():
    at = ok(app(LIVE, booth="1", designs="on_demand,les", tokens="3", pause="0"))
    assert not at.sidebar.button and not at.text_input and not at.multiselect and not at.number_input
    assert not at.selectbox and not at.text_area and [b.label for b in at.button] == ["Start", "Stop"]
    first = list(at.session_state["run_ids"])
    assert len(first) == 2
    poll(at, lambda a: a.session_state["booth"].round >= 1, timeout=60)
    assert at.session_state["run_ids"] != first, "a new round started when the first one finished"


def test_a_visitor_stops_and_starts_the_comparison_shown():
    at = ok(app(LIVE, booth="1", designs="on_demand,les", tokens="2000", pause="0"))
    loop = at.session_state["booth"]
    first = list(loop.run_ids)
    ok(at.button(key="stop").click().run())
    poll(at, lambda a: not any(r.active for r in C.get_runs(first)), timeout=30)
    assert loop.paused and {r.status for r in C.get_runs(first)} == {"stopped"}
    time.sleep(1.5)
    ok(at.run())
    assert loop.run_ids == first, "no next round while stopped"
    assert any("stopped: press Start" in c.value for c in at.caption)
    ok(at.button(key="start").click().run())
    assert not loop.paused and loop.run_ids != first and len(loop.run_ids) == 2
    assert at.session_state["run_ids"] == loop.run_ids


def test_two_viewers_of_the_booth_share_one_set_of_runs():
    """A second browser on the same booth starts no processes of its own."""
    a = ok(app(LIVE, booth="1", designs="on_demand,les", tokens="2000", pause="0"))
    b = ok(app(LIVE, booth="1", designs="on_demand,les", tokens="2000", pause="0"))
    assert a.session_state["booth"] is b.session_state["booth"]
    assert b.session_state["run_ids"] == a.session_state["run_ids"] and len(a.session_state["run_ids"]) == 2
    assert sum(r.active and not r.stopping for r in C._RUNS.values()) == 2


def test_booth_takes_names_from_the_allow_list_never_paths(tmp_path):
    """A URL naming a path, an unknown trace, too many tokens or designs: the booth's own program, with captions."""
    outside = tmp_path / "model"
    outside.mkdir()
    at = ok(app(LIVE, booth="1", model=str(outside), trace="/etc/passwd", tokens="100000", pause="600",
                designs="on_demand,les,smol,history,oracle,teacher"))
    captions = [c.value for c in at.caption]
    assert any(c.startswith(f"model={str(outside)!r} ignored: not one this booth shows (one of demo")
               for c in captions), captions
    assert any(c.startswith("trace='/etc/passwd' ignored") and "demo-tinystories-256" in c for c in captions)
    assert f"tokens=100000 capped at {K.MAX_TOKENS}" in captions
    assert f"designs: the first {K.MAX_DESIGNS} shown (a round shows at most {K.MAX_DESIGNS})" in captions
    runs = C.get_runs(at.session_state["run_ids"])
    assert [(r.model, r.design, r.tokens, r.routing_trace) for r in runs] == [
        ("demo", d, K.MAX_TOKENS, None) for d in ("on_demand", "les", "smol", "history")]


def test_booth_plays_a_trace_from_data_traces_by_name():
    at = ok(app(LIVE, booth="1", designs="les", trace="demo-tinystories-256", tokens="2", pause="600"))
    assert not any("ignored" in c.value for c in at.caption)
    assert [r.routing_trace for r in C.get_runs(at.session_state["run_ids"])] == [str(M.DEMO_TRACE)]


def test_the_machine_runs_at_most_max_runs_designs_at_once(monkeypatch):
    monkeypatch.setattr(C, "MAX_RUNS", 3)
    at = ok(app(LIVE, booth="1", designs="on_demand,les", tokens="2000", pause="600"))
    assert len(at.session_state["run_ids"]) == 2
    other = start(app(LIVE), ["on_demand", "les"], tokens=2000)     # the sidebar page, another session
    assert "busy: 2 designs are running on this machine and at most 3 run at once" in errors(other)
    assert not other.session_state["run_ids"]
    elsewhere = ok(app(LIVE, booth="1", designs="smol,history", tokens="2000", pause="600"))
    assert not elsewhere.session_state["run_ids"], "another booth program waits for room"
    assert any("busy: 2 designs" in c.value for c in elsewhere.caption)
    ok(at.button(key="stop").click().run())
    poll(elsewhere, lambda a: len(a.session_state["run_ids"]) == 2, timeout=30)


def test_a_page_open_to_the_network_refuses_paths_outside_the_allowed_roots(tmp_path, bound, monkeypatch):
    bound("0.0.0.0")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "link").symlink_to(outside)
    monkeypatch.setenv(K.ALLOW_ENV, str(tmp_path / "inside"))
    for model in (str(outside), "/etc", str(REPO / "data" / "models" / ".." / ".." / "README.md"),
                  str(tmp_path / "inside" / "link")):
        at = start(app(LIVE), ["on_demand"], model=model)
        assert f"model {model}: outside the folders this page opens" in errors(at), model
        assert not at.session_state["run_ids"]
    at = app(LIVE)
    at.text_input(key="routing_trace").set_value("/etc/hostname")
    at = start(at, ["les"])
    assert "routing trace /etc/hostname: outside the folders" in errors(at)
    at = app(LIVE)
    at.text_input(key="routing_trace").set_value(str(M.DEMO_TRACE))
    at = poll(start(at, ["les"], model=str(REPO / "data" / "models" / "demo-moe"), tokens=2), finished)
    assert not at.error, errors(at)
    bound("127.0.0.1")      # this machine only: any path, as before (this one is no model: its design says so)
    at = poll(start(app(LIVE), ["on_demand"], model=str(outside)), finished)
    assert "outside the folders" not in errors(at) and str(outside) in errors(at)


def test_a_page_open_to_the_network_makes_no_model_size(tmp_path, bound, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    bound("0.0.0.0")
    at = app(LIVE)
    at.selectbox(key="shape").set_value(SHAPE)
    at = start(at, ["on_demand"])
    assert f"model size {SHAPE}: not made on this machine" in errors(at)
    assert not (tmp_path / "cache" / "models").exists()


def test_the_kiosk_says_what_it_prepares_then_every_page_is_the_booth(tmp_path, monkeypatch):
    booth = K.Booth(designs=("on_demand", "les"), tokens=3, pause=600, status=str(tmp_path / "status.json"))
    K.write(booth, tmp_path / "booth.json")
    K.set_status(booth, state="preparing", step="les: its pack of demo", done=1, total=3)
    monkeypatch.setenv(K.BOOTH_ENV, str(tmp_path / "booth.json"))
    at = ok(app(LIVE))                        # no ?booth=1: the kiosk's every page is the booth
    assert "Preparing the booth: les: its pack of demo (2 of 3)" in at.info[0].value
    assert not at.session_state["run_ids"] and not at.text_input and not at.button
    K.set_status(booth, state="ready", done=3, total=3)
    at = poll(at, lambda a: len(a.session_state["run_ids"]) == 2)
    assert [r.design for r in C.get_runs(at.session_state["run_ids"])] == ["on_demand", "les"]
    assert [b.label for b in at.button] == ["Start", "Stop"] and not at.text_input
    with pytest.raises(Exception, match="Could not find a navigation page"):
        at.switch_page("pages/1_Ladders.py")        # the record viewers are not served by the kiosk


# ---------------------------------------------------------------- pages

def test_ladders_page_empty_state_names_the_command():
    at = ok(app(LADDERS))
    assert "No ladder run records" in at.info[0].value
    assert "python -m workbench ladder les --model demo --json" in [c.value for c in at.code]
    assert any((df := d.value).shape[0] == 5 and 20.51 in df.iloc[:, 1].tolist() for d in at.dataframe)


def _record(config: dict, summary: dict):
    return write_run(config.get("preset", {}).get("name", "x"), config, summary, [], [], [])


def test_ladders_page_groups_rungs_and_shows_published_numbers():
    names = ["on_demand", "+lookahead", "+ready_first & contiguous"]
    for i in (2, 0, 1):     # written out of order; rung_index orders them
        _record({"model": "demo", "ladder": "les", "rung": names[i], "rung_index": i, "preset": {"name": names[i]},
                 "budget": "0.25"}, {"tok_s": [10.0, 15.0, 25.0][i], "hit_rate": 0.5})
    _record({"model": "demo", "ladder": "les", "rung": "on_demand", "rung_index": 0, "preset": {"name": "on_demand"},
             "budget": "0.25"}, {"tok_s": 5.0})                                  # a newer record of rung 0 wins
    _record({"model": "demo", "preset": {"name": "on_demand"}}, {"tok_s": 1.0})      # not a ladder record
    at = ok(app(LADDERS))
    assert not at.info
    ours, theirs = at.dataframe[0].value, at.dataframe[1].value
    assert ours["rung"].tolist() == names and ours["tok/s"].tolist() == [5.0, 15.0, 25.0]
    assert ours["× first rung"].tolist() == [1.0, 3.0, 5.0]
    assert theirs.iloc[:, 1].tolist() == [3.38, 6.57, 11.34, 17.16, 20.51]
    assert any("iPhone" in m.value for m in at.markdown)
    assert at.get("vega_lite_chart")


def test_ladders_page_shows_a_simulated_ladder_labelled_as_such():
    from experiments.ladder import les_rungs
    from experiments.compute_profile import ComputeProfile
    from experiments.simulate import run
    cpu = ComputeProfile(dense_s=1e-4, router_s=1e-5, expert_s=5e-5, dequant_s=1e-4)
    for i, rung in enumerate(les_rungs()[:2]):
        run(str(REPO / "data/traces/demo-tinystories-256.parquet"), rung, "0.25", "iphone-les", tokens=6, compute=cpu,
            rung={"ladder": "les", "rung": rung.name, "rung_index": i, "model": "demo, SIMULATED on iphone-les"})
    at = ok(app(LADDERS))
    assert any("SIMULATED on iphone-les" in h.value for h in at.subheader)
    assert any("SIMULATED on the iphone-les profile" in m.value for m in at.markdown)
    assert any("uncalibrated" in m.value for m in at.markdown)        # another device's run: not checkable here
    assert at.dataframe[0].value["rung"].tolist() == [r.name for r in les_rungs()[:2]]


def test_quality_page_empty_state_names_the_command():
    at = ok(app(QUALITY))
    assert "No eval run records" in at.info[0].value
    assert "python -m workbench eval teacher --model demo --preset les --json" in [c.value for c in at.code]


def test_quality_page_tables_and_perplexity():
    common = {"model": "demo", "budget": "0.25", "data": "tinystories", "ctx": 128}
    _record({**common, "eval": "ppl", "preset": {"name": "teacher"}}, {"ppl": 11.0})
    for preset, ppl in [("les", 12.5), ("smol", 14.0)]:
        _record({**common, "eval": "teacher", "preset": {"name": preset}},
                {"kl": 0.01, "top1": 0.9, "routing_agreement_mean": 0.8, "ppl": ppl,
                 "chunks": [{"chunk": 0, "kl": 0.01}, {"chunk": 1, "kl": 0.02}]})
    at = ok(app(QUALITY))
    assert not at.info
    texts = [d.value for d in at.dataframe]
    compare = texts[0]
    assert compare["design"].tolist() == ["teacher", "les", "smol"]
    assert compare["ppl tinystories/128"].tolist() == [11.0, 12.5, 14.0]
    assert any("kl tinystories/128" in d.columns for d in texts)
    assert at.get("vega_lite_chart") and len(at.expander) == 2


def test_quality_page_draws_the_lossy_levers_price_from_their_results():
    """results/lossy.json as shipped: at the budget picked, one point per arm that ran, its tok/s and KL the file's."""
    import json

    import pyarrow as pa
    from dashboards import lossy_view as LV
    res = json.loads(LV.RESULTS.read_text())
    at = ok(app(QUALITY))
    assert at.selectbox(key="lossy_budget").options == res["budgets"]
    at.selectbox(key="lossy_budget").set_value("0.5").run()
    chart = at.get("vega_lite_chart")[0]
    data = pa.ipc.open_stream(chart.proto.datasets[0].data.data).read_all().to_pandas()
    want = {r["arm"]: (r["tok_s"], r["kl"]) for r in res["rows"] if r["budget"] == "0.5" and "not_run" not in r}
    assert {a: (t, k) for a, t, k in zip(data["arm"], data["tok_s"], data["kl"])} == want


def test_quality_page_says_which_lossy_result_it_cannot_read(tmp_path, monkeypatch):
    from dashboards import lossy_view as LV
    bad = tmp_path / "lossy.json"
    bad.write_text('{"rows": [{"arm": "les"}]}')
    monkeypatch.setattr(LV, "RESULTS", bad)
    at = ok(app(QUALITY))
    assert any(str(bad) in w.value and "not a lossy-levers result" in w.value for w in at.warning)


def test_quality_page_marks_significant_paired_differences():
    common = {"model": "demo", "eval": "lm", "tasks": ["tinystories_cloze"]}
    ids = list(range(200))
    teacher = [1.0] * 120 + [0.0] * 80
    answers = {"teacher": teacher, "les": teacher[:-1] + [1.0],                    # one item won: noise
               "edge0": [0.0] * 30 + teacher[30:]}                                 # 30 lost: a real cost
    for preset, acc in answers.items():
        items = {"doc_id": ids, "acc": acc, "ll": [-1.0] * 200}
        _record({**common, "preset": {"name": preset}, "budget": "all" if preset == "teacher" else "0.25"},
                {"results": {"tinystories_cloze": {"acc": sum(acc) / 200, "items": items}}})
    at = ok(app(QUALITY))
    paired = next(d.value for d in at.dataframe if "significant" in d.value.columns)
    rows = {r["design"]: r for r in paired.to_dict("records")}
    assert set(rows) == {"les", "edge0"}
    assert rows["edge0"]["significant"] == "yes" and rows["edge0"]["teacher only"] == 30
    assert rows["les"]["significant"] == "no" and rows["les"]["preset only"] == 1
    assert rows["edge0"]["95% high"] < 0 < rows["les"]["95% high"]


def test_the_dashboard_imports_no_torch(tmp_path):
    """The live page, a short run of its designs (edge0's serving path included once it is trained), and what
    the other pages import: none of it may pull in torch or transformers."""
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO / "tests")!r})
import test_dashboard_apptest as T
designs = ["on_demand", "les"] + (["edge0"] if T.C.edge0_ready("demo") else [])
at = T.poll(T.start(T.app(T.LIVE), designs, tokens=2), T.finished)
assert not at.error, T.errors(at)
import altair, pandas, evals.compare, dashboards.published
bad = {{"torch", "transformers"}} & set(sys.modules)
assert not bad, bad
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO), "WORKBENCH_RUNS": str(tmp_path / "runs")})
    assert res.returncode == 0, res.stderr[-3000:]


# ---------------------------------------------------------------- model size, booth device and shape

from dashboards import model_size as M  # noqa: E402
from workbench.shapes import SHAPES, checkpoint_path  # noqa: E402

SHAPE = "qwen3.6-35b-a3b"       # the smallest expert of the shapes (d 2048, ff 512); top-8: 64 experts for the trace


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def shape_cache(shape_dir, monkeypatch):
    """One workbench cache for the model-size tests that make a checkpoint (1 layer, not the page's 4)."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(shape_dir))       # the design processes inherit it
    monkeypatch.setattr(M, "LAYERS", 1)
    return shape_dir


def test_model_size_offers_the_demo_and_every_shape():
    at = ok(app(LIVE))
    assert at.selectbox(key="shape").value == "demo" and at.selectbox(key="shape").options == ["demo", *SHAPES]
    assert not at.text_input(key="model").disabled
    at.selectbox(key="shape").set_value(SHAPE)
    assert ok(at.run()).text_input(key="model").disabled, "a shape replaces the free-text model"


def test_a_shape_is_made_once_through_the_selector_and_every_design_runs_it(shape_cache, runs_root, monkeypatch):
    at = app(LIVE)
    at.selectbox(key="shape").set_value(SHAPE)
    at.selectbox(key="device").set_value("ufs22-phone")
    at = poll(start(at, ["on_demand", "les"], tokens=2), finished, timeout=240)
    assert not at.error, errors(at)
    made = checkpoint_path(SHAPE, 1, 64)
    assert (made / "random_weights.json").is_file() and made.parent == shape_cache / "models"
    runs = C.get_runs(at.session_state["run_ids"])
    assert [(r.model, r.routing_trace, r.device) for r in runs] == [(str(made), str(M.DEMO_TRACE), "ufs22-phone")] * 2
    assert ("Model size qwen3.6-35b-a3b expert shape (1 layers, 64 experts): RANDOM weights, routing replayed from "
            f"data/traces/demo-tinystories-256.parquet. {M.FORCED}") in [c.value for c in at.caption]
    for design in ("on_demand", "les"):
        rec = read_run(at.session_state["records"][design])
        assert rec["config"]["text"].startswith("forced text: tinystories")
        assert "RANDOM" in rec["summary"]["random_weights"] and rec["config"]["device"]["name"] == "ufs22-phone"
        assert rec["config"]["routing_trace"]["path"] == str(M.DEMO_TRACE)
        assert "top-4 -> top-8" in rec["config"]["routing_trace"]["mapping"]
    monkeypatch.setattr(M, "make_model", lambda *a, **k: pytest.fail("made a second time"))
    at = ok(at.button(key="start").click().run())     # the same settings again: the checkpoint is there
    assert not at.error, errors(at)
    assert [r.model for r in C.get_runs(at.session_state["run_ids"])] == [str(made)] * 2
    poll(at, finished, timeout=120)


def test_a_shape_without_room_on_disk_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(M, "free_bytes", lambda path: 10 ** 8)
    at = app(LIVE)
    at.selectbox(key="shape").set_value("qwen3-30b-a3b")
    at = start(at, ["on_demand"])
    assert len(at.error) == 1 and "no room for qwen3-30b-a3b (4 layers, 64 experts" in errors(at)
    assert "0.1 GB free" in errors(at) and not at.session_state["run_ids"]
    assert not (tmp_path / "cache" / "models").exists()


def test_preset_knobs_are_set_on_every_design_and_a_bad_one_is_one_line(runs_root):
    """The page takes bench's --set: KNOB=VALUE pairs set on every design it starts, checked before any starts."""
    at = app(LIVE)
    at.text_input(key="knobs").set_value("predictr=oracle")
    at = start(at, ["on_demand", "les"])
    assert "'predictr': not a preset knob" in errors(at) and not at.session_state["run_ids"]
    at.text_input(key="knobs").set_value("cache_policy=lfu, lookahead_recall=0.66")
    at = start(at, ["on_demand", "les"], tokens=2)
    runs = C.get_runs(at.session_state["run_ids"])
    assert [r.knobs for r in runs] == [{"cache_policy": "lfu", "lookahead_recall": "0.66"}] * 2
    poll(at, lambda a: not any(r.active for r in C.get_runs(a.session_state["run_ids"])))
    assert {r.status for r in runs} == {"done"}, [(r.status, r.error) for r in runs]
    from workbench.runs import read_run
    assert {read_run(r.record)["config"]["preset"]["cache_policy"] for r in runs} == {"lfu"}


def test_a_shape_whose_top_k_cannot_replay_the_trace_is_refused_in_one_line():
    at = app(LIVE)
    at.selectbox(key="shape").set_value("qwen3-next-80b-a3b")
    at = start(at, ["on_demand"])
    assert "model size qwen3-next-80b-a3b" in errors(at) and "multiple of 4" in errors(at)
    assert not at.session_state["run_ids"]


def test_booth_params_pick_the_device_and_the_shape(shape_cache, monkeypatch, tmp_path):
    query = dict(booth="1", designs="on_demand", tokens="2", pause="600", device="ufs22-phone", shape=SHAPE)
    with monkeypatch.context() as m:
        m.setenv("WORKBENCH_CACHE", str(tmp_path / "empty-cache"))
        m.setattr(M, "make_model", lambda *a, **k: pytest.fail("a visitor's URL made a checkpoint"))
        at = ok(app(LIVE, **query))
    assert any(c.value.startswith(f"shape={SHAPE!r} ignored (not made on this machine") for c in at.caption)
    R.reset()
    M.make(M.plan(SHAPE))                   # what `python -m dashboards.booth --shape` prepares
    at = ok(app(LIVE, **query))
    runs = C.get_runs(at.session_state["run_ids"])
    made = str(checkpoint_path(SHAPE, 1, 64))
    assert [(r.model, r.device, r.routing_trace) for r in runs] == [(made, "ufs22-phone", str(M.DEMO_TRACE))]
    at = poll(at, finished, timeout=180)
    captions = " ".join(c.value for c in at.caption)
    assert "EMULATED ufs22-phone" in captions and "RANDOM weights, routing replayed from" in captions
    assert "ignored" not in captions and not at.error, errors(at)


def test_booth_ignores_an_unknown_device_or_shape_with_a_caption():
    at = ok(app(LIVE, booth="1", designs="on_demand", tokens="2", pause="600", device="nokia-3310", shape="gpt-5"))
    captions = [c.value for c in at.caption]
    assert any(c.startswith("device='nokia-3310' ignored") and "ufs22-phone" in c for c in captions)
    assert any(c.startswith("shape='gpt-5' ignored") and SHAPE in c for c in captions)
    runs = C.get_runs(at.session_state["run_ids"])
    assert [(r.model, r.device, r.routing_trace) for r in runs] == [("demo", None, None)]


# ---------------------------------------------------------------- the simulated ladder

def test_ladders_page_shows_the_simulated_les_ladder_beside_the_paper():
    at = ok(app(LADDERS))
    assert "SIMULATED: LES's ladder on the iPhone profile" in [h.value for h in at.header]
    table = next(d.value for d in at.dataframe if "SIMULATED tok/s" in d.value.columns)
    assert table["paper tok/s"].tolist() == [3.38, 6.57, 11.34, 17.16, 20.51]
    assert table["rung"].iloc[0] == "on_demand" and (table["SIMULATED tok/s"] > 0).all()
    assert any(c.value.startswith("SIMULATED, not measured: `simulate` on the iphone-les profile") and
               "uncalibrated" in c.value for c in at.caption)


def test_ladders_page_without_regimes_json_names_the_command(tmp_path, monkeypatch):
    from dashboards import simulated as S
    monkeypatch.setattr(S, "REGIMES", tmp_path / "regimes.json")
    at = ok(app(LADDERS))
    assert any("No simulated ladder" in i.value for i in at.info) and S.COMMAND in [c.value for c in at.code]
    (tmp_path / "regimes.json").write_text('{"les": {"rows": "not rows"}}')
    at = ok(app(LADDERS))
    assert len(at.error) == 1 and "regimes.json: not a regimes result with an LES ladder" in at.error[0].value


def test_the_time_breakdown_stacks_a_misses_parts_to_each_tokens_wall_time():
    """The live page's breakdown draws flash wait as queue, device and completion, and other as submit, hand-off
    and Python: the stacked parts of a token end at its wall time."""
    from types import SimpleNamespace
    from workbench.telemetry import TokenRecord
    ms = dict(compute_s=2, router_s=1, dequant_s=0, flash_wait_s=4, queue_s=1, device_s=2, completion_s=1, other_s=3,
              submit_s=1, handoff_s=0.5, python_s=1.5)
    rec = TokenRecord(token=1, phase="decode", n_tokens=1, wall_s=0.010, hits=0, misses=4, bytes_read=0, cache_bytes=0,
                      **{k: v / 1e3 for k, v in ms.items()})
    rows = C._breakdown_data(SimpleNamespace(tokens=[rec])).to_pydict()
    assert set(rows["part"]) == {label for _, label in C.PARTS} and "flash wait" not in rows["part"]
    assert max(rows["ms_to"]) == pytest.approx(10.0)


def test_a_design_from_a_file_runs_beside_the_presets_and_only_on_this_machine(runs_root, bound):
    """The page's "design from a file" runs your code: beside the presets while it listens here, never open."""
    mine = f"{REPO / 'examples/my_design.py'}:Mine"
    at = app(LIVE)
    at.text_input(key="design_file").set_value(mine)
    at = poll(start(at, ["on_demand"], tokens=3), finished)
    assert not at.error, errors(at)
    runs = C.get_runs(at.session_state["run_ids"])
    assert [r.design for r in runs] == ["on_demand", mine] and {r.status for r in runs} == {"done"}
    assert any(h.value == "my_design.py:Mine" for h in at.subheader)
    bound("0.0.0.0")
    at = app(LIVE)
    assert at.text_input(key="design_file").disabled        # a visitor cannot type one


def test_a_lossy_lever_runs_beside_each_design_and_the_teacher_judges_every_token(runs_root):
    """The lever picked in the sidebar runs beside each design from the same prompt, and the teacher scores every
    token of both as it comes: the lossless design near its quantization's KL, the lever further from the teacher."""
    at = app(LIVE)
    at.selectbox(key="lever").set_value("drop_misses")
    at = start(at, ["les"], tokens=16, budget="0.1")
    runs = C.get_runs(at.session_state["run_ids"])
    assert [r.name for r in runs] == ["les", "les + drop_misses"] and all(r.judged for r in runs)
    assert runs[1].knobs == {"routing": "drop_misses"} and runs[0].knobs == {}
    poll(at, lambda a: finished(a) and all(r.verdict_note or (r.verdict and r.verdict.n == 16) for r in runs))
    assert not any(r.verdict_note for r in runs), [r.verdict_note for r in runs]
    exact, lossy = (r.verdict for r in runs)
    assert exact.kl < lossy.kl and 0 <= lossy.top1 <= 1      # top-1 over 16 tokens: too few to order them
    shown = {m.label: m.value for m in at.metric}
    assert "KL vs teacher" in shown and "top-1 vs teacher" in shown
    assert sum("the teacher's verdict on 16 of 16 tokens" in c.value for c in at.caption) == 2


def test_a_run_that_cannot_be_judged_says_why(runs_root):
    at = app(LIVE)
    at.selectbox(key="lever").set_value("top_k k=2")
    at.text_input(key="knobs").set_value("speculative=2")
    at = start(at, ["les"], tokens=3)
    poll(at, finished)
    assert sum("not judged: speculative steps verify drafts in batches" in c.value for c in at.caption) == 2


def test_a_lossy_lever_needs_the_models_own_routing(runs_root):
    at = app(LIVE)
    at.selectbox(key="lever").set_value("top_k k=2")
    at.text_input(key="routing_trace").set_value("data/traces/demo-tinystories-256.parquet")
    at = start(at, ["les"], tokens=2)
    assert "needs the model's own weights and routing" in errors(at) and not at.session_state["run_ids"]


def test_booth_shows_a_lever_beside_its_designs_judged_by_the_teacher():
    at = ok(app(LIVE, booth="1", designs="on_demand,les,smol", lever="top_k k=2", tokens="3", pause="600"))
    captions = [c.value for c in at.caption]
    assert "designs: the first 2 shown (each runs twice beside its lever)" in captions
    runs = C.get_runs(at.session_state["run_ids"])
    assert [(r.name, r.judged) for r in runs] == [("on_demand", True), ("les", True), ("on_demand + top_k k=2", True),
                                                  ("les + top_k k=2", True)]
    at = ok(app(LIVE, booth="1", designs="les", lever="all of them", trace="demo-tinystories-256", tokens="2"))
    assert any(c.value.startswith("lever='all of them' ignored: not one this booth shows") for c in at.caption)


def test_a_speculative_run_shows_what_its_drafts_were_accepted_and_cost(runs_root):
    """Drafts from the demo's draft model: the page shows their acceptance and the batch's union growth, as the run
    record has them, and the draft's own time is a part of each token's breakdown."""
    at = app(LIVE)
    at.text_input(key="knobs").set_value("speculative=2, draft=demo-draft")
    at = poll(start(at, ["les"], tokens=8), finished)
    shown = {m.label: m.value for m in at.metric}
    summary = read_run(at.session_state["records"]["les"])["summary"]
    assert shown["drafts accepted"] == format(summary["spec_accept_rate"], ".0%")
    assert shown["experts a step (x one token's)"] == format(summary["union_growth"], ".2f")
    assert summary["draft"] == "demo-draft" and summary["draft_s"] > 0
    assert "draft" in {label for _, label in C.PARTS}
