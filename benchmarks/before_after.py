"""Designs at budgets, this tree against an earlier revision, alternating in one run.

    python benchmarks/before_after.py --rev cd3e45e --model demo --budgets 0.1,0.25,0.5 --designs on_demand,les,smol

Copies REV's tree (`git archive`) under /tmp, then runs `bench --json --no-record` of each (design, budget) in
subprocesses, REV's tree and this one one after the other, --rounds rounds (each run cold: bench's own warm-up
on other text, then an empty cache and the file out of the page cache; with --routing-trace both route as the
trace recorded, so that the two trees are asked for the same experts even where random weights make them generate
different text). Prints, and appends to --out if given,
a table of medians (min-max) of tok/s, achieved / floor and bytes read a token, what the runtime spends beside
compute (router + lookahead a token, issuing a read an expert: from each run's record, events.parquet), and the
checks of issue 52: every design at >= 0.7 of its floor, les >= on_demand and les's bytes <= 1.15x on_demand's at
each budget.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workbench.atomic import atomic_write  # noqa: E402


def tree_of(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(f"/tmp/workbench-before-{sha}")
    if not tree.exists():
        tmp = tree.with_name(tree.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(tree)
    return tree


def bench(tree: Path, model: str, design: str, budget: str, tokens: int, trace: str | None = None,
          threads: int | None = None) -> dict:
    """bench's JSON with its record's issue_s and issued (decode events: the same numbers in either tree), or
    {"error": its last line} where the design cannot run there (a pager whose pools are smaller than a layer's
    top-k)."""
    runs = tempfile.mkdtemp(prefix="before-after-runs-")
    env = {**os.environ, "PYTHONPATH": str(tree), "WORKBENCH_RUNS": runs}
    p = subprocess.run([sys.executable, "-m", "workbench", "bench", "--model", model, "--preset", design, "--budget",
                        budget, "--tokens", str(tokens), "--json"]
                       + (["--routing-trace", str(Path(trace).resolve())] if trace else [])
                       + (["--threads", str(threads)] if threads else []), cwd=tree, env=env,
                       capture_output=True, text=True)
    if p.returncode == 2:
        return {"error": (p.stderr.strip().splitlines() or ["exit 2"])[-1]}
    if p.returncode:
        raise SystemExit(f"{tree}: bench {design} {budget} failed: {p.stderr.strip().splitlines()[-1:]}")
    out = json.loads(p.stdout)
    ev = pq.read_table(next(Path(runs).glob("*/events.parquet")), columns=["phase", "issue_s", "issued"]).to_pylist()
    subprocess.run(["rm", "-rf", runs], check=True)
    ev = [e for e in ev if e["phase"] == "decode"]
    n = max(1, out.get("produced", out["decode_steps"]))
    out["issue_us"] = 1e6 * sum(e["issue_s"] for e in ev) / max(1, sum(e["issued"] for e in ev))
    out["compute_ms"] = 1e3 * out["compute_s"] / n
    out["router_ms"] = 1e3 * out["router_s"] / n
    out["other_ms"] = 1e3 * out["other_s"] / n
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--designs", default="on_demand,les,smol")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--routing-trace", metavar="FILE", help="both trees route as this trace recorded (the same "
                    "experts asked for, whatever text each generates)")
    ap.add_argument("--threads", type=int, default=None, help="bench's --threads (default: the engine's choice)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    trees = {f"before ({a.rev})": tree_of(a.rev), "after": ROOT}
    cells = [(d, b) for b in a.budgets.split(",") for d in a.designs.split(",")]
    got = {(t, d, b): [] for t in trees for d, b in cells}
    loads = []
    failed = {}
    for r in range(a.rounds):
        for d, b in [c for c in cells if c not in failed]:
            for t, tree in trees.items():
                x = bench(tree, a.model, d, b, a.tokens, a.routing_trace, a.threads)
                if "error" in x:
                    failed[(d, b)] = x["error"]
                    print(f"{t} {d} @{b}: {x['error']}")
                    break
                got[(t, d, b)].append(x)
                print(f"round {r + 1}: {t} {d} @{b}: {x['tok_s']:.1f} tok/s, {x['achieved_over_floor']:.2f} of floor",
                      flush=True)
        loads.append(os.getloadavg()[0])
    med = lambda runs, k: statistics.median(x[k] for x in runs)
    span = lambda runs, k: f"{min(x[k] for x in runs):.1f}-{max(x[k] for x in runs):.1f}"
    lines = [f"`python benchmarks/before_after.py --rev {a.rev} --model {a.model} --budgets {a.budgets} --designs "
             f"{a.designs} --tokens {a.tokens} --rounds {a.rounds}"
             + (f" --routing-trace {a.routing_trace}" if a.routing_trace else "")
             + (f" --threads {a.threads}" if a.threads else "") + f"` (load average {min(loads):.1f}-{max(loads):.1f} "
             f"after each round, {os.cpu_count()} cores)\n",
             "| budget | design | tree | tok/s (median, min-max) | of floor | KB read/tok | / on_demand's | "
             "compute ms/tok | router + lookahead ms/tok | other ms/tok | issue us/expert |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    checks = []
    cells = [c for c in cells if c not in failed]
    for d, b in failed:
        lines.append(f"| {b} | {d} | | cannot run: {failed[(d, b)]} | | | | | | | |")
    for d, b in cells:
        for t in trees:
            runs = got[(t, d, b)]
            od = med(got[(t, "on_demand", b)], "bytes_read_per_token") if ("on_demand", b) in cells else None
            kb = med(runs, "bytes_read_per_token")
            lines.append(f"| {b} | {d} | {t} | {med(runs, 'tok_s'):.1f} ({span(runs, 'tok_s')}) | "
                         f"{med(runs, 'achieved_over_floor'):.2f} | {kb / 1e3:.0f} | "
                         f"{'' if not od else f'{kb / od:.2f}'} | {med(runs, 'compute_ms'):.0f} | "
                         f"{med(runs, 'router_ms'):.2f} | "
                         f"{med(runs, 'other_ms'):.2f} | {med(runs, 'issue_us'):.0f} |")
    for t in trees:
        floors = {(d, b): med(got[(t, d, b)], "achieved_over_floor") for d, b in cells}
        worst = min(floors, key=floors.get)
        checks.append(f"- {t}: lowest of floor {floors[worst]:.2f} ({worst[0]} @{worst[1]}; target >= 0.7)")
        if all(("les", b) in cells and ("on_demand", b) in cells for b in a.budgets.split(",")):
            for b in a.budgets.split(","):
                les, od = got[(t, "les", b)], got[(t, "on_demand", b)]
                checks.append(f"  - @{b}: les / on_demand tok/s {med(les, 'tok_s') / med(od, 'tok_s'):.2f} "
                              f"(target >= 1), bytes {med(les, 'bytes_read_per_token') / med(od, 'bytes_read_per_token'):.2f}"
                              f" (target <= 1.15)")
    text = "\n".join(lines + [""] + checks) + "\n"
    print(text)
    if a.out:
        atomic_write(a.out, (a.out.read_text() if a.out.exists() else "") + text)


if __name__ == "__main__":
    main()
