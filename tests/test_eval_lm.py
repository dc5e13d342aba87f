"""The lm-eval adapter (evals.lm_eval_adapter) and the local tasks (evals/tasks, data/benchmarks)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from eval_tiny import REPO, use_tiny

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    return use_tiny(monkeypatch, tmp_path)


@pytest.fixture
def lm(tiny):
    from evals.lm_eval_adapter import WorkbenchLM
    from runtime.session import open_session
    with open_session(tiny, "les", direct=False) as s:
        yield WorkbenchLM(session=s, model=tiny, progress=False)


def _req(kind, *args):
    from lm_eval.api.instance import Instance
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _engine_logprob(session, ctx_ids, cont_ids):
    """Independent: one forward of context + continuation, numpy log-softmax, sum over the continuation."""
    full = list(ctx_ids) + list(cont_ids)
    session.engine.reset()
    x = session.engine.forward(np.asarray(full[:-1]), "prefill").astype(np.float64)[-len(cont_ids):]
    m = x.max(-1, keepdims=True)
    lsm = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    return float(sum(lsm[i, t] for i, t in enumerate(cont_ids))), bool(all(lsm[i].argmax() == t
                                                                         for i, t in enumerate(cont_ids)))


def test_loglikelihood_equals_engine_sum_of_logprobs(lm):
    s = lm.session
    pairs = [("Once upon a time, there was a", " little girl"), ("Once upon a time, there was a", " big dog"),
             ("Once upon a time, there was a ", "cat"), ("The sun", " was hot."), ("", "Hello there")]
    got = lm.loglikelihood([_req("loglikelihood", c, x) for c, x in pairs])
    for (ctx, cont), (lp, greedy) in zip(pairs, got):
        if ctx == "":
            c_ids, x_ids = [s.spec.eos_token_id], s.encode(cont)
        else:
            c = ctx.rstrip()
            cont = ctx[len(c):] + cont                      # trailing spaces move to the continuation, as in HFLM
            whole = s.encode(c + cont)
            c_ids = s.encode(c)
            x_ids = whole[len(c_ids):]
        want, want_greedy = _engine_logprob(s, c_ids, x_ids)
        assert lp == pytest.approx(want, abs=1e-4, rel=1e-5), (ctx, cont)
        assert greedy == want_greedy
        assert lp < 0


def test_greedy_flag_true_for_the_models_own_continuation(lm):
    s = lm.session
    out = s.generate("One day, Tim", tokens=3)
    (lp, greedy), = lm.loglikelihood([_req("loglikelihood", "One day, Tim", s.decode(out["tokens"]))])
    ids = s.encode("One day, Tim" + s.decode(out["tokens"]))
    if ids[len(s.encode("One day, Tim")):] == out["tokens"]:   # only when the text re-tokenizes the same way
        assert greedy


def test_loglikelihood_rolling_is_the_whole_text_after_eos(lm):
    s = lm.session
    text = "Lily and Ben went to the park. They played on the swings and had fun."
    (got,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)])
    ids = s.encode(text)
    want, _ = _engine_logprob(s, [s.spec.eos_token_id], ids)
    assert got == pytest.approx(want, abs=1e-4, rel=1e-5)


def test_loglikelihood_rolling_windows_beyond_max_length(tiny):
    from evals.lm_eval_adapter import WorkbenchLM
    from runtime.session import open_session
    text = (REPO / "data/corpora/tinystories/tinystories_val_head.txt").read_text()[:3000]
    with open_session(tiny, "resident", direct=False) as s:
        small = WorkbenchLM(session=s, max_length=64, progress=False)
        (got,) = small.loglikelihood_rolling([_req("loglikelihood_rolling", text)])
        ids = s.encode(text)
        assert len(ids) > 3 * 64
        # lm-eval's rolling windows: each token predicted once, with up to 64 tokens of context
        from lm_eval import utils
        want = 0.0
        for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(ids, 0, 64, 1)):
            want += _engine_logprob(s, ctx, cont)[0]
    assert got == pytest.approx(want, rel=1e-5)


def test_generate_until_is_greedy_and_stops(lm):
    s = lm.session
    ref = s.decode(s.generate("Once upon a time", tokens=12)["tokens"])
    (full,) = lm.generate_until([_req("generate_until", "Once upon a time", {"until": ["\n\n\n\n"], "max_gen_toks": 12})])
    assert full == ref
    stop = ref[len(ref) // 2: len(ref) // 2 + 2]
    if stop.strip():
        (cut,) = lm.generate_until([_req("generate_until", "Once upon a time", {"until": [stop], "max_gen_toks": 12})])
        assert cut == ref.split(stop, 1)[0]


def test_local_task_names():
    from evals.lm import local_task_names
    assert local_task_names("lambada_openai,arc_easy,piqa_local") == ["lambada_openai_local", "arc_easy_local",
                                                                     "piqa_local"]
    with pytest.raises(Exception, match="mmlu"):
        local_task_names("mmlu")


def test_all_local_tasks_run_offline(lm, monkeypatch):
    from evals.lm import LOCAL, evaluate
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = evaluate(lm, ",".join(LOCAL), limit=2)
    assert sorted(res) == sorted(f"{t}_local" for t in LOCAL)
    for task, m in res.items():
        assert 0.0 <= m["acc"] <= 1.0 and m["samples"] == 2, task


def test_benchmark_files_have_provenance_and_stay_small():
    root = REPO / "data" / "benchmarks"
    names = ["lambada_openai", "hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq"]
    for n in names:
        src = (root / n / "SOURCE.txt").read_text()
        assert "License" in src and "evals/prepare_benchmarks.py" in src, n
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total < 15e6


def test_lm_cli_json(tiny, tmp_path, capsys):
    from cli import main
    from workbench.runs import list_runs, read_run
    rc = main(["eval", "lm", "--tasks", "arc_easy,piqa", "--limit", "2", "--model", tiny, "--preset", "resident",
               "--quiet", "--page-cache", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)             # stdout holds exactly one JSON object
    assert set(out["results"]) == {"arc_easy_local", "piqa_local"}
    rec = read_run(list_runs(tmp_path / "runs")[0])
    assert rec["config"]["eval"] == "lm" and rec["config"]["limit"] == 2


def test_plugin_hook_registers_workbench_for_plain_lm_eval(tmp_path):
    code = ("import evals._lm_eval_hook\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('workbench').__name__, get_model('dummy').__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.stdout.split() == ["WorkbenchLM", "DummyLM"], out.stderr[-2000:]
    from evals.lm_eval_adapter import install_plugin
    pth = install_plugin(str(tmp_path))
    assert open(pth).read().splitlines() == [str(REPO), "import evals._lm_eval_hook"]
