"""Free against forced text on made checkpoints: on_demand's hit rate (a plain LRU) at fractions of the experts, held
to the real Qwen3-30B-A3B trace's per-layer LRU at the same fraction, and whether the run's text degenerated.

    python benchmarks/forced_text.py --models /tmp/q30/q30-8l.gguf,/tmp/q80/q80-16l.gguf --budgets 0.15,0.25

Each (model, budget, text) is `bench --preset on_demand` in a fresh process, cold. Writes results/forced_text.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench import REAL_TRACE  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402


def bench(model: str, budget: str, tokens: int, free: bool) -> dict:
    cmd = [sys.executable, "-m", "workbench", "bench", "--model", model, "--preset", "on_demand", "--budget", budget,
           "--tokens", str(tokens), "--json", *(["--free"] if free else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def real_lru(fractions) -> dict:
    from experiments.routing_stats import routing_stats
    from experiments.traces import read_trace
    tr = read_trace(ROOT / REAL_TRACE)
    return routing_stats(tr["topk"], tr["meta"]["num_experts"], fractions=tuple(map(float, fractions)))["lru_hit"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="made checkpoints, comma-separated")
    ap.add_argument("--budgets", default="0.15,0.25")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    a = ap.parse_args(argv)
    budgets = a.budgets.split(",")
    real = real_lru(budgets)
    rows = []
    for model in a.models.split(","):
        for b in budgets:
            for free in (False, True):
                r = bench(model, b, a.tokens, free)
                rows.append({"model": Path(model).name, "budget": b, "text": r["text_source"],
                             "hit_rate": r["hit_rate"], "real_lru": real[str(float(b))],
                             "off_by": r["hit_rate"] - real[str(float(b))], **r["text_check"],
                             "sample": r["text"][:80], "random_weights": r["random_weights"]})
                print(rows[-1], flush=True)
    command = f"python benchmarks/forced_text.py --models {a.models} --budgets {a.budgets} --tokens {a.tokens}"
    res = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    atomic_write(a.out / "forced_text.json", json.dumps(res, indent=1))
    lines = ["# Forced text on made checkpoints", "", f"`{command}` ({res['date']}): `bench --preset on_demand` (a "
             "plain LRU), cold, one fresh process each, RANDOM-weight checkpoints; the reference is the real "
             "Qwen3-30B-A3B trace's per-layer LRU hit rate at the same fraction of the experts "
             "(experiments.routing_stats).", "",
             "| model | budget | text | on_demand hit | real trace's LRU | off by | distinct tokens | next-token reuse "
             "| degenerate | text (start) |", "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']} | {r['text'].split(':')[0]} | {r['hit_rate']:.3f} | "
                     f"{r['real_lru']:.3f} | {r['off_by']:+.3f} | {r['distinct_tokens']:.2f} | {r['reuse']:.3f} | "
                     f"{'yes' if r['degenerate'] else 'no'} | {r['sample']!r} |")
    atomic_write(a.out / "forced_text.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
