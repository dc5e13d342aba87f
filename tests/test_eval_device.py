"""`--device` on the eval verbs: the preset's reads emulate a device's flash, the output and the run record say
so, and the quality numbers are the same as on this machine's flash (emulation changes when a read lands, not
what it reads)."""
import json

import pytest

from cli import main

TEXT = ["--model", "demo", "--preset", "on_demand", "--budget", "0.25", "--data", "tinystories", "--ctx", "32",
        "--chunks", "1", "--quiet"]


def run(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("verb", ["ppl", "teacher"])
def test_an_eval_under_an_emulated_device_is_labelled_and_scores_the_same(verb, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path))
    here = run(capsys, "eval", verb, *TEXT, "--no-record", "--json")
    phone = run(capsys, "eval", verb, *TEXT, "--device", "ufs22-phone", "--json")
    assert (here["emulated"], here["device"]) == (False, None)
    assert phone["emulated"] and phone["device"]["name"] == "ufs22-phone" and phone["device"]["emulated"]
    assert phone["ppl"] == here["ppl"]
    record = json.loads((__import__("pathlib").Path(phone["run"]) / "config.json").read_text())
    assert record["emulated"] and record["device"]["name"] == "ufs22-phone"
    assert main(["eval", verb, *TEXT, "--device", "ufs22-phone", "--no-record"]) == 0
    assert capsys.readouterr().out.startswith("EMULATED ufs22-phone flash: ")


def test_an_unknown_device_is_a_one_line_error(capsys):
    assert main(["eval", "ppl", *TEXT, "--device", "no-such-phone", "--no-record"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-phone" in err and "no such profile" in err
