"""The expert cache never holds more than its budget, counted in bytes."""
from __future__ import annotations

import numpy as np
import pytest

from workbench.cache import ExpertCache
from workbench.presets import Budget
from runtime.session import open_session
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
    with open_session(str(model), preset, budget="0.3", cache_scope=scope) as s:
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
    assert Budget("1.000000").nbytes(617, 2) == 1234 and Budget("1.000000").all     # a fraction, not one byte
    with pytest.raises(WorkbenchError, match="--budget"):
        Budget("lots")


def test_budget_below_one_layers_top_k_is_refused(tiny_models):
    with pytest.raises(WorkbenchError, match="below one layer's top-k"):
        open_session(str(tiny_models["qwen3_moe"]), "on_demand", budget="1KiB")


def test_pinned_and_protected_experts_are_not_evicted():
    c = ExpertCache(slots=3, item_bytes=100, layers=[0])
    assert c.pin((0, 1), {"w": 1})
    assert c.reserve((0, 2), {"w": 2})
    assert c.reserve((0, 3), {"w": 3})
    assert not c.reserve((0, 4), {"w": 4}, protect={(0, 2), (0, 3)})   # everything is pinned or protected
    assert c.reserve((0, 4), {"w": 4}, protect={(0, 3)})               # evicts 2, the unprotected LRU
    assert set(c.keys()) == {(0, 1), (0, 3), (0, 4)} and c.bytes == 300


def test_a_guess_never_evicts_what_the_last_token_used():
    """A prefetch that guesses (spare: one token of layer steps, 2 here) finds no slot while the expert that would
    go was used within the last token; once a token has passed since its use it may go, and a demand read takes
    the LRU slot whatever its age."""
    c = ExpertCache(slots=2, item_bytes=100, layers=[0, 1])
    c.step()
    c.reserve((0, 1), "a")                          # token 0, layer 0 uses 1 (step 1)
    c.step()
    c.reserve((1, 2), "b")                          # token 0, layer 1 uses 2 (step 2)
    c.step()
    c.get((0, 1))                                   # token 1, layer 0 uses 1 again (step 3), and guesses layer 1
    assert not c.reserve((1, 5), "guess", spare=2)  # the LRU, (1, 2), was used a step ago
    assert set(c.keys()) == {(0, 1), (1, 2)}
    c.step()                                        # token 1, layer 1 (step 4): (1, 2) was used a token ago
    assert c.reserve((1, 5), "guess", spare=2) and (1, 2) not in c
    assert not c.reserve((1, 6), "guess", spare=2)  # the LRU now, (0, 1), was used a step ago
    assert c.reserve((1, 6), "demand")
    assert set(c.keys()) == {(1, 5), (1, 6)}


def test_guesses_are_made_while_mostly_right_and_evict_recent_experts_while_righter_than_the_cache():
    from workbench.cache import GuessAdmission
    wrong = GuessAdmission(window=8)                # a predictor naming 8 experts a layer, 3 of them used
    for _ in range(20):
        wrong.scored(range(8), [0, 1, 2, 20])
    assert not wrong.admit()                        # more reads wasted than moved earlier: no guesses
    kept = GuessAdmission(window=8)                 # 6 of 8 right, and the cache finds almost all it kept again
    for _ in range(20):
        kept.scored(range(8), [0, 1, 2, 3, 4, 5, 20, 21])
        for _ in range(10):
            kept.asked_for(in_memory=True, guessed=False)
    assert kept.admit() and kept.spare() == 8       # guess, but never into the slot of the last token's experts
    thrash = GuessAdmission(window=8)               # 6 of 8 right, and the cache finds nothing again
    for _ in range(20):
        thrash.scored(range(8), [0, 1, 2, 3, 4, 5, 20, 21])
        thrash.asked_for(in_memory=False, guessed=False)
        thrash.asked_for(in_memory=True, guessed=True)      # a guess found: not the cache's own reuse
    assert thrash.admit() and thrash.spare() == 0


def test_a_guess_is_made_only_at_the_places_of_a_prediction_that_are_right_often_enough_to_pay():
    """A place in the order (best first) is admitted while its precision is over (1 + q) / (2 + q), q the rate at
    which the cache's experts are asked for again: 1/2 while it thrashes, up to 2/3 while it keeps everything."""
    from workbench.cache import GuessAdmission
    for found, admitted in ((False, [10, 11, 12]), (True, [10, 11])):
        g = GuessAdmission(window=8)
        for _ in range(40):                     # places 0, 1 always right, place 2 right 3 times in 5, place 3 never
            for t in range(5):
                g.scored([10, 11, 12 if t < 3 else 99, 98], [10, 11, 12])
                g.asked_for(in_memory=found, guessed=False)
        assert g.admitted([10, 11, 12, 13]) == admitted     # 3/5 pays where the cache thrashes (q 0), not where it keeps (q 1)
        assert g.admit()                                    # the predictor as a whole is right more often than not


def test_a_prefetch_its_layer_did_not_ask_for_goes_first():
    c = ExpertCache(slots=3, item_bytes=100, layers=[0])
    for e in (1, 2, 3):
        c.reserve((0, e), e)
    c.demote((0, 3))                        # read ahead for this layer, not asked for: it goes, not the LRU (0, 1)
    assert c.reserve((0, 4), 4) and set(c.keys()) == {(0, 1), (0, 2), (0, 4)}
