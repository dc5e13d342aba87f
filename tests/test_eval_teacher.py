"""Teacher comparison (evals.teacher): KL(teacher || student), top-1, both ppl, per-layer routing agreement."""
import json

import numpy as np
import pytest

from eval_tiny import text_file, use_tiny


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    return use_tiny(monkeypatch, tmp_path)


def _ids(s, tmp_path, n=128):
    from evals.common import text_ids
    return text_ids(s.tokenizer, text_file(tmp_path))[:n]


def test_teacher_against_itself_is_exact(tiny, tmp_path):
    from evals.teacher import TeacherTrace, compare
    from runtime.session import open_session
    with open_session(tiny, "teacher", direct=False) as t, open_session(tiny, "teacher", direct=False) as s:
        trace = TeacherTrace(t, _ids(t, tmp_path), 64, 2, progress=False)
        r = compare(s, trace, progress=False)
    assert r["kl"] == pytest.approx(0.0, abs=1e-12) and r["top1"] == 1.0
    assert r["ppl"] == r["ppl_teacher"] and r["ppl_ratio"] == 1.0
    assert r["routing_agreement"] == [1.0, 1.0] and r["routing_exact"] == [1.0, 1.0]
    assert r["tokens"] == 2 * (64 - 1 - 32) and r["routed_tokens"] == 128


def _lsm(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_student_metrics_match_a_direct_computation(tiny, tmp_path):
    from evals.teacher import TeacherTrace, compare
    from runtime.session import open_session
    # les: q3 experts, exact routing (smol_bias's cache-biased routing depends on the cache's history)
    with open_session(tiny, "teacher", direct=False) as t, open_session(tiny, "les", direct=False) as s:
        ids = _ids(t, tmp_path)
        trace = TeacherTrace(t, ids, 64, 2, progress=False)
        r = compare(s, trace, progress=False)
        # independent: the same two windows through both engines, routing from the telemetry's LayerEvents
        kl, top1, routed = [], [], {0: [], 1: []}
        for b in (0, 64):
            t.engine.reset()
            lt = _lsm(t.engine.forward(np.asarray(ids[b:b + 64]), "prefill"))[32:63]
            n_ev = len(s.tel.events)
            s.engine.reset()
            ls = _lsm(s.engine.forward(np.asarray(ids[b:b + 64]), "prefill"))[32:63]
            for ev in s.tel.events[n_ev:]:
                routed[ev.layer].append(set(ev.routed))
            p = np.exp(lt)
            kl.append((p * (lt - ls)).sum(-1))
            top1.append(lt.argmax(-1) == ls.argmax(-1))
    kl, top1 = np.concatenate(kl), np.concatenate(top1)
    assert r["kl"] == pytest.approx(kl.mean(), rel=1e-4, abs=1e-9)
    assert r["top1"] == pytest.approx(top1.mean())
    assert r["kl"] > 0                                   # q3 experts, q4 rest: not the teacher
    assert len(r["routing_agreement"]) == 2 and all(0.0 <= a <= 1.0 for a in r["routing_agreement"])
    assert all(0.0 <= a <= 1.0 for a in r["routing_exact"])
    assert r["ppl"] > 1 and r["ppl_teacher"] > 1


def test_routing_capture_agrees_with_layer_events(tiny, tmp_path):
    from evals.common import RoutingCapture, forward
    from runtime.session import open_session
    with open_session(tiny, "smol_bias", direct=False) as s:
        cap = RoutingCapture(s)
        n_ev = len(s.tel.events)
        forward(s, _ids(s, tmp_path, 40))
        got = cap.take()
        cap.remove()
        evs = s.tel.events[n_ev:]
        assert s.engine.router_hook is cap.prev
    assert sorted(got) == [0, 1] and got[0].shape == (40, 2)
    for ev in evs:                                       # the distinct experts a layer ran = those captured
        assert set(ev.routed) == set(np.unique(got[ev.layer]).tolist())


def test_routing_overlap():
    from evals.common import routing_overlap
    a = np.array([[0, 1], [2, 3], [4, 5]])
    b = np.array([[1, 0], [2, 7], [6, 7]])
    o, x = routing_overlap(a, b)
    assert o.tolist() == [1.0, 0.5, 0.0] and x.tolist() == [True, False, False]


def test_teacher_cli_json(tiny, tmp_path, capsys):
    from cli import main
    from workbench.runs import list_runs, read_run
    rc = main(["eval", "teacher", "--model", tiny, "--preset", "les", "--data", text_file(tmp_path), "--ctx", "32",
               "--chunks", "2", "--quiet", "--page-cache", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"kl", "top1", "ppl", "ppl_teacher", "routing_agreement"} <= set(out)
    assert len(out["routing_agreement"]) == 2
    rec = read_run(list_runs(tmp_path / "runs")[0])
    assert rec["config"]["eval"] == "teacher" and rec["config"]["preset"]["name"] == "les"
    assert [r["layer"] for r in rec["layers"]] == [0, 1]
