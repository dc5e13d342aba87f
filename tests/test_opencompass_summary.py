"""evals.opencompass.summarize: an OpenCompass work dir's predictions as accuracy, parse rate and paired flips."""
import json

import pytest

from evals.opencompass.summarize import main, summary
from workbench.errors import WorkbenchError


def _preds(run, model, name, pairs, start=0):
    d = run / "predictions" / model
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps({str(start + i): {"prediction": p, "gold": g} for i, (p, g) in enumerate(pairs)}))


def test_accuracy_parse_rate_and_flips_against_the_reference(tmp_path):
    gold = list("ABCDABCDAB")
    _preds(tmp_path, "demo-teacher", "stories.json", [(g, g) for g in gold])                 # all right
    mine = ["A", "B", "C", "D", "A", "B", "C", "D", "I'll be a man.", "A"]                   # 2 wrong, 1 no letter
    _preds(tmp_path, "demo-edge0", "stories_0.json", list(zip(mine[:5], gold[:5])))          # a dataset in two parts
    _preds(tmp_path, "demo-edge0", "stories_1.json", list(zip(mine[5:], gold[5:])), start=5)
    s = summary(tmp_path, "demo-teacher")
    rows = {r["model"]: r for r in s["rows"]}
    assert [r["model"] for r in s["rows"]] == ["demo-teacher", "demo-edge0"]
    assert rows["demo-teacher"]["accuracy"] == 1.0 and rows["demo-teacher"]["parse_rate"] == 1.0
    edge0 = rows["demo-edge0"]
    assert edge0["n"] == 10 and edge0["accuracy"] == 0.8 and edge0["parse_rate"] == 0.9
    assert (edge0["paired"]["teacher_only"], edge0["paired"]["preset_only"]) == (2, 0)
    out = tmp_path / "oc.md"
    main([str(tmp_path), "--reference", "demo-teacher", "--out", str(out), "--command", "opencompass x.py"])
    md = out.read_text()
    assert "opencompass x.py" in md and "| `demo-edge0` | stories | 10 | 0.800 | 90% |" in md
    assert json.loads(out.with_suffix(".json").read_text())["reference"] == "demo-teacher"


def test_not_a_work_dir_is_a_named_error(tmp_path):
    with pytest.raises(WorkbenchError, match="no predictions"):
        summary(tmp_path)
