"""What a run decodes (runtime/text.py): a made checkpoint decodes forced text by default (a corpus's tokens fed one
by one, the model's logits and routing computed at every step), a trained one its own greedy tokens; every record
says which, and a run whose text or routing degenerated says so."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from experiments.bench import bench, text_check
from runtime.session import open_session
from test_bad_input import assert_one_line_error, cli
from workbench.telemetry import LayerEvent


def test_feeding_the_models_own_tokens_is_free_decoding():
    with open_session("demo", "les", "0.25", tokens=8) as s:
        free = s.generate("Once upon a time", 8)
        routed = [e.routed for e in s.tel.events]
    with open_session("demo", "les", "0.25", tokens=8) as s:
        forced = s.generate("Once upon a time", 8, forced=free["tokens"])
        assert [e.routed for e in s.tel.events] == routed
    assert forced["tokens"] == free["tokens"] and forced["agreement"] == 1.0 and forced["forced"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from workbench.shapes import make_model
    return str(make_model("qwen3-30b-a3b", layers=2, out=tmp_path_factory.mktemp("made") / "m", experts=8))


@pytest.mark.slow
def test_a_made_checkpoint_decodes_forced_text_unless_asked_for_its_own(made, tmp_path, monkeypatch):
    from workbench.runs import read_run
    from workbench.textdata import heldout_ids
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    res = bench(made, "on_demand", "0.5", tokens=6, prompt="Once upon a time")
    with open_session(made, "on_demand", "0.5", tokens=6) as s:
        ids = heldout_ids(s.tokenizer, "tinystories", len(s.encode("Once upon a time")) + 6)
        assert res["text"] == s.decode(ids[-6:])
    assert res["text_source"].startswith("forced text: tinystories") and "RANDOM" in res["random_weights"]
    assert read_run(res["run"])["config"]["text"] == res["text_source"]
    free = bench(made, "on_demand", "0.5", tokens=6, text="free", record=False)
    assert free["text_source"].startswith("free") and free["text"] != res["text"]
    oracle = bench(made, "oracle", "0.5", tokens=6, record=False)      # its trace is the forced text's routing
    assert oracle["text"] == res["text"] and oracle["prefetch_recall"] == 1.0


def test_a_trained_model_decodes_its_own_tokens_by_default():
    res = bench("demo", "on_demand", "0.25", tokens=4, record=False)
    assert res["text_source"].startswith("free") and not res["text_check"]["degenerate"]


def fake(tokens, routed, k=2):
    evs = [LayerEvent(token=t, layer=0, phase="decode", routed=r, predicted=[], hit=[]) for t, r in enumerate(routed)]
    return SimpleNamespace(tel=SimpleNamespace(events=evs), spec=SimpleNamespace(top_k=k)), {"tokens": tokens}


def test_a_run_whose_text_or_routing_repeats_is_degenerate():
    s, out = fake([5, 6, 7, 8], [[0, 1], [2, 3], [0, 4], [5, 6]])
    assert not text_check(s, out)["degenerate"]
    s, out = fake([5, 5, 5, 9], [[0, 1], [2, 3], [0, 4], [5, 6]])        # half the tokens distinct
    assert not text_check(s, out)["degenerate"]
    s, out = fake([5] * 8, [[0, 1], [2, 3], [0, 4], [5, 6]])             # one token over and over
    assert text_check(s, out)["degenerate"]
    s, out = fake([1, 2, 3, 4], [[0, 1]] * 4)                            # the same experts every token
    c = text_check(s, out)
    assert c["reuse"] == 1.0 and c["degenerate"] and 0.3 < c["real_trace_reuse"] < 0.45


def test_bad_text_is_one_line():
    assert_one_line_error(cli("bench", "--model", "demo", "--free", "--text", "tinystories"), "choose one")
    assert_one_line_error(cli("bench", "--model", "demo", "--text", "/no/such.txt", "--tokens", "2"),
                          "/no/such.txt: no such data file")
