"""Presets are typed: every preset and every ladder rung builds, its flat form (run records) round-trips,
and a combination that cannot work is refused when it is built, with a one-line error naming the knob."""
from __future__ import annotations

import pytest

from experiments.edge0_ladder import edge0_rungs
from experiments.ladder import cache_rungs, les_rungs, smol_rungs
from workbench.errors import WorkbenchError
from workbench.presets import PRESETS, Budget, Predictor, Prefetch, Router, Routing, get_preset


def rungs():
    return ([*PRESETS.values()] + les_rungs() + smol_rungs() + [p for p, _ in cache_rungs(2, 1000)]
            + edge0_rungs() + edge0_rungs(skip_layers=2))


def test_every_preset_and_rung_round_trips_through_its_flat_form():
    for p in rungs():
        flat = p.to_dict()
        assert get_preset("on_demand").with_(**flat) == p, p.name
        assert all(isinstance(v, (str, bool, int, float, type(None))) for v in flat.values())


def test_strings_parse_into_typed_knobs():
    assert Prefetch.parse("lookahead:2:2k") == Prefetch(Predictor.LOOKAHEAD, depth=2, width=2)
    assert Prefetch.parse("prerouter:3") == Prefetch(Predictor.PREROUTER, skip_layers=3)
    assert Prefetch.parse(None) == Prefetch()
    assert Routing.parse("cache_bias:0.05") == Routing(Router.CACHE_BIAS, beta=0.05)
    assert Routing.parse("prerouter:nolora") == Routing(Router.PREROUTER, lora=False)
    smol = get_preset("smol")
    assert (smol.storage.experts, smol.cache.scope.value, smol.prefetch.depth) == ("q2", "per_layer", 2)
    assert Budget("0.25").nbytes(8, 100) == 200 and Budget("1KiB").nbytes(8, 100) == 1024
    assert Budget("all").nbytes(8, 100) == 800 and Budget("all").all and not Budget("0.5").all


@pytest.mark.parametrize("knobs,message", [
    (dict(routing="prerouter"), "needs predictor prerouter"),                  # the prediction is the routing
    (dict(routing="prerouter", predictor="lookahead:1:k"), "needs predictor prerouter"),
    (dict(routing="prerouter", predictor="prerouter", speculative=2), "one token per step"),
    (dict(predictor="lookahead:0:k"), "depth must be >= 1"),
    (dict(predictor="lookahead:1:3k"), "predictor 'lookahead:1:3k'"),
    (dict(predictor="sometimes"), "predictor 'sometimes'"),
    (dict(routing="cache_bias:much"), "routing 'cache_bias:much'"),
    (dict(execution="eventually"), "execution 'eventually'"),
    (dict(cache_scope="per_token"), "cache_scope 'per_token'"),
    (dict(experts="q5"), "experts 'q5'"),
    (dict(budget="lots"), "--budget 'lots'"),
    (dict(colour="blue"), "'colour': not a preset knob"),
])
def test_impossible_combinations_are_refused_when_built(knobs, message):
    with pytest.raises(WorkbenchError, match=message) as e:
        get_preset("on_demand").with_(**knobs)
    assert "\n" not in str(e.value)
