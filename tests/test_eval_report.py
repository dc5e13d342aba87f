"""`eval compare` (run records side by side) and `eval report` (results/quality.md + .json)."""
import json
from pathlib import Path

import pytest

from eval_tiny import use_tiny


def _fake(root, kind, preset, config, summary, budget="0.25"):
    from workbench.runs import write_run
    return write_run(preset, {"eval": kind, "model": "m", "preset": {"name": preset}, "budget": budget, **config},
                     summary, [], [], root=root)


def test_compare_tabulates_newest_records_against_the_teacher(tmp_path):
    from evals.compare import eval_runs, render, table
    from workbench.runs import write_run
    root = tmp_path / "runs"
    _fake(root, "ppl", "teacher", {"data": "wikitext2", "ctx": 512}, {"ppl": 10.0}, budget="all")
    _fake(root, "ppl", "les", {"data": "wikitext2", "ctx": 512}, {"ppl": 99.0})
    import time
    time.sleep(1.1)                                       # run names start with the second
    _fake(root, "ppl", "les", {"data": "wikitext2", "ctx": 512}, {"ppl": 11.0})
    _fake(root, "teacher", "les", {"data": "wikitext2", "ctx": 512},
          {"kl": 0.05, "top1": 0.9, "routing_agreement_mean": 0.8, "ppl": 11.0})
    _fake(root, "lm", "les", {"tasks": ["piqa_local"]}, {"results": {"piqa_local": {"acc": 0.6, "acc_norm": 0.5}}})
    _fake(root, "lm", "teacher", {"tasks": ["piqa_local"]}, {"results": {"piqa_local": {"acc": 0.7}}}, budget="all")
    write_run("les", {"model": "m"}, {"tok_s": 3.0}, [], [], root=root)          # a bench record: not an eval
    runs = eval_runs(root)
    assert len(runs) == 6
    t = table(runs)
    rows = {r["preset"]: r for r in t["rows"]}
    assert [r["preset"] for r in t["rows"]] == ["teacher", "les"]
    les = rows["les"]
    assert les["metrics"]["ppl wikitext2/512"] == 11.0                       # the newest record wins
    assert les["vs_teacher"]["ppl wikitext2/512"] == pytest.approx(0.1)
    assert les["metrics"]["kl wikitext2/512"] == 0.05 and les["metrics"]["top1 wikitext2/512"] == 0.9
    assert les["metrics"]["piqa acc"] == 0.6 and les["vs_teacher"]["piqa acc"] == pytest.approx(-0.1)
    text = render(t)
    assert "les" in text and "+10.0%" in text


def test_compare_pairs_per_item_scores_with_the_teachers(tmp_path):
    from evals.compare import eval_runs, render, table
    root = tmp_path / "runs"
    ids = list(range(100))
    for preset, acc in [("teacher", [1.0] * 100), ("smol", [0.0] * 20 + [1.0] * 80), ("les", [1.0] * 100)]:
        _fake(root, "lm", preset, {"tasks": ["piqa_local"]},
              {"results": {"piqa_local": {"acc": sum(acc) / 100, "items": {"doc_id": ids, "acc": acc}}}})
    _fake(root, "lm", "on_demand", {"tasks": ["piqa_local"]},           # other items: no pairing
          {"results": {"piqa_local": {"acc": 0.5, "items": {"doc_id": ids[:50], "acc": [1.0] * 50}}}})
    t = table(eval_runs(root))
    rows = {r["preset"]: r for r in t["rows"]}
    assert rows["smol"]["paired"]["piqa acc"]["significant"] and rows["smol"]["paired"]["piqa acc"]["teacher_only"] == 20
    assert not rows["les"]["paired"]["piqa acc"]["significant"]
    assert rows["on_demand"]["paired"] == {} and rows["teacher"]["paired"] == {}
    assert "items" not in rows["smol"]
    text = render(t)
    assert "0.800 (-0.200*)" in text and "1.000 (+0.000)" in text


def test_compare_cli(tmp_path, monkeypatch, capsys):
    from cli import main
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    _fake(tmp_path / "runs", "ppl", "teacher", {"data": "tinystories", "ctx": 64}, {"ppl": 5.0}, budget="all")
    assert main(["eval", "compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["columns"] == ["ppl tinystories/64"] and out["rows"][0]["preset"] == "teacher"


def test_report_writes_markdown_and_json(monkeypatch, tmp_path, capsys):
    from cli import main
    from workbench.runs import list_runs
    tiny = use_tiny(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "results" / "quality.md"
    rc = main(["eval", "report", "--model", tiny, "--presets", "teacher,smol", "--ctx", "32", "--chunks", "2",
               "--tasks", "arc_easy,piqa", "--limit", "2", "--data", "tinystories", "--out", str(out), "--quiet",
               "--page-cache", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    rep = json.loads(out.with_suffix(".json").read_text())
    assert [r["preset"] for r in rep["rows"]] == ["teacher", "smol"] and res["markdown"] == str(out)
    teacher, smol = rep["rows"]
    assert teacher["kl"] == pytest.approx(0.0, abs=1e-12) and teacher["top1"] == 1.0
    assert smol["kl"] > 0 and set(smol["tasks"]) == {"arc_easy", "piqa"}
    assert smol["tasks"]["piqa"]["samples"] == 2
    for task in ("arc_easy", "piqa"):                    # paired with the teacher's answers on the same items
        p, items = smol["tasks"][task]["paired"], {}
        assert "paired" not in teacher["tasks"][task] and p["n"] == 2
        for run in smol["runs"] + teacher["runs"]:
            summ = json.loads((Path(run) / "summary.json").read_text())
            if "results" in summ:
                items[summ["preset"]] = summ["results"][f"{task}_local"]["items"]["acc"]
        t, s = items["teacher"], items["smol"]
        assert p["teacher_only"] == sum(a > b for a, b in zip(t, s)) and p["preset_only"] == sum(b > a for a, b in zip(t, s))
        assert p["diff"] == pytest.approx(sum(s) / 2 - sum(t) / 2)
    md = out.read_text()
    assert "| `smol` |" in md and "arc_easy" in md and "## Paired against the teacher" in md
    cmd = rep["command"]                                 # the one command that remakes it, at the top
    assert f"Made by `{cmd}`" in md.splitlines()[2]
    assert cmd.startswith(f"python -m workbench eval report --model {tiny} ") and f"--out {out}" in cmd
    assert "--presets teacher,smol" in cmd and "--limit 2" in cmd and "--page-cache" in cmd and "--quiet" not in cmd
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]      # no temporary files left
    kinds = sorted(json.loads((p / "config.json").read_text())["eval"] for p in list_runs(tmp_path / "runs"))
    assert kinds == ["lm", "lm", "teacher", "teacher"]
