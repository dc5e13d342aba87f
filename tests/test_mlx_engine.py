"""The MLX engine (engines/mlx_engine.py) agrees with the numpy reference engine.

Tolerance: logits agree within ATOL = 2e-5 absolute (the tiny models' logits are below ~4 in magnitude;
observed differences are ~2e-6). MLX runs in float32; the numpy engine's residual stream is float64
(NumPy 2 promotes `att * (1.0 / np.sqrt(hd))`), so the two agree to float32 rounding, not bit for bit.
The routing and the telemetry (LayerEvents: routed, predicted, and hits where they do not depend on
read timing) must be identical.

Covered: every family (tiny_models), exact (all resident) and staged paths (a budget below all-resident,
so experts stream through the slots, in waves at prefill), prefill then decode; expert precisions
q2/q3/q4/q8/bf16 and a model whose parts mix q4 and bf16; the hooks (router_hook, predictors, deltas),
speculative verification (drafts by prompt lookup, the demo's draft model and its MTP head), `--engine mlx` on the
CLI; greedy output on the demo model.
On Linux MLX runs on the CPU (mlx[cpu]), where it is slow: the models here are tiny.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

if os.environ.get("WORKBENCH_REQUIRE_MLX"):     # CI (.ci/run) installs it: there a failed import is an error
    import mlx.core as mx  # noqa: F401
else:
    mx = pytest.importorskip("mlx.core", reason="MLX is not importable here: pip install -e '.[mlx]' "
                                                "(mlx on macOS, mlx[cpu] on Linux)")

from conftest import FAMILIES, TINY  # noqa: E402
from engines.mlx_engine import Slot  # noqa: E402
from runtime.session import open_session  # noqa: E402

TOKENS = [3, 17, 42, 99, 7, 200, 31, 5, 128, 64, 250, 1, 77, 13]
SPLIT = 9          # prefill TOKENS[:SPLIT], then decode one token at a time
ATOL = 2e-5

# One pack per model and precision (conversions are most of the time): every path below reads contiguous q4
# unless it says otherwise.
EXACT = ("resident", {})                                       # every expert resident
STAGED = ("on_demand", dict(budget="0.3", layout="contiguous"))  # a global pool of 4 slots for 16 experts: waves
LES = ("les", dict(experts="q4"))                              # ready_first + lookahead prefetch at a 0.25 budget
PER_LAYER = ("smol", {})                                       # per-layer pools, warm, prefetch 2 layers ahead


def run(path, preset, engine, deltas=None, **kw):
    """Prefill then decode TOKENS; returns (logits, events, session). The session is closed."""
    with open_session(str(path), preset, engine=engine, deltas=deltas, **kw) as s:
        s.engine.reset()
        rows = [s.step(TOKENS[:SPLIT], "prefill")]
        for i, t in enumerate(TOKENS[SPLIT:]):
            rows.append(s.step([t], "decode"))
        return np.concatenate(rows), s.tel.events, s


def same_events(a, b, hits: bool):
    key = (lambda e: (e.token, e.layer, e.phase, e.routed, e.predicted, e.hit)) if hits else \
          (lambda e: (e.token, e.layer, e.phase, e.routed, e.predicted))
    assert [key(e) for e in a] == [key(e) for e in b]


def agree(path, preset, kw, hits=True, **extra):
    ref, ref_ev, _ = run(path, preset, "numpy", **kw, **extra)
    out, ev, s = run(path, preset, "mlx", **kw, **extra)
    assert out.shape == ref.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0, err_msg=f"{preset} {kw}")
    same_events(ev, ref_ev, hits)
    return s


def check_slots(s):
    """The slots never hold more experts than the budget; every cached expert in memory sits in its slot."""
    eng = s.engine
    stacks = {id(st): st for st in eng.experts.stacks.values()}.values()
    assert sum(st.n for st in stacks) * s.cache.item_bytes <= s.budget_bytes
    for key in s.cache.keys():
        v = s.cache.peek(key)
        if isinstance(v, Slot):
            assert eng.experts.stacks[key[0]].keys[v.index] == key


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_numpy_exact_and_staged(tiny_models, family):
    path = tiny_models[family]
    agree(path, *EXACT)
    s = agree(path, *STAGED)
    total = s.pack.num_expert_total
    assert max(st.n for st in s.engine.experts.stacks.values()) < total, "the staged path kept every expert resident"
    assert s.summary()["misses"] > 0 and s.cache.evictions > 0
    assert s.engine.experts.wave_flushes > 0, "the prefill did not stream in waves"
    check_slots(s)
    agree(path, *LES, hits=False)          # hits of a prefetching path depend on read timing


@pytest.mark.parametrize("experts,rest,layout", [("q2", "q4", "contiguous"), ("q3", "q4", "native"),
                                                 ("q8", "q8", "contiguous"), ("bf16", "bf16", "native")])
def test_every_expert_precision_matches_numpy(tiny_models, experts, rest, layout):
    path = tiny_models["qwen3_moe"]          # q4 is every family's default above
    store = dict(experts=experts, rest=rest, layout=layout)
    agree(path, "resident", store)
    s = agree(path, "on_demand", dict(budget="0.3", **store))
    assert s.engine.experts.wave_flushes > 0
    check_slots(s)
    s = agree(path, *PER_LAYER, hits=False, **store)
    assert len({id(st) for st in s.engine.experts.stacks.values()}) == len(s.spec.moe_layers)   # one stack per layer
    check_slots(s)


def test_parts_of_mixed_kinds(tmp_path):
    """moe_intermediate_size 96: gate and up (96, 64) are q4, down (64, 96) falls back to bf16."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                            intermediate_size=128, norm_topk_prob=True)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path / "mixed", safe_serialization=True)
    s = agree(tmp_path / "mixed", *STAGED)
    assert s.pack.expert_kinds == {"gate": "q4", "up": "q4", "down": "bf16"}


def test_hooks_deltas_and_cache_bias(tiny_models):
    """A projection delta (an unmerged adapter) and a router hook (cache-aware bias) act the same in both."""
    path = tiny_models["qwen2_moe"]
    rng = np.random.default_rng(0)
    d, r = TINY["hidden_size"], 4
    deltas = {}
    for L in range(TINY["num_hidden_layers"]):
        for proj, out in (("q", 64), ("k", 32), ("v", 32), ("o", d)):
            A, B = rng.normal(0, 0.2, (r, 64)).astype(np.float32), rng.normal(0, 0.2, (out, r)).astype(np.float32)
            deltas[f"layers.{L}.{proj}"] = lambda x, A=A, B=B: (x @ A.T) @ B.T
    plain, _, _ = run(path, STAGED[0], "mlx", **STAGED[1])
    agree(path, *STAGED, deltas=deltas)
    with_delta, _, _ = run(path, STAGED[0], "mlx", deltas=deltas, **STAGED[1])
    assert np.abs(with_delta - plain).max() > 1e-3          # the delta did change the model
    # cache-aware routing reads the cache: without prefetches (whose landing time varies) it is deterministic
    agree(path, "smol_bias", dict(budget="0.5", experts="q4", predictor=None, execution="wait_all"))


def test_speculative_verification_and_generate(tiny_models):
    path = tiny_models["qwen3_moe"]
    outs = {}
    for engine in ("numpy", "mlx"):
        with open_session(str(path), "les", engine=engine, speculative=4, experts="q4") as s:
            outs[engine] = s.generate([5, 9, 33, 71, 2, 18, 5, 9, 33], tokens=16)["tokens"]
            assert s.tel.spec_steps > 0
    assert outs["mlx"] == outs["numpy"]


@pytest.mark.parametrize("draft", ["demo-draft", "mtp"])
def test_a_draft_model_and_the_mtp_head_give_plain_greedy_output_on_mlx(draft):
    outs = {}
    for knobs in ({}, {"speculative": 2, "draft": draft}):
        with open_session("demo", "les", "0.25", engine="mlx", tokens=10, **knobs) as s:
            outs[bool(knobs)] = s.generate("Once upon a time", tokens=10)["tokens"]
            assert (s.tel.spec_steps > 0) == bool(knobs)
    assert outs[True] == outs[False]


def test_cli_generate_with_engine_mlx(tiny_models, capsys):
    from cli import main
    got = {}
    for engine in ("numpy", "mlx"):
        assert main(["generate", "--model", str(tiny_models["olmoe"]), "--prompt", "Once upon", "--tokens", "5",
                     "--engine", engine, "--budget", "0.5", "--json"]) == 0
        got[engine] = json.loads(capsys.readouterr().out)
    assert got["mlx"]["tokens"] == got["numpy"]["tokens"] and len(got["mlx"]["tokens"]) == 5
    assert main(["generate", "--model", str(tiny_models["olmoe"]), "--engine", "tpu", "--json"]) == 2
    err = capsys.readouterr().err
    assert "--engine 'tpu'" in err and "mlx" in err


def test_facade_lists_mlx_where_it_imports():
    import engines
    assert "mlx" in engines.available() and "mlx" in engines.ENGINES


@pytest.mark.slow
def test_demo_greedy_output_is_the_numpy_engines():
    """The demo model (8 layers, 32 experts): the same greedy tokens for exact presets, resident and streaming."""
    for preset, kw in [("resident", {}), ("les", dict(budget="0.25", experts="q4"))]:   # one q4 pack
        toks = {}
        for engine in ("numpy", "mlx"):
            with open_session("demo", preset, engine=engine, **kw) as s:
                toks[engine] = s.generate("Once upon a time", tokens=8)["tokens"]
        assert toks["mlx"] == toks["numpy"], preset


def test_refuses_experts_it_cannot_compute(tiny_models):
    """A raw GGUF pack's block formats (gguf:Q4_K, ...) are not MLX's affine format: a clear error, not garbage."""
    from engines.mlx_engine import MlxEngine
    from workbench.errors import WorkbenchError
    with open_session(str(tiny_models["mixtral"]), "resident", budget="0.5") as s:
        s.pack.expert_kinds = {p: "gguf:Q4_K" for p in ("gate", "up", "down")}
        with pytest.raises(WorkbenchError, match="--engine mlx computes experts stored as"):
            MlxEngine(s.pack, s.streamer, s.tel)
