"""Eval run records side by side, each preset against the teacher.

Reads every run record whose config has an "eval" key (ppl, teacher, lm, written by the eval verbs),
keeps the newest per (model, preset, budget, metric column), and tabulates one row per
(model, preset, budget). Columns name their setting: "ppl tinystories/512" (data/ctx),
"kl ..."/"top1 ..."/"route ..." for teacher comparisons, "<task> acc" for lm-eval.
"""
from __future__ import annotations

import json
from pathlib import Path

from evals.common import PRESET_ORDER
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


def metrics_of(run: dict) -> dict:
    c, s = run["config"], run["summary"]
    tag = f"{c.get('data')}/{c.get('ctx')}" + (f"/s{c['stride']}" if c.get("stride") else "")
    if run["eval"] == "ppl":
        return {f"ppl {tag}": s.get("ppl")}
    if run["eval"] == "teacher":
        return {f"kl {tag}": s.get("kl"), f"top1 {tag}": s.get("top1"), f"route {tag}": s.get("routing_agreement_mean"),
                f"ppl {tag}": s.get("ppl")}
    if run["eval"] == "lm":
        from evals.lm import primary
        out = {}
        for task, m in (s.get("results") or {}).items():
            name, v, _ = primary({f"{k},none": x for k, x in m.items()})
            if name:
                out[f"{task.removesuffix('_local')} {name}"] = v
        return out
    return {}


def table(runs: list[dict]) -> dict:
    rows: dict[tuple, dict] = {}
    columns: list[str] = []
    for r in runs:                                       # oldest first: newer values overwrite
        key = (r["model"], r["preset"], r["budget"])
        row = rows.setdefault(key, {"model": r["model"], "preset": r["preset"], "budget": r["budget"], "metrics": {},
                                    "runs": {}})
        for col, v in metrics_of(r).items():
            if v is None:
                continue
            if col not in columns:
                columns.append(col)
            row["metrics"][col] = v
            row["runs"][col] = r["name"]
    order = {p: i for i, p in enumerate(PRESET_ORDER)}
    out = sorted(rows.values(), key=lambda x: (str(x["model"]), order.get(x["preset"], 99), str(x["preset"]),
                                               str(x["budget"])))
    for row in out:
        teacher = next((t for t in out if t["model"] == row["model"] and t["preset"] == "teacher"), None)
        row["vs_teacher"] = {}
        if teacher is None:
            continue
        for col, v in row["metrics"].items():
            tv = teacher["metrics"].get(col)
            if tv is None or col.startswith(("kl ", "top1 ", "route ")):
                continue
            row["vs_teacher"][col] = (v / tv - 1.0) if col.startswith("ppl ") and tv else v - tv
    return {"columns": columns, "rows": out}


def _fmt(col, v, d):
    if v is None:
        return "-"
    if col.startswith("ppl "):
        s = f"{v:.3f}"
        return s + (f" ({d:+.1%})" if d is not None else "")
    if col.startswith("kl "):
        return f"{v:.5f}"
    s = f"{v:.3f}"
    return s + (f" ({d:+.3f})" if d is not None else "")


def render(t: dict) -> str:
    if not t["rows"]:
        return "no eval runs yet (python -m workbench eval ppl|teacher|lm ...)"
    head = ["model", "preset", "budget"] + t["columns"]
    body = [[str(r["model"]), str(r["preset"]), str(r["budget"])] +
            [_fmt(c, r["metrics"].get(c), r["vs_teacher"].get(c)) for c in t["columns"]] for r in t["rows"]]
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(b) for b in body] +
                     ["", "(in brackets: change from the teacher row; ppl relative, accuracies absolute)"])
