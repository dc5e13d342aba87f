"""A design is a Predictor, a Policy, or a Design bundling them over a base preset (workbench/designs). The built-ins
are found by name as a design in a file is found by reference; either runs in every verb, and a broken one is one
line naming its file, never a traceback or a half-written record."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_bad_input import assert_one_line_error, cli
from workbench.cache import ExpertCache, start_set
from workbench.designs import Setup, make_predictor
from workbench.errors import WorkbenchError
from workbench.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "data/traces/demo-tinystories-256.parquet")
EXAMPLE = REPO / "examples/my_design.py"


def run_json(*args) -> dict:
    res = cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def compute(tmp_path_factory) -> str:
    """A compute profile, so that simulate and the leaderboard measure nothing."""
    from dataclasses import asdict

    from experiments.compute_profile import ComputeProfile
    p = tmp_path_factory.mktemp("compute") / "cpu.json"
    p.write_text(json.dumps(asdict(ComputeProfile(dense_s=2e-4, router_s=2e-5, expert_s=5e-5, dequant_s=1e-4,
                                                  engine="packed", reader_holds_gil=False))))
    return str(p)


@pytest.fixture
def mine(tmp_path) -> str:
    shutil.copy(EXAMPLE, tmp_path / "mine.py")
    return f"{tmp_path / 'mine.py'}:Mine"


def test_the_example_design_is_one_file_under_40_lines():
    assert len(EXAMPLE.read_text().splitlines()) < 40


@pytest.mark.slow
def test_a_design_in_a_file_runs_in_bench_simulate_replay_and_the_leaderboard(mine, compute, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    rows = {r["preset"]: r for r in run_json("replay", TRACE, "--preset", "les", "--design", mine,
                                             "--budget", "0.25")["presets"]}
    assert set(rows) == {"les", mine} and 0 < rows[mine]["hit_rate"] <= 1 and rows[mine]["prefetch_recall"] > 0
    sim = run_json("simulate", "--trace", TRACE, "--design", mine, "--budget", "0.25", "--compute", compute,
                   "--tokens", "16", "--no-record")
    assert sim["simulated"] and sim["preset"] == mine and sim["tok_s"] > 0
    bench = run_json("bench", "--model", "demo", "--design", mine, "--budget", "0.25", "--tokens", "8",
                     "--no-record")
    assert bench["tok_s"] > 0 and bench["prefetch_recall"] is not None
    lb = run_json("leaderboard", TRACE, "--designs", "on_demand", "--design", mine, "--budgets", "0.25",
                  "--devices", "ufs22-phone", "--compute", compute)
    got = {r["design"]: r for r in lb["rows"]}
    assert got[mine]["belady_hit_rate"] > 0 and got[mine]["simulated_tok_s"]["ufs22-phone"] > 0
    assert got["on_demand"]["hit_rate"] == pytest.approx(rows_on_demand(), abs=1e-12)


def rows_on_demand() -> float:
    from experiments.simulate import replay
    return replay(TRACE, ["on_demand"], "0.25")["presets"][0]["hit_rate"]


def test_set_reaches_a_designs_own_parameter_and_only_where_declared(mine):
    p = get_preset(mine).with_(width="2")
    assert dict(p.params) == {"width": "2"} and p.prefetch.predictor == mine.replace(":Mine", ":Popular")
    from experiments.traces import read_trace
    from workbench.spec import MoESpec
    spec = MoESpec.from_dict(read_trace(TRACE)["meta"]["spec"])
    pred = make_predictor(p.prefetch, Setup(spec), dict(p.params))
    routed = np.array([[0, 1, 2, 3]])
    named = pred.predict(spec.moe_layers[0], {"phase": "decode", "routed": routed})
    assert len(named[spec.moe_layers[1]]) == 2 * spec.top_k
    with pytest.raises(WorkbenchError, match="'width': not a preset knob"):
        get_preset("les").with_(width="2")


def cache_of(policy: str, slots: int, **kw) -> ExpertCache:
    return ExpertCache(slots, 1, [0], policy=policy, **kw)


def fill(cache, keys):
    for k in keys:
        assert cache.reserve((0, k), "x")


def test_lru_by_name_is_the_caches_recency_order():
    c = cache_of("lru", 2)
    fill(c, [1, 2])
    c.get((0, 1))
    fill(c, [3])
    assert c.last_evicted == [(0, 2)]


def test_lfu_evicts_the_least_asked_and_the_least_recent_of_a_tie():
    c = cache_of("lfu", 3)
    fill(c, [1, 2, 3])
    for k in (1, 1, 3):
        c.get((0, k))
    fill(c, [4])
    assert c.last_evicted == [(0, 2)]
    c.get((0, 4))                   # 3 and 4 once each: 3 was asked for longer ago
    fill(c, [5])
    assert c.last_evicted == [(0, 3)]


def test_lfu_with_aging_forgets_an_old_burst():
    plain, aging = cache_of("lfu", 2), cache_of("lfu_aging", 2, params={"period": 2})
    for c in (plain, aging):
        fill(c, [1, 2])
        for _ in range(6):
            c.get((0, 1))           # a burst on 1
        for _ in range(3):
            c.get((0, 2))
        fill(c, [3])
    assert plain.last_evicted == [(0, 2)]       # 1's burst counts forever
    assert aging.last_evicted == [(0, 1)]       # halved every 2 hits: 1 has 0, 2 has 1


@pytest.mark.parametrize("policy", ["lfu", "lfu_aging", "s3fifo"])
def test_a_cold_start_starts_the_policy_anew(policy):
    """What a policy counted before a cold start (bench's warm-up) is not the measured run's: after clear() the
    cache evicts as a new cache does on the same requests."""
    def run(c):
        fill(c, [1, 2, 3])
        for k in (1, 2, 2, 3):
            c.get((0, k))
        fill(c, [4, 5])
        return list(c.last_evicted), sorted(c.keys())
    used = cache_of(policy, 3)
    fill(used, [5, 4, 6])
    for _ in range(4):
        used.get((0, 5))
        used.get((0, 4))
    assert sorted(used.clear()) == [(0, 4), (0, 5), (0, 6)] and not used.keys()
    assert run(used) == run(cache_of(policy, 3))


def test_s3fifo_keeps_an_expert_asked_again_through_a_scan_that_flushes_lru():
    evicted = {}
    for policy in ("lru", "s3fifo"):
        c = cache_of(policy, 10)
        fill(c, [0])
        c.get((0, 0))
        for k in range(1, 30):                  # one-time experts: a scan
            fill(c, [k])
        evicted[policy] = (0, 0) not in c
    assert evicted == {"lru": True, "s3fifo": False}


def test_least_stale_evicts_what_this_token_did_not_use_then_the_layer_just_run():
    c = ExpertCache(2, 1, [0, 1], policy="least_stale")
    c.step()                                    # token 0, layer 0
    fill(c, [0])
    c.step()
    c.step()                                    # token 1, layer 0: (0, 0) is stale
    c.reserve((0, 1), "x")
    assert c.reserve((0, 2), "x") and c.last_evicted == [(0, 0)]
    c.get((0, 1))                               # both used this pass: the most recent goes
    assert c.reserve((0, 3), "x") and c.last_evicted == [(0, 1)]


def test_a_hot_store_pins_the_most_used_experts_beside_per_layer_pools():
    c = ExpertCache(8, 1, [0, 1], scope="per_layer", min_slots_per_layer=1)
    usage = {0: [9, 8, 7, 0, 0, 0], 1: [1, 0, 0, 0, 0, 0]}
    pinned, warm = start_set(c, usage, warm=False, hot=0.5)
    assert pinned == [(0, 0), (0, 1), (0, 2), (1, 0)] and warm == []
    assert c.capacity == {0: 2 + 3, 1: 2 + 1}           # the rest of the budget, shared evenly, beside the pins
    for k in pinned:
        c.pin(k, "x")
    for e in range(3, 6):
        c.reserve((0, e), "x")
    assert all(k in c for k in pinned) and c.slots_used <= c.slots


BROKEN = {
    "missing.py:Mine": (None, "no such design file"),
    "nope": ("class Mine: pass\n", "defines no 'Nope'"),
    "not_a_design": ("def Mine(): pass\n", "not a Design, Predictor, Policy or Router"),
    "shape": ("from workbench.designs import Predictor\nclass Mine(Predictor):\n    def predict(self, layer):\n"
              "        return {}\n", "predict takes 1 argument, the interface gives it 2"),
    "raises": ("from workbench.designs import Predictor\nclass Mine(Predictor):\n    def predict(self, layer, ctx):\n"
               "        raise ValueError('boom')\n", "predict raised ValueError: boom"),
    "expert": ("from workbench.designs import Predictor\nclass Mine(Predictor):\n    def predict(self, layer, ctx):\n"
               "        return {layer + 1: [999]} if layer + 1 < 8 else {}\n", "named expert 999"),
    "victim": ("from workbench.designs import Policy\nclass Mine(Policy):\n    def victim(self, evictable, step):\n"
               "        return (0, 12345)\n", "is not an expert that may leave"),
    "needs_h": ("from workbench.designs import Predictor\nclass Mine(Predictor):\n    needs = ('h',)\n",
                "reads h, which a routing trace does not give"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_design_is_one_line_naming_its_file_and_writes_nothing(case, tmp_path):
    text, needle = BROKEN[case]
    ref = f"{tmp_path / 'missing.py'}:Mine" if text is None else f"{tmp_path / 'd.py'}:{'Nope' if case == 'nope' else 'Mine'}"
    if text is not None:
        (tmp_path / "d.py").write_text(text)
    res = cli("replay", TRACE, "--preset", "on_demand", "--design", ref, "--budget", "0.1", "--tokens", "24")
    assert_one_line_error(res, needle)
    assert str(tmp_path) in res.stderr


def test_a_design_that_raises_mid_bench_is_one_line_and_a_whole_failed_record(tmp_path):
    """bench records a run that failed (what completed, and why), written whole like any record."""
    (tmp_path / "d.py").write_text(BROKEN["raises"][0])
    runs = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "workbench", "bench", "--model", "demo", "--design",
                          f"{tmp_path / 'd.py'}:Mine", "--tokens", "4"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "WORKBENCH_RUNS": str(runs)}, timeout=120)
    assert_one_line_error(res, "d.py:Mine: predict raised ValueError: boom")
    [run] = runs.iterdir()
    failed = json.loads((run / "failed.json").read_text())
    assert "predict raised ValueError: boom" in failed["error"] and not list(run.glob("*.tmp*"))


AGREE = ("on_demand", "history", "shuffled", "les", "smol", "oracle", "workbench.designs.field:S3FIFO",
         "workbench.designs.field:HotStore", "workbench.designs.field:CoActivation")


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["0.1", "0.25", "0.5"])
def test_bench_on_a_trace_and_replay_of_it_agree_on_what_memory_served(budget):
    """The engine's clock and replay's run one schedule from one run setup: over the same window, what each design
    found in memory or in flight (hit + late: replay's reads land at once, so its late are hits) agrees within 0.01."""
    from experiments.bench import bench
    from experiments.simulate import replay
    designs = [d for d in AGREE if not (budget == "0.1" and d in ("smol", "workbench.designs.field:HotStore"))]
    got = {r["preset"]: r["hit_rate"] for r in replay(TRACE, designs, budget, tokens=24)["presets"]}
    for d in designs:
        r = bench("demo", d, budget, tokens=24, prompt=[1, 2, 3, 4], routing_trace=TRACE, record=False)
        assert abs(r["hit_rate"] + r["late_rate"] - got[d]) <= 0.01, (d, r["hit_rate"], r["late_rate"], got[d])


ROUTER = """from workbench.designs import Router
class Mine(Router):
    params = {"bonus": 0.0}
    def route(self, layer, logits, ctx):
        bias = np.zeros(self.spec.num_experts, np.float32)
        bias[[e for L, e in self.cache.keys(layer) if L == layer]] = self.bonus
        return self.exact(layer, logits, bias)
"""


@pytest.mark.slow
def test_a_router_of_your_own_changes_the_routing_and_is_marked_so(tmp_path):
    """A Router is a design that changes the model's output: at bonus 0 it is the exact router, token for token;
    a trace (which replays exact routing) refuses it in one line; smol_bias's cache bias is one on the same class."""
    from experiments.bench import bench
    (tmp_path / "r.py").write_text("import numpy as np\n" + ROUTER)
    ref = f"{tmp_path / 'r.py'}:Mine"
    assert not get_preset(ref).exact and get_preset(ref).routing.router == ref
    exact = bench("demo", "les_no_prefetch", "0.25", tokens=8, record=False)
    zero = bench("demo", ref, "0.25", tokens=8, record=False)
    biased = bench("demo", ref, "0.25", tokens=8, record=False, bonus="5")
    assert zero["text"] == exact["text"] and biased["hit_rate"] > exact["hit_rate"]
    res = cli("replay", TRACE, "--preset", "on_demand", "--design", ref)
    assert_one_line_error(res, "changes routing")
    (tmp_path / "bad.py").write_text("import numpy as np\n" + ROUTER.replace("return self.exact(layer, logits, bias)",
                                                                           "return [1], [1.0]"))
    res = cli("bench", "--model", "demo", "--design", f"{tmp_path / 'bad.py'}:Mine", "--tokens", "2", "--no-record")
    assert_one_line_error(res, "bad.py:Mine: route at layer 0 returned experts (1,)")
