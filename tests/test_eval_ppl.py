"""Perplexity (evals.ppl): llama.cpp's chunking and error bar, checked against a direct numpy computation."""
import json
import math

import numpy as np
import pytest

from eval_tiny import text_file, use_tiny


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    return use_tiny(monkeypatch, tmp_path)


def test_windows_llama_cpp_chunks():
    from evals.ppl import windows
    w = windows(1000, 100)
    assert len(w) == 10                                   # non-overlapping, the ragged tail dropped
    assert w[0] == (0, 100, 51) and w[3] == (300, 400, 351)
    assert len(windows(1000, 100, chunks=4)) == 4
    # tokens scored per chunk: n_ctx - 1 - n_ctx/2, as llama-perplexity counts them
    assert all(e - f == 100 - 1 - 50 for _, e, f in w)


def test_windows_strided_scores_every_token_once():
    from evals.ppl import windows
    for n, ctx, stride in [(1000, 100, 50), (1000, 100, 99), (777, 64, 17), (50, 100, 10)]:
        targets = [t for b, e, f in windows(n, ctx, stride=stride) for t in range(f, e)]
        assert targets == list(range(1, n)), (n, ctx, stride)
        assert all(e - b <= ctx and f >= b + 1 for b, e, f in windows(n, ctx, stride=stride))
    with pytest.raises(Exception, match="stride"):
        windows(1000, 100, stride=100)               # no overlap: a token per window would go unscored


def direct_nll(session, ids, spans):
    """Independent: run each window from an empty cache, log-softmax in numpy, pick the targets."""
    out = []
    for b, e, first in spans:
        session.engine.reset()
        logits = session.engine.forward(np.asarray(ids[b:e]), "prefill").astype(np.float64)
        m = logits.max(-1, keepdims=True)
        lsm = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        for t in range(first, e):
            out.append(-lsm[t - 1 - b, ids[t]])
    return np.array(out)


@pytest.mark.parametrize("stride", [None, 24])
def test_perplexity_equals_direct_numpy(tiny, tmp_path, stride):
    from evals.common import text_ids
    from evals.ppl import perplexity
    from runtime.session import open_session
    with open_session(tiny, "resident", direct=False) as s:
        ids = text_ids(s.tokenizer, text_file(tmp_path))[:200]
        res = perplexity(s, ids, n_ctx=64, chunks=3, stride=stride, progress=False)
        if stride is None:
            spans = [(0, 64, 33), (64, 128, 97), (128, 192, 161)]
        else:
            spans = [(0, 64, 1), (24, 88, 64), (48, 112, 88)]
        nll = direct_nll(s, ids, spans)
    n = nll.size
    ppl = math.exp(nll.mean())
    var = (nll ** 2).mean() - nll.mean() ** 2
    assert res["tokens"] == n
    assert res["ppl"] == pytest.approx(ppl, rel=1e-9)
    assert res["ppl_stderr"] == pytest.approx(ppl * math.sqrt(var / (n - 1)), rel=1e-6)
    assert 1.0 < res["ppl"] < 4096 * 50                  # a real, non-degenerate model


def test_ppl_bos_replaces_first_token(tiny, tmp_path):
    from evals.common import text_ids
    from evals.ppl import perplexity
    from runtime.session import open_session
    with open_session(tiny, "resident", direct=False) as s:
        ids = text_ids(s.tokenizer, text_file(tmp_path))[:128]
        with_bos = perplexity(s, ids, n_ctx=64, chunks=2, bos=True, progress=False)
        ids2 = list(ids)
        ids2[0] = ids2[64] = s.spec.bos_token_id
        nll = direct_nll(s, ids2, [(0, 64, 33), (64, 128, 97)])
    assert with_bos["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-9)


def test_ppl_cli_json_and_run_record(tiny, tmp_path, capsys):
    from cli import main
    from workbench.runs import list_runs, read_run
    rc = main(["eval", "ppl", "--model", tiny, "--preset", "on_demand", "--data", text_file(tmp_path),
               "--ctx", "32", "--chunks", "2", "--quiet", "--page-cache", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"ppl", "ppl_stderr", "tokens"} <= set(out) and out["tokens"] == 2 * (32 - 1 - 16)
    runs = list_runs(tmp_path / "runs")
    assert len(runs) == 1
    rec = read_run(runs[0])
    assert rec["config"]["eval"] == "ppl" and rec["config"]["ctx"] == 32
    assert rec["summary"]["ppl"] == pytest.approx(out["ppl"])


def test_ppl_refuses_context_beyond_the_model(tiny, tmp_path, capsys):
    from cli import main
    rc = main(["eval", "ppl", "--model", tiny, "--preset", "resident", "--data", text_file(tmp_path),
               "--ctx", "512", "--chunks", "1", "--quiet", "--no-record"])
    assert rc == 2 and "context" in capsys.readouterr().err


def test_text_ids_prefix_matches_whole_text(tmp_path):
    from tokenizers import Tokenizer

    from eval_tiny import REPO
    from evals.common import text_ids
    tok = Tokenizer.from_file(str(REPO / "data/models/demo-moe/tokenizer.json"))
    path = text_file(tmp_path, 60000)
    whole = text_ids(tok, path)
    for need in (100, 1000, 5000):
        assert text_ids(tok, path, need)[:need] == whole[:need]
