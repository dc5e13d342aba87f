"""The schedule decides, once for every clock, what a layer serves from memory, what waits on a read in flight, what
it reads on demand, what a predictor prefetches and what the cache evicts. Here it runs on a clock whose reads land
when the test says; the last test holds its two other clocks (replay's and the simulator's) to each other."""
from __future__ import annotations

from pathlib import Path

import pytest

from workbench.cache import ExpertCache
from workbench.errors import WorkbenchError
from workbench.schedule import DEMAND, PREFETCH, Schedule
from workbench.telemetry import LayerEvent, Telemetry

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "data" / "traces" / "demo-tinystories-256.parquet")


class Read:
    def __init__(self, key):
        self.key, self.landed, self.error = key, False, False

    def done(self):             # what the cache asks of an entry in flight
        return self.landed


class Hand:
    """A clock whose reads land only when the test (or a wait) lands them; it logs what the schedule asks."""

    def __init__(self):
        self.log, self.reads = [], {}

    def now(self):
        return 0.0

    def issue(self, keys, priority, st):
        self.log.append(("issue", priority, [k[1] for k in keys]))
        for k in keys:
            self.reads[k] = Read(k)
            self.cache.set(k, self.reads[k])
        return 100 * len(keys)

    def land(self, *keys):
        for k in keys:
            self.reads[k].landed = True

    def flying(self, ent):
        return isinstance(ent, Read) and not ent.landed

    def failed(self, ent):
        return isinstance(ent, Read) and ent.landed and ent.error

    def take(self, key, ent, st):
        if not isinstance(ent, Read):
            return False
        self.cache.set(key, "in memory")
        return True

    def wait(self, st, every):
        first = sorted(st.pending)[: None if every else 1]
        self.land(*[(st.layer, e) for e in first])
        self.log.append(("wait", first))
        return first

    def wait_for_slot(self, st, flying):
        self.land(flying[0])
        self.log.append(("wait for a slot", flying[0][1]))

    def compute(self, st, es):
        self.log.append(("compute", es))

    def evicted(self, keys):
        self.log.append(("evict", [k[1] for k in keys]))


def schedule(slots=8, layers=(0, 1), order="ready_first", resident=()):
    cache = ExpertCache(slots, 1, list(layers), min_slots_per_layer=1)
    clock = Hand()
    clock.cache = cache
    for k in resident:
        cache.reserve(k, "in memory")
    return Schedule(cache, clock, Telemetry(len(layers)), order), clock


def layer(s, L, experts, token=1, named=None, certain=False):
    st = s.begin_layer(L, [set(experts)], [token], LayerEvent(token, L, "decode", [], [], []))
    if named is not None:
        s.name(token, named, certain)
    s.run_layer(st)
    return st


def test_a_hit_is_computed_first_then_a_miss_read_on_demand_once_it_lands():
    s, clock = schedule(resident=[(0, 1)])
    st = layer(s, 0, [1, 2])
    assert st.ev.hit == [True, False] and st.misses == 1 and st.ev.late == 0
    assert clock.log == [("issue", DEMAND, [2]), ("compute", [1]), ("wait", [2]), ("compute", [2])]
    assert s.counts.demand_reads == 1 and st.ev.bytes_read == 100


def test_wait_all_waits_for_every_read_then_computes_once():
    s, clock = schedule(resident=[(0, 1)], order="wait_all")
    layer(s, 0, [1, 2, 3])
    assert clock.log == [("issue", DEMAND, [2, 3]), ("wait", [2, 3]), ("compute", [1, 2, 3])]


def test_a_prediction_is_read_after_the_layers_misses_and_is_late_while_in_flight_then_a_hit():
    s, clock = schedule()
    layer(s, 0, [0], named={1: [5, 6]}, certain=True)
    assert clock.log[:2] == [("issue", DEMAND, [0]), ("issue", PREFETCH, [5, 6])]
    clock.log.clear()
    clock.land((1, 5))
    st = layer(s, 1, [5, 6])
    assert st.ev.hit == [True, False] and st.ev.late == 1 and st.misses == 0
    assert clock.log == [("compute", [5]), ("wait", [6]), ("compute", [6])]
    assert s.counts.prefetch_issued == 2 and s.counts.prefetch_used == 2 and s.counts.prefetch_wasted == 0


def test_a_prefetch_the_routing_does_not_ask_for_is_waste_not_a_hit():
    s, clock = schedule()
    layer(s, 0, [0], named={1: [5, 6]}, certain=True)
    clock.land((1, 5), (1, 6))
    st = layer(s, 1, [5, 7])
    assert st.ev.hit == [True, False]
    assert s.counts.prefetch_wasted == 1 and s.counts.wasted_bytes == 100


def test_when_a_layers_experts_do_not_fit_they_stream_through_the_cache_in_waves():
    s, clock = schedule(slots=2, layers=(0,))
    layer(s, 0, [0, 1, 2, 3])
    assert clock.log == [("issue", DEMAND, [0, 1]), ("wait", [0]), ("compute", [0]), ("evict", [0]),
                         ("issue", DEMAND, [2]), ("wait", [1]), ("compute", [1]), ("evict", [1]),
                         ("issue", DEMAND, [3]), ("wait", [2]), ("compute", [2]), ("wait", [3]), ("compute", [3])]
    assert s.cache.slots_used <= 2


def test_a_miss_waits_for_a_slot_that_prefetches_in_flight_hold():
    s, clock = schedule(slots=2, layers=(0, 1))
    layer(s, 0, [], named={1: [5, 6]}, certain=True)      # both slots: prefetches in flight
    clock.log.clear()
    layer(s, 0, [1], token=2)
    assert clock.log == [("wait for a slot", 5), ("evict", [5]), ("issue", DEMAND, [1]), ("wait", [1]),
                         ("compute", [1])]


def test_a_guess_is_not_made_while_fewer_of_its_names_are_used_than_not():
    s, clock = schedule(slots=16)
    for t in range(1, 6):               # the guesses name 4 and 5; the routing asks for 1 only
        layer(s, 0, [0], token=t, named={1: [4, 5]})
        layer(s, 1, [1], token=t)
    issued = s.counts.prefetch_issued
    layer(s, 0, [0], token=6, named={1: [4, 5]})
    assert s.admission.precision() < 0.5 and s.counts.prefetch_issued == issued


def test_a_read_that_failed_is_read_again_when_asked_for():
    s, clock = schedule()
    layer(s, 0, [0], named={1: [5]}, certain=True)
    clock.land((1, 5))
    clock.reads[(1, 5)].error = True
    clock.log.clear()
    st = layer(s, 1, [5])
    assert st.ev.hit == [False] and st.misses == 1 and clock.log[0] == ("issue", DEMAND, [5])


def test_pinned_experts_that_fill_the_budget_are_one_clear_error():
    s, clock = schedule(slots=1, layers=(0,))
    s.cache.pin((0, 0), "in memory")
    with pytest.raises(WorkbenchError, match="pinned experts fill the budget"):
        layer(s, 0, [1])


@pytest.mark.parametrize("budget", ["0.1", "0.25", "0.5"])
@pytest.mark.parametrize("preset", ["on_demand", "les", "smol"])
def test_replay_and_the_simulator_serve_the_same_experts_on_the_same_window(preset, budget):
    """The target of #53: 64 tokens of the shipped trace, served (hit + late) and miss fractions within 0.02."""
    from experiments.compute_profile import load_compute
    from experiments.simulate import run as simulate
    from experiments.simulate import replay
    compute = load_compute(REPO / "benchmarks" / "compute" / f"demo-{preset}.json")
    if (preset, budget) == ("smol", "0.1"):      # 3 slots a layer's pool, under the demo's top-4: both refuse it
        for run in (lambda: simulate(TRACE, preset, budget, "this-machine", compute=compute, record=False),
                    lambda: replay(TRACE, [preset], budget, engine=compute.engine)):
            with pytest.raises(WorkbenchError, match="below one layer's top-k"):
                run()
        return
    sim = simulate(TRACE, preset, budget, "this-machine", tokens=64, compute=compute, record=False)
    rep = replay(TRACE, [preset], budget, tokens=64, engine=compute.engine)["presets"][0]
    assert rep["cache_slots"] == sim["cache_slots"]
    assert abs((rep["hit_rate"] + rep["late_rate"]) - (sim["hit_rate"] + sim["late_rate"])) <= 0.02
    assert abs(rep["miss_rate"] - sim["miss_rate"]) <= 0.02
