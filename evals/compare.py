"""Eval run records side by side, each preset against the teacher.

Reads every run record whose config has an "eval" key (ppl, teacher, lm, written by the eval verbs),
keeps the newest per (model, preset, budget, metric column), and tabulates one row per
(model, preset, budget). Columns name their setting: "ppl tinystories/512" (data/ctx),
"kl ..."/"top1 ..."/"route ..." for teacher comparisons, "<task> acc" for lm-eval. Where a preset's lm-eval
record and the teacher's hold per-item scores of the same items, the row's "paired" has the paired comparison
(evals/paired.py) for that column.
"""
from __future__ import annotations

import json
from pathlib import Path

from evals.common import PRESET_ORDER
from evals.paired import paired
from workbench.runs import list_runs

LOWER_BETTER = ("ppl", "kl")


def eval_runs(root: Path | None = None, model: str | None = None) -> list[dict]:
    out = []
    for p in list_runs(root):
        try:
            cfg = json.loads((p / "config.json").read_text())
            if "eval" not in cfg:
                continue
            summ = json.loads((p / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if model and cfg.get("model") != model:
            continue
        out.append({"path": str(p), "name": p.name, "eval": cfg["eval"], "model": cfg.get("model"),
                    "preset": (cfg.get("preset") or {}).get("name", summ.get("preset")), "budget": cfg.get("budget"),
                    "config": cfg, "summary": summ})
    return sorted(out, key=lambda r: r["name"])        # names start with the UTC time


def items_of(run: dict) -> dict:
    """{column: (doc ids, per-item scores of the column's metric)} of an lm-eval record that kept them."""
    if run["eval"] != "lm":
        return {}
    from evals.lm import primaries
    results = run["summary"].get("results")
    out = {}
    for task, p in primaries(results).items():
        it = results[task].get("items") or {}
        if p.metric in it:
            out[p.column] = (it["doc_id"], it[p.metric])
    return out


def metrics_of(run: dict) -> dict:
    c, s = run["config"], run["summary"]
    tag = f"{c.get('data')}/{c.get('ctx')}" + (f"/s{c['stride']}" if c.get("stride") else "")
    if run["eval"] == "ppl":
        return {f"ppl {tag}": s.get("ppl")}
    if run["eval"] == "teacher":
        return {f"kl {tag}": s.get("kl"), f"top1 {tag}": s.get("top1"), f"route {tag}": s.get("routing_agreement_mean"),
                f"ppl {tag}": s.get("ppl")}
    if run["eval"] == "lm":
        from evals.lm import primaries
        return {p.column: p.value for p in primaries(s.get("results")).values()}
    return {}


def table(runs: list[dict]) -> dict:
    rows: dict[tuple, dict] = {}
    columns: list[str] = []
    for r in runs:                                       # oldest first: newer values overwrite
        key = (r["model"], r["preset"], r["budget"])
        row = rows.setdefault(key, {"model": r["model"], "preset": r["preset"], "budget": r["budget"], "metrics": {},
                                    "runs": {}, "items": {}})
        for col, v in metrics_of(r).items():
            if v is None:
                continue
            if col not in columns:
                columns.append(col)
            row["metrics"][col] = v
            row["runs"][col] = r["name"]
            row["items"].pop(col, None)
        row["items"].update(items_of(r))
    order = {p: i for i, p in enumerate(PRESET_ORDER)}
    out = sorted(rows.values(), key=lambda x: (str(x["model"]), order.get(x["preset"], 99), str(x["preset"]),
                                               str(x["budget"])))
    for row in out:
        teacher = next((t for t in out if t["model"] == row["model"] and t["preset"] == "teacher"), None)
        row["vs_teacher"], row["paired"] = {}, {}
        if teacher is None:
            continue
        for col, (ids, scores) in row["items"].items():
            t_ids, t_scores = teacher["items"].get(col, (None, None))
            if row is not teacher and t_ids == ids:
                row["paired"][col] = paired(t_scores, scores, n_boot=2000)
        for col, v in row["metrics"].items():
            tv = teacher["metrics"].get(col)
            if tv is None or col.startswith(("kl ", "top1 ", "route ")):
                continue
            row["vs_teacher"][col] = (v / tv - 1.0) if col.startswith("ppl ") and tv else v - tv
    for row in out:
        del row["items"]
    return {"columns": columns, "rows": out}


def _fmt(col, v, d, p=None):
    if v is None:
        return "-"
    if col.startswith("ppl "):
        s = f"{v:.3f}"
        return s + (f" ({d:+.1%})" if d is not None else "")
    if col.startswith("kl "):
        return f"{v:.5f}"
    s = f"{v:.3f}"
    return s + (f" ({d:+.3f}{'*' if p and p['significant'] else ''})" if d is not None else "")


def render(t: dict) -> str:
    if not t["rows"]:
        return "no eval runs yet (python -m workbench eval ppl|teacher|lm ...)"
    head = ["model", "preset", "budget"] + t["columns"]
    body = [[str(r["model"]), str(r["preset"]), str(r["budget"])] +
            [_fmt(c, r["metrics"].get(c), r["vs_teacher"].get(c), r["paired"].get(c)) for c in t["columns"]]
            for r in t["rows"]]
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(b) for b in body] +
                     ["", "(in brackets: change from the teacher row; ppl relative, accuracies absolute; * where the paired "
                          "95% bootstrap interval over the same items excludes 0)"])
