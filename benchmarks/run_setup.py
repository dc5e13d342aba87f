"""One run setup: `bench --routing-trace T` against `replay T` on the same window, every design, a few budgets.

    python -m workbench make-model --shape qwen3-30b-a3b --layers 8 --out /tmp/q30/q30-8l.gguf
    python benchmarks/run_setup.py --model /tmp/q30/q30-8l.gguf --out results/run_setup_8l.md

What each design found in memory or in flight under bench (hit + late: real reads, real compute, cold) against
replay's hit rate (every read lands at once), on a made file of the trace's shape driven by the trace (4 prompt
rows, then `--tokens - 1` decode steps). Issue 59's target: within 0.01. Writes FILE.md and FILE.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench import bench  # noqa: E402
from experiments.leaderboard import BUILTIN, FIELD, label  # noqa: E402
from experiments.routing_trace import TraceDrive  # noqa: E402
from experiments.simulate import pack_plan, replay_run  # noqa: E402
from experiments.traces import read_trace  # noqa: E402
from runtime.plan import plan  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.presets import get_preset  # noqa: E402

TRACE = "data/traces/qwen3-30b-a3b-bigmoeonedge.parquet"


def agree(model: str, design: str, budget: str, tokens: int, trace: str, tr: dict) -> dict:
    r = bench(model, design, budget, tokens=tokens, prompt=[1, 2, 3, 4], routing_trace=trace, record=False)
    pl = plan(model, get_preset(design), budget)          # the pack and engine bench ran: its slots and read sizes
    p = pl.preset
    drive = TraceDrive(trace, pl.spec, str(p.prefetch) or None, trace=tr, recall=p.prefetch.recall,
                       params=dict(p.params))
    rep = replay_run(drive, pl.spec, p, budget, tokens, 4, pl.engine, plan=pack_plan(pl.pack, pl.engine)).summary
    found = r["hit_rate"] + r["late_rate"]
    return {"design": design, "budget": budget, "bench_hit_plus_late": found, "bench_late": r["late_rate"],
            "replay_hit": rep.hit_rate, "diff": found - rep.hit_rate, "slots": [r["cache_slots"], rep.memory.cache_slots]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--designs", default=",".join(BUILTIN + FIELD))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", required=True, help="FILE.md (and FILE.json beside it)")
    a = ap.parse_args()
    tr = read_trace(a.trace)
    rows = []
    for d in a.designs.split(","):
        for b in a.budgets.split(","):
            try:
                rows.append(agree(a.model, d, b, a.tokens, a.trace, tr))
            except WorkbenchError as e:         # a design a budget cannot hold (a hot store bigger than it)
                print(f"{label(d)} @{b}: not run: {e}", flush=True)
                continue
            print(json.dumps(rows[-1]), flush=True)
    met = sum(abs(r["diff"]) <= 0.01 for r in rows)
    command = " ".join(["python", "benchmarks/run_setup.py"] + sys.argv[1:])
    md = [f"`{command}`", "", f"{met} of {len(rows)} within 0.01.", "",
          "| design | budget | bench hit + late | of which late | replay hit | difference |", "|---|---|---:|---:|---:|---:|"]
    md += [f"| {label(r['design'])} | {r['budget']} | {r['bench_hit_plus_late']:.4f} | {r['bench_late']:.4f} | "
           f"{r['replay_hit']:.4f} | {r['diff']:+.4f} |" for r in rows]
    out = Path(a.out)
    atomic_write(out.with_suffix(".json"), json.dumps({"command": command, "model": a.model, "trace": a.trace,
                                                       "tokens": a.tokens, "rows": rows}, indent=1))
    atomic_write(out, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
