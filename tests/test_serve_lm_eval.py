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
    from runtime.session import Session
    url, model = served
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = lm_eval.simple_evaluate(
        model="local-completions", model_args=f"model=tiny,base_url={url}/v1/completions,max_length={CTX}",
        tasks=TASKS, limit=LIMIT, task_manager=task_manager(), log_samples=True, bootstrap_iters=0)
    assert sorted(res["results"]) == TASKS
    # the same window on long items: the client sends the last max_length - 1 tokens (and asks for one more, which
    # must fit the context); the adapter scores the last max_length + 1
    with Session(model, "les", direct=False) as s:
        lm = WorkbenchLM(session=s, model=model, progress=False, max_length=CTX - 2)
        want = evaluate(lm, TASKS, limit=LIMIT, per_item=True)
    for task in TASKS:
        got = items(res["samples"][task])
        assert len(got["doc_id"]) == LIMIT, task
        assert got["doc_id"] == want[task]["items"]["doc_id"], task
        assert got["ll"] == pytest.approx(want[task]["items"]["ll"], abs=1e-3), task
        for metric in ("acc", "acc_mutual_info", "exact_match"):
            if metric in want[task]["items"]:
                assert got[metric] == want[task]["items"][metric], (task, metric)
    assert "acc_mutual_info" in want["tinystories_ending"]["items"], "the task that asks for an empty context"
