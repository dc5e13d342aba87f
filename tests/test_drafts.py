"""Drafts verified in one batch (runtime.speculative): whatever drafts, greedy output is plain greedy decoding's, and
the run record says what the drafts cost (their own time, the batch's union of experts) and what they saved."""
from __future__ import annotations

import json
import shutil

import pytest

from test_bad_input import assert_one_line_error, cli
from test_budget_agree import engine_or_skip
from runtime.session import open_session
from workbench.registry import MODELS, model_dir

PROMPT = "Once upon a time, there was a little girl named Lily."


def greedy(engine: str, tokens: int = 32, **knobs) -> tuple[list[int], dict]:
    with open_session("demo", "les", "0.25", engine=engine, tokens=tokens, **knobs) as s:
        out = s.generate(PROMPT, tokens)
        return out["tokens"], s.summary()


@pytest.mark.parametrize("engine", ["packed", "numpy", "mlx"])      # every engine that batches a verification
@pytest.mark.parametrize("draft", ["demo-draft", "lookup"])
def test_greedy_output_is_the_same_with_and_without_drafts(engine, draft):
    plain, _ = greedy(engine_or_skip(engine))
    drafted, s = greedy(engine, speculative=4, draft=draft)
    assert drafted == plain
    assert s["draft"] == draft and s["spec_steps"] < len(plain) - 1        # some drafts were accepted
    assert s["tokens_per_target_step"] == (s["spec_accepted"] + s["spec_steps"]) / s["spec_steps"]


def test_the_draft_models_time_is_in_the_steps_wall_time_and_its_own_part_of_the_split():
    _, s = greedy("packed", speculative=4, draft="demo-draft")
    assert s["draft_s"] > 0
    parts = sum(s[k] for k in ("flash_wait_s", "compute_s", "router_s", "dequant_s", "other_s", "draft_s"))
    assert parts == pytest.approx(s["decode_s"], rel=1e-6)
    _, lookup = greedy("packed", speculative=4)
    assert lookup["draft_s"] < s["draft_s"]


def test_a_draft_that_is_the_target_is_accepted_and_the_batch_routes_to_more_experts_than_one_token():
    """The demo drafting for itself agrees with its own greedy choice nearly always; verifying 4 drafts a step, each
    layer's batch routes to the union of 5 tokens' experts, more than its first token's top-4 alone."""
    _, s = greedy("packed", speculative=4, draft="demo")
    assert s["spec_accept_rate"] > 0.8
    assert 1.5 < s["union_growth"] <= 5.0
    _, plain = greedy("packed")
    assert "union_growth" not in plain and plain["draft_s"] == 0


def test_forced_text_accepts_a_draft_token_only_where_it_is_the_text():
    with open_session("demo", "les", "0.25", tokens=24, speculative=4, draft="demo-draft", text="tinystories") as s:
        out = s.generate_text(None, 24)
        assert out["tokens"] == list(s.text.forced[:24])


def changed_tokenizer(tmp_path):
    """The draft model with two of its tokenizer's token ids swapped: the same size, another vocabulary."""
    dst = tmp_path / "other-draft"
    shutil.copytree(MODELS["demo-draft"], dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "the", "and"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_line(tiny_models, tmp_path):
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "4", "--no-record", "--set", "speculative=2",
              "--set", f"draft={tiny_models['qwen3_moe']}")
    assert_one_line_error(res, str(tiny_models["qwen3_moe"]), "vocabulary has", "tokens, the target's")
    other = changed_tokenizer(tmp_path)
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "4", "--no-record", "--set", "speculative=2",
              "--set", f"draft={other}")
    assert_one_line_error(res, str(other), "tokenizer is not the target's", "2 of 4096 tokens differ")


def test_a_draft_model_that_does_not_exist_is_refused_in_one_line():
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "4", "--no-record", "--set", "speculative=2",
              "--set", "draft=no/such/model")
    assert_one_line_error(res, "no/such/model", "no such model")


def test_a_modelled_acceptance_drafts_the_forced_texts_next_tokens_and_keeps_the_text():
    """modelled:A on forced text: the draft is the text's next tokens, accepted as seeded coin flips; the output is the
    text whatever was accepted, and two runs draw the same acceptances."""
    runs = []
    for _ in range(2):
        with open_session("demo", "les", "0.25", tokens=24, speculative=4, draft="modelled:0.7",
                          text="tinystories") as s:
            out = s.generate_text(None, 24)
            assert out["tokens"] == list(s.text.forced[:24])
            runs.append(s.summary())
    assert runs[0]["modelled_acceptance"] == 0.7 and runs[0]["spec_steps"] < 23
    assert [r["spec_accepted"] for r in runs] == [runs[0]["spec_accepted"]] * 2


def test_a_modelled_acceptance_on_the_models_own_tokens_is_refused_in_one_line():
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "4", "--no-record", "--set", "speculative=2",
              "--set", "draft=modelled:0.5")
    assert_one_line_error(res, "draft=modelled:0.5", "routing trace's or forced text's tokens")
    res = cli("bench", "--model", "demo", "--preset", "les", "--tokens", "4", "--no-record", "--set", "speculative=2",
              "--set", "draft=modelled:1.5", "--text", "tinystories")
    assert_one_line_error(res, "modelled acceptance A in (0, 1]")


def test_a_drafts_memory_is_in_the_plan_beside_the_targets():
    """The memory plan (what the guard refuses by and `info` says) holds the draft model beside the target: its own
    all-resident plan's bytes, counted with the weights; the MTP block its float32 tensors; prompt lookup nothing."""
    from runtime.plan import plan
    plain = plan("demo", "les", "0.25").memory
    drafted = plan("demo", "les", "0.25", speculative=4, draft="demo-draft").memory
    own = plan("demo-draft", "resident").memory["needed_bytes"]
    assert drafted["draft_bytes"] == own > 0
    assert drafted["needed_bytes"] == plain["needed_bytes"] + own
    assert drafted["resident_bytes"] == plain["resident_bytes"] + own
    assert plan("demo", "les", "0.25", speculative=4, draft="lookup").memory["draft_bytes"] == 0
    mtp = plan("demo", "les", "0.25", speculative=4, draft="mtp").memory
    from workbench.models.mtp import load_mtp
    assert mtp["draft_bytes"] == sum(a.nbytes for a in load_mtp(model_dir("demo")).values()) > 0
    assert mtp["needed_bytes"] == plain["needed_bytes"] + mtp["draft_bytes"]
