"""The TinyStories tasks (evals/story_tasks.py, evals/tasks/tinystories_*.yaml): built deterministically from the
shipped held-out text, never from the training text, and run through lm-eval on the tiny model."""
import json
import re

import pytest

from eval_tiny import REPO, use_tiny
from evals import story_tasks as st

SHIPPED = REPO / "data" / "benchmarks"
FILES = ("tinystories_ending/ending.jsonl", "tinystories_ending/ending_mcq.jsonl", "tinystories_ending/SOURCE.txt",
         "tinystories_cloze/cloze.jsonl", "tinystories_cloze/SOURCE.txt")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    counts = st.build(dst=a)
    assert st.build(dst=b) == counts
    return a, b, counts


def rows(root, rel):
    return [json.loads(l) for l in (root / rel).read_text(encoding="utf-8").splitlines()]


def test_build_is_deterministic_and_is_what_the_repository_ships(built):
    a, b, counts = built
    for f in FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes() == (SHIPPED / f).read_bytes(), f
    assert counts["tinystories_ending"] >= 500 and counts["tinystories_cloze"] >= 200


def test_another_seed_draws_other_distractors(tmp_path, built):
    st.build(dst=tmp_path, seed=7)
    assert (tmp_path / FILES[0]).read_bytes() != (built[0] / FILES[0]).read_bytes()


def test_ending_items_are_their_story_and_three_other_endings(built):
    stories = st.stories(st.SRC.joinpath(st.HELDOUT).read_text(encoding="utf-8"))
    items = rows(built[0], FILES[0])
    answers = {r["choices"][r["label"]] for r in items}
    labels = [r["label"] for r in items]
    for r in items:
        story = stories[int(r["id"].split("-")[1])]
        assert r["context"] + r["choices"][r["label"]] == story           # context + true ending: the story itself
        assert len(set(r["choices"])) == 4
        for i, c in enumerate(r["choices"]):
            assert c in answers                                            # every option ends some story
            if i != r["label"]:
                assert not st.content_words(c) & st.content_words(r["context"]), (r["id"], c)
    assert all(labels.count(k) > len(items) / 6 for k in range(4))        # the answer's place is drawn evenly
    mcq = rows(built[0], FILES[1])
    assert [(m["context"], [m[k] for k in "ABCD"], "ABCD".index(m["answer"])) for m in mcq] == \
        [(r["context"], r["choices"], r["label"]) for r in items]


def test_cloze_items_end_on_a_content_word_the_story_used_before(built):
    stories = st.stories(st.SRC.joinpath(st.HELDOUT).read_text(encoding="utf-8"))
    for r in rows(built[0], FILES[3]):
        w = r["target"]
        assert w.lower() not in st.STOPWORDS and len(w) >= 3 and w.isalpha()
        assert re.search(rf"\b{w}\b", r["context"], re.IGNORECASE)
        story = stories[int(r["id"].split("-")[1])]
        assert story.startswith(r["context"] + " " + w) and not re.search(r"\w", story[len(r["context"]) + 1 + len(w):])


def test_no_item_comes_from_the_training_text(built):
    train = st.SRC.joinpath(st.TRAIN).read_text(encoding="utf-8")
    for r in rows(built[0], FILES[0]):
        assert r["context"][:200] not in train and r["choices"][r["label"]] not in train
    for r in rows(built[0], FILES[3]):
        assert r["context"][:200] not in train


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """The tiny model behind lm-eval, recording the loglikelihood requests lm-eval makes."""
    from evals.lm_eval_adapter import WorkbenchLM
    from runtime.session import open_session
    tiny = use_tiny(monkeypatch, tmp_path)
    seen = []

    class Recording(WorkbenchLM):
        def loglikelihood(self, requests, disable_tqdm=False):
            seen.extend(r.args for r in requests)
            return super().loglikelihood(requests, disable_tqdm)

    with open_session(tiny, "resident", direct=False) as s:
        yield Recording(session=s, progress=False), seen


def test_story_tasks_run_through_lm_eval_and_score_the_story_text(recorded):
    from evals.lm import evaluate
    lm, seen = recorded
    res = evaluate(lm, "tinystories_ending,tinystories_cloze", limit=3, per_item=True)
    ending, cloze = res["tinystories_ending"], res["tinystories_cloze"]
    assert ending["samples"] == cloze["samples"] == 3
    for m in ("acc", "acc_norm", "acc_mutual_info"):
        assert 0 <= ending[m] <= 1 and len(ending["items"][m]) == 3
    assert cloze["items"]["doc_id"] == [0, 1, 2] and cloze["perplexity"] > 1
    # what lm-eval asks the model: each option right after the context, as the story has it (no added space),
    # each option once more after nothing (acc_mutual_info's unconditional term), and the cloze word after a space
    items = rows(SHIPPED, FILES[0])[:3]
    conditional = {(c, x) for c, x in seen if c}
    for r in items:
        for choice in r["choices"]:
            assert (r["context"], choice) in conditional
    for r in rows(SHIPPED, FILES[3])[:3]:
        assert (r["context"], " " + r["target"]) in conditional
    assert sum(1 for c, _ in seen if c == "") == 3 * 4
    # per-item "ll" is the gold option's log-likelihood, as the model scores it alone
    (lp, _), = lm.loglikelihood([_req(items[0]["context"], items[0]["choices"][items[0]["label"]])])
    assert ending["items"]["ll"][0] == pytest.approx(lp)


def _req(ctx, cont):
    from lm_eval.api.instance import Instance
    return Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=0)
