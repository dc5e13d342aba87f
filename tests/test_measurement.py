"""The measurement protocol: runs start cold, and the hit rate is one quantity in three parts that add up."""
from __future__ import annotations

from pathlib import Path

import pytest

from experiments.bench import measure
from experiments.routing_trace import drive
from workbench.host import NOT_EVICTED
from runtime.session import open_session

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "data" / "traces" / "demo-tinystories-256.parquet")


def _prefill(session):
    return next(t for t in session.tel.tokens if t.phase == "prefill")


@pytest.mark.macos
def test_a_measured_run_starts_cold_by_default(surface):
    """Cold: an empty expert cache and the file out of the page cache, or, on macOS (no posix_fadvise), its reads
    F_NOCACHE and the record saying the page cache was not dropped."""
    with open_session("demo", "on_demand", budget="0.25", tokens=8) as s:
        res = measure(s, "Once upon a time", 8)
        pre = _prefill(s)
        assert res["page_cache_dropped"] == (NOT_EVICTED if surface == "macos" else "posix_fadvise(DONTNEED)")
        assert res["start"] == "cold" and res["reader_mode"].startswith("f_nocache") == (surface == "macos")
        assert pre.hits == 0 and pre.misses > 0            # every expert the prompt needs is read
    with open_session("demo", "on_demand", budget="0.25", tokens=8) as s:
        res = measure(s, "Once upon a time", 8, warm=True)
        assert res["start"] == "warm" and _prefill(s).hits > 0    # the warm-up left the prompt's experts in memory


def test_cold_start_keeps_what_the_design_keeps():
    with open_session("demo", "resident") as s:                   # all-resident: every expert stays
        n = s.cache.slots_used
        s.cold_start()
        assert s.cache.slots_used == n == s.pack.num_expert_total
    with open_session("demo", "smol", budget="0.25") as s:        # the pager's warm set is part of the design
        warm = set(s.cache.keys())
        s.generate("Once upon a time", tokens=6)
        s.cold_start()
        assert set(s.cache.keys()) == warm and not s.streamer.schedule.prefetched
    with open_session("demo", "les", budget="0.25") as s:
        s.generate("Once upon a time", tokens=6)
        s.cold_start()
        assert s.cache.slots_used == 0 and len(s.arena.where) == 0


@pytest.mark.parametrize("preset", ["on_demand", "les", "smol"])
def test_hit_late_and_miss_rates_add_up(preset):
    with open_session("demo", preset, budget="0.25", tokens=12, drive=drive(TRACE)) as s:
        res = measure(s, [1, 2, 3, 4], 12)
        assert res["hit_rate"] + res["late_rate"] + res["miss_rate"] == pytest.approx(1.0)
        per_layer = s.tel.per_layer("decode")
        assert sum(r["hits"] + r["late"] + r["misses"] for r in per_layer) == sum(r["routed"] for r in per_layer)
        if preset == "on_demand":
            assert res["late_rate"] == 0.0                    # nothing prefetched, nothing late


def test_two_packs_of_one_model_at_the_same_slots_agree_on_hit_plus_late():
    """An expert's size moves how many prefetches are still in flight when asked for (late), and barely which experts
    are in memory or on their way: hit + late is the same on a q3 and a q8 pack at the same slots and routing, but
    for an expert or two in a hundred. (Not exactly: a wasted prefetch is demoted to be the first to go, and while
    its read is still in flight the cache evicts the next one instead, so which one goes depends on the read's
    timing.)"""
    got = {}
    for experts in ("q3", "q8"):
        with open_session("demo", "les", budget="0.25", tokens=24, drive=drive(TRACE), experts=experts) as s:
            res = measure(s, [1, 2, 3, 4], 24)
            got[experts] = (min(s.cache.capacity.values()), res["hits"] + res["late"], res["misses"])
    (slots3, served3, missed3), (slots8, served8, missed8) = got["q3"], got["q8"]
    assert slots3 == slots8 and served3 + missed3 == served8 + missed8
    assert abs(served3 - served8) <= 0.01 * (served3 + missed3), got


def test_a_misses_time_splits_into_parts_that_add_up():
    """Flash wait is queue + device + completion of the read each wait ended on, other is submit + hand-off +
    Python, and each demand read's latency is submit + queue + device + landed: the parts add up, in every token."""
    with open_session("demo", "on_demand", budget="0.1", tokens=12, drive=drive(TRACE)) as s:
        res = measure(s, [1, 2, 3, 4], 12)
        dec = [t for t in s.tel.tokens if t.phase == "decode"]
        for t in dec:
            assert t.queue_s + t.device_s + t.completion_s == pytest.approx(t.flash_wait_s, abs=1e-9)
            assert t.submit_s + t.handoff_s + t.python_s == pytest.approx(t.other_s, abs=1e-9)
            assert min(t.queue_s, t.device_s, t.completion_s, t.submit_s, t.handoff_s, t.python_s) >= 0
        assert res["device_s"] > 0 and res["submit_s"] > 0 and res["handoff_s"] > 0     # on_demand reads every miss
        assert res["demand_reads_taken"] > 0 and res["read_device_s"] > 0 and res["read_submit_s"] > 0


def test_a_wait_is_split_by_where_the_read_it_ended_on_was():
    from types import SimpleNamespace as NS
    from workbench.telemetry import LayerEvent
    ev = LayerEvent(0, 0, "decode", [], [], [])
    read = NS(t_start=int(1.2e9), t_end=int(1.5e9))                 # queued until 1.2 s, read until 1.5 s
    ev.split_wait(1.0, 1.6, [read], every=False)
    assert (ev.queue_s, ev.device_s, ev.completion_s) == pytest.approx((0.2, 0.3, 0.1))
    early = NS(t_start=int(0.5e9), t_end=int(0.9e9))                # landed before the wait began: all completion
    ev.split_wait(2.0, 2.1, [early, NS(t_start=int(2.0e9), t_end=int(2.05e9))], every=True)
    assert (ev.queue_s, ev.device_s, ev.completion_s) == pytest.approx((0.2, 0.35, 0.15))
