"""The slot arena gives each expert the cache holds a slot of its own, and an evicted expert's slot to the next."""
from __future__ import annotations

import pytest

from runtime.session import open_session


@pytest.mark.parametrize("knobs", [dict(), dict(execution="ready_first", predictor="lookahead:1:2k"),
                                   dict(execution="ready_first", predictor="history", cache_scope="per_layer")])
def test_slots_are_the_cached_experts(tiny_models, knobs):
    with open_session(str(tiny_models["qwen3_moe"]), "on_demand", budget="0.25", engine="packed", **knobs) as s:
        s.generate([1, 2, 3, 4], tokens=8)
        assert s.cache.evictions > 0, "nothing was evicted: no slot was reused"
        where = s.arena.where
        assert set(where) == set(s.cache.keys())
        slots = {(id(s.arena.blocks[k[0]]), off) for k, off in where.items()}
        assert len(slots) == len(where), "two cached experts share a slot"
        free = sum(len(f) for f in s.arena._free.values())
        assert free + len(where) == s.arena.nbytes // s.arena.slot_bytes


def test_a_layers_demand_reads_are_queued_before_its_predictors_prefetches(tiny_models):
    with open_session(str(tiny_models["qwen3_moe"]), "on_demand", budget="0.25", engine="packed", execution="ready_first",
                 predictor="lookahead:1:2k") as s:
        log, submit, begin_layer = [], s.reader.submit_parts, s.streamer.begin_layer

        def logged_submit(keys, parts, checks, crcs, priority=0, owner=None):
            log.append(priority)
            return submit(keys, parts, checks, crcs, priority, owner)

        def logged_begin_layer(*a):
            log.append("layer")
            return begin_layer(*a)

        s.reader.submit_parts, s.streamer.begin_layer = logged_submit, logged_begin_layer
        s.generate([1, 2, 3, 4], tokens=8)
    layers = "".join(str(x)[0] for x in log).split("l")     # per layer: the priorities of its submits, in order
    assert any("0" in x and "1" in x for x in layers), "no layer both demanded and prefetched: nothing was checked"
    assert all("10" not in x for x in layers), layers
