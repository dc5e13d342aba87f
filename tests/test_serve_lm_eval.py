"""lm-eval's own `local-completions` client against `python -m workbench serve`, on every task in evals/tasks.

The client asks the server's tokenizer (/tokenizer_info, /tokenize) for its special tokens and scores every item by
log-likelihood through /v1/completions (echo + logprobs), the unconditional likelihoods of acc_mutual_info
included. Its answers must be the in-process adapter's (evals/lm_eval_adapter.py) item by item.
"""
from __future__ import annotations

import http.client
import os
import sys

import pytest

from eval_tiny import CTX, REPO, use_tiny
from servers import free_port, serving

lm_eval = pytest.importorskip("lm_eval")
LIMIT = 3
TASKS = sorted(p.stem for p in (REPO / "evals" / "tasks").glob("*.yaml"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`serve` in its own process on the tiny model; yields (its base URL, the model dir)."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("serve")
    model = use_tiny(mp, tmp)
    port, log = free_port(), tmp / "serve.log"
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", model, "--preset", "les", "--page-cache",
           "--port", str(port), "--served-model-name", "tiny", "--quiet"]

    def up():
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            return c.getresponse().status == 200
        except OSError:
            return False
    try:
        with serving(cmd, log, up, 120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}):
            yield f"http://127.0.0.1:{port}", model
    finally:
        mp.undo()


def test_every_task_scores_through_the_server_as_in_process(served, monkeypatch):
    from evals.lm import evaluate, items, task_manager
    from evals.lm_eval_adapter import WorkbenchLM
    from runtime.session import open_session
    url, model = served
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"model=tiny,base_url={url}/v1/completions,max_length={CTX}",
        tasks=TASKS, limit=LIMIT, task_manager=task_manager(), log_samples=True, bootstrap_iters=0)
    assert sorted(res["results"]) == TASKS
    # the same window on long items: the client sends the last max_length - 1 tokens (and asks for one more, which
    # must fit the context); the adapter scores the last max_length + 1
    with open_session(model, "les", direct=False) as s:
        lm = WorkbenchLM(session=s, model=model, progress=False, max_length=CTX - 2)
        want = evaluate(lm, TASKS, limit=LIMIT, per_item=True)
    for task in TASKS:
        got = items(res["samples"][task])
        assert len(got["doc_id"]) == LIMIT, task
        assert got["doc_id"] == want[task]["items"]["doc_id"], task
        # the server prefills context and continuation in one call, the adapter in two (the context's KV kept for
        # the next choice), and the packed engine's prefill of a token is not the same to the last bit in calls of
        # other lengths (on a Xeon, a context's logits from its 16th position on moved by up to 0.026 between a 30-
        # and a 79-row call, the routing the same): 4e-5 of an item's log-likelihood there (-436.654 in one call,
        # -436.638 in two); a wrong token or window costs nats
        assert got["ll"] == pytest.approx(want[task]["items"]["ll"], rel=1e-4, abs=1e-3), task
        for metric in ("acc", "acc_mutual_info", "exact_match"):
            if metric in want[task]["items"]:
                assert got[metric] == want[task]["items"][metric], (task, metric)
    assert "acc_mutual_info" in want["tinystories_ending"]["items"], "the task that asks for an empty context"
