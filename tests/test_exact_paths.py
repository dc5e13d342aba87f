"""Exact routing is lossless: every budget, layout, precision, cache and execution path gives the same
logits (so the same greedy tokens) as every expert resident on the same pack."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.session import open_session
from workbench.registry import block_experts
from workbench.store import ggml_blocks

PROMPT = [5, 9, 33, 71, 2, 18]


def decode(path, preset, n=12, **kw):
    with open_session(str(path), preset, **kw) as s:
        s.engine.reset()
        logits = [s.step(PROMPT, "prefill")[-1]]
        toks = []
        for i in range(n):
            toks.append(int(np.argmax(logits[-1])))
            logits.append(s.step([toks[-1]], "decode")[-1])
        return toks, np.stack(logits), s.summary()


STORAGE = [("contiguous", "q4", "q4"), ("native", "q4", "q4"), ("contiguous", "q3", "q4"),
           ("contiguous", "q2", "q4"), ("native", "bf16", "bf16")] + \
          ([("contiguous", "g4", "q4"), ("native", "g3", "q4")] if ggml_blocks.available() else [])   # ggml's blocks
PATHS = [dict(budget="0.25"), dict(budget="0.5", execution="ready_first"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:1:2k"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:2:k", cache_scope="per_layer"),
         dict(budget="0.25", execution="ready_first", predictor="history", cache_policy="lfu")]


@pytest.mark.parametrize("layout,experts,rest", STORAGE)
def test_every_path_equals_resident(tiny_models, layout, experts, rest):
    model = tiny_models["qwen3_moe"]
    store = dict(layout=layout, experts=experts, rest=rest)
    ref_toks, ref_logits, _ = decode(model, "resident", **store)
    for path in PATHS:
        toks, logits, summary = decode(model, "on_demand", **store, **path)
        assert toks == ref_toks, path
        np.testing.assert_array_equal(logits, ref_logits, err_msg=str(path))
        assert summary["misses"] > 0, "the path streamed nothing: the comparison would be empty"


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "mixtral", "dots1"])
def test_streaming_equals_resident_for_each_family(tiny_models, family):
    ref_toks, ref_logits, _ = decode(tiny_models[family], "resident")
    toks, logits, _ = decode(tiny_models[family], "les")
    _, les_resident, _ = decode(tiny_models[family], "resident", experts=block_experts("q3"))
    np.testing.assert_array_equal(logits, les_resident)      # les stores 3-bit experts: compare on its own pack
    toks, logits, _ = decode(tiny_models[family], "on_demand", budget="0.25")
    np.testing.assert_array_equal(logits, ref_logits)


def generate(model, preset, n=24, **kw):
    with open_session(str(model), preset, **kw) as s:
        out = s.generate([5, 9, 33, 71, 2, 18, 5, 9, 33], tokens=n)
        return out["tokens"], s.summary()


def test_speculative_verification_gives_plain_greedy_output(tiny_models):
    model = tiny_models["qwen3_moe"]
    plain, _ = generate(model, "les")
    spec, summary = generate(model, "les", speculative=4)
    assert spec == plain
    assert summary["spec_accept_rate"] is not None and summary["tokens_per_target_step"] >= 1.0


def test_prompt_lookup_draft_by_hand():
    from runtime.speculative import PromptLookup
    assert PromptLookup().propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert PromptLookup().propose([1, 2, 3, 4, 5], 3) == []
    assert PromptLookup().propose([7, 8, 7], 2) == [8, 7]
