"""The expert cache never holds more than its budget, counted in bytes."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.cache import ExpertCache
from workbench.presets import Budget
from workbench.session import Session
from workbench.errors import WorkbenchError


def held_bytes(cache: ExpertCache) -> int:
    """Bytes of the expert arrays actually held (a slot in flight counts as a full expert)."""
    total = 0
    for key in cache.keys():
        v = cache.peek(key)
        v = v.result() if hasattr(v, "result") and v.done() else v
        total += sum(a.nbytes for a in v.values()) if isinstance(v, dict) else cache.item_bytes
    return total


@pytest.mark.parametrize("preset,scope", [("on_demand", "global"), ("les", "global"), ("smol", "per_layer")])
def test_long_decode_at_a_small_budget_never_exceeds_it(tiny_models, preset, scope):
    model = tiny_models["qwen3_moe"]
    with Session(str(model), preset, budget="0.3", cache_scope=scope) as s:
        s.engine.reset()
        worst = 0
        logits = s.step(list(range(1, 40)), "prefill")         # a prefill needing more experts than fit
        for i in range(60):
            logits = s.step([int(np.argmax(logits[-1]))], "decode")
            worst = max(worst, held_bytes(s.cache))
            assert s.cache.bytes == len(s.cache.keys()) * s.cache.item_bytes   # its running count is what it holds
        assert worst <= s.budget_bytes
        assert s.cache.peak_bytes <= s.budget_bytes
        assert s.summary()["misses"] > 0 and s.cache.evictions > 0   # the budget was under pressure


def test_budget_parsing():
    assert Budget("0.25").nbytes(100, 10) == 250
    assert Budget("96MiB").nbytes(1, 1) == 96 * 2**20
    assert Budget("all").nbytes(617, 2) == 1234
    with pytest.raises(WorkbenchError, match="--budget"):
        Budget("lots")


def test_budget_below_one_layers_top_k_is_refused(tiny_models):
    with pytest.raises(WorkbenchError, match="below one layer's top-k"):
        Session(str(tiny_models["qwen3_moe"]), "on_demand", budget="1KiB")


def test_pinned_and_protected_experts_are_not_evicted():
    c = ExpertCache(budget_bytes=300, item_bytes=100, layers=[0])
    assert c.pin((0, 1), {"w": 1})
    assert c.reserve((0, 2), {"w": 2})
    assert c.reserve((0, 3), {"w": 3})
    assert not c.reserve((0, 4), {"w": 4}, protect={(0, 2), (0, 3)})   # everything is pinned or protected
    assert c.reserve((0, 4), {"w": 4}, protect={(0, 3)})               # evicts 2, the unprotected LRU
    assert set(c.keys()) == {(0, 1), (0, 3), (0, 4)} and c.bytes == 300
