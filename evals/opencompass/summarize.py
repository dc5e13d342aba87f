"""An OpenCompass run of eval_workbench.py as a results page: per model and dataset the accuracy, the share of
items whose prediction is an option letter (the parse rate: 100% by construction in ppl mode, the number to
watch in gen mode), and every model paired with the first (the reference) on the same items (evals/paired.py).

    python -m evals.opencompass.summarize runs/opencompass/<time> --out results/opencompass.md [--command "..."]

Reads the run's predictions/<model>/<dataset>.json (OpenCompass writes a dataset cut into parts as
<dataset>_0.json, <dataset>_1.json, ...); runs in the workbench's environment, not OpenCompass's.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from evals.paired import mark, paired
from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError

OPTIONS = set("ABCD")


def predictions(run: Path) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{model: {dataset: [(prediction, gold), ...] in item order}}."""
    out: dict = {}
    for d in sorted((run / "predictions").glob("*/")):
        parts: dict[str, list] = {}
        for f in d.glob("*.json"):
            m = re.fullmatch(r"(.+?)(?:_(\d+))?\.json", f.name)
            parts.setdefault(m.group(1), []).append((int(m.group(2) or 0), f))
        for ds, files in parts.items():
            rows = []
            for _, f in sorted(files):
                data = json.loads(f.read_text(encoding="utf-8"))
                rows += [(str(data[k]["prediction"]).strip(), str(data[k]["gold"]).strip())
                         for k in sorted(data, key=int)]
            out.setdefault(d.name, {})[ds] = rows
    if not out:
        raise WorkbenchError(f"{run}: no predictions/<model>/<dataset>.json (not an OpenCompass work dir?)")
    return out


def summary(run: Path, reference: str | None = None) -> dict:
    preds = predictions(run)
    models = list(preds)
    ref = reference or models[0]
    if ref not in preds:
        raise WorkbenchError(f"{run}: no model {ref!r} (have {', '.join(models)})")
    rows = []
    for model in [ref] + [m for m in models if m != ref]:
        for ds, items in preds[model].items():
            correct = [float(p == g) for p, g in items]
            row = {"model": model, "dataset": ds, "n": len(items), "accuracy": sum(correct) / len(items),
                   "parse_rate": sum(p in OPTIONS for p, _ in items) / len(items)}
            gold = preds[ref].get(ds)
            if model != ref and gold and [g for _, g in gold] == [g for _, g in items]:
                row["paired"] = paired([float(p == g) for p, g in gold], correct)
            rows.append(row)
    return {"run": str(run), "reference": ref, "rows": rows}


def markdown(s: dict, command: str | None) -> str:
    lines = ["# OpenCompass: the workbench server's presets, multiple choice by likelihood", ""]
    if command:
        lines += ["```sh", command, "```", ""]
    lines += [f"From `{s['run']}` (`python -m evals.opencompass.summarize`). OpenCompass 0.5.4, `ppl` mode through "
              "`evals/opencompass/workbench_api.py`: each option scored from the server's prompt log-probabilities, "
              "the lowest mean token loss over context + option wins. Parse rate: the share of items whose prediction "
              f"is an option letter. Paired: each model minus `{s['reference']}` on the same items, 95% bootstrap "
              "interval (`*` when it excludes 0 and the exact sign test on the flips gives p < 0.05), flips "
              "reference-only/model-only.", "",
              "| model | dataset | items | accuracy | parse rate | paired vs reference |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| `{r['model']}` | {r['dataset']} | {r['n']} | {r['accuracy']:.3f} | {r['parse_rate']:.0%} | "
                     f"{mark(r['paired']) if 'paired' in r else '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="an OpenCompass work dir: runs/opencompass/<time>")
    ap.add_argument("--out", default=None, help="write markdown here (and the numbers beside it as .json)")
    ap.add_argument("--reference", default=None, help="the model the others are paired with (default: the first)")
    ap.add_argument("--command", default=None, help="the command that made the run, quoted at the top")
    a = ap.parse_args(argv)
    s = summary(Path(a.run), a.reference)
    md = markdown(s, a.command)
    if a.out:
        atomic_write(Path(a.out).with_suffix(".json"), json.dumps(s, indent=1) + "\n")
        atomic_write(a.out, md)
    print(md)


if __name__ == "__main__":
    import sys
    try:
        main()
    except WorkbenchError as e:                 # a user error: one line, exit code 2 (as the workbench CLI)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
