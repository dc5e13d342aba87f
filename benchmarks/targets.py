"""The speed targets of the designs, measured side by side on one model, disk and budget.

    python benchmarks/targets.py --model demo --budget 0.25 --tokens 64 --rounds 3

Runs `on_demand`, `les`, `smol`, the controls and `resident` in alternating arms (cold O_DIRECT
reads, warm-up first), then checks: les >= 2.5x on_demand tok/s, and les >= 60% of resident.
Writes results/targets.json and results/targets.md (atomically) and prints the table, with the
flash-wait breakdown per token, so a missed target shows where the time goes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.atomic import atomic_write  # noqa: E402
from experiments.ladder import run_ladder, table  # noqa: E402

TARGETS = {"les_over_on_demand": 2.5, "les_over_resident": 0.6}


def breakdown(rows) -> str:
    out = ["| design | tok/s | compute ms/tok | router | dequant | flash wait | other | KB read/tok | floor tok/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n = max(1, r["tokens"] - 1)
        ms = lambda k: f"{1e3 * r[k] / n:.2f}"
        out.append(f"| {r['rung']} | {r['tok_s']:.1f} | {ms('compute_s')} | {ms('router_s')} | {ms('dequant_s')} | "
                   f"{ms('flash_wait_s')} | {ms('other_s')} | {r['bytes_read_per_token'] / 1e3:.0f} | {r['floor_tok_s']:.1f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    a = ap.parse_args(argv)
    res = run_ladder("designs", model=a.model, budget=a.budget, tokens=a.tokens, rounds=a.rounds, progress=print)
    tok = {r["rung"]: r["tok_s"] for r in res["rungs"]}
    got = {"les_over_on_demand": tok["les"] / tok["on_demand"], "les_over_resident": tok["les"] / tok["resident"]}
    res["targets"] = {k: {"target": TARGETS[k], "measured": got[k], "met": got[k] >= TARGETS[k]} for k in TARGETS}
    command = f"python benchmarks/targets.py --model {a.model} --budget {a.budget} --tokens {a.tokens} --rounds {a.rounds}"
    md = "\n".join([f"# Design targets, measured\n\n`{command}`\n", "```", table(res), "```", "",
                    "## Where the time goes (per generated token, median round)\n", breakdown(res["rungs"]), "",
                    "## Targets\n"] +
                   [f"- {k}: measured {v['measured']:.2f}, target {v['target']} — {'met' if v['met'] else 'NOT met'}"
                    for k, v in res["targets"].items()]) + "\n"
    res["command"] = command
    atomic_write(a.out / "targets.json", json.dumps(res, indent=1, default=str) + "\n")
    atomic_write(a.out / "targets.md", md)
    print(md)


if __name__ == "__main__":
    main()
