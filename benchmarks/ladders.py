"""The ablation ladders on one model, written to results/ladders.{json,md} with the command that made them.

    python benchmarks/ladders.py --model demo --budget 0.25 --tokens 48 --rounds 3 [--only les,smol,cache]

A ladder left out of --only keeps its last measurement in both files, with the command that made it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.atomic import atomic_write  # noqa: E402
from workbench.commands import flags  # noqa: E402
from experiments.ladder import run_ladder, table  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags("model", "budget", "tokens", budget="0.25", tokens=48)(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="les,smol,cache")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    a = ap.parse_args(argv)
    command = (f"python benchmarks/ladders.py --model {a.model} --budget {a.budget} --tokens {a.tokens} "
               f"--rounds {a.rounds} --only {a.only}")
    # the ladders not run now keep their last measurement, each with the command that made it
    path = a.out / "ladders.json"
    last = json.loads(path.read_text()) if path.exists() else {"ladders": {}}
    kept = {n: {**r, "command": r.get("command", last.get("command"))} for n, r in last["ladders"].items()}
    for name in a.only.split(","):
        kept[name] = {**run_ladder(name, model=a.model, budget=a.budget, tokens=a.tokens, rounds=a.rounds,
                                   progress=print), "command": command}
    out, md = {"ladders": kept}, ["# Ablation ladders, measured\n"]
    for name, res in kept.items():
        md += [f"## {name}\n", f"`{res['command']}`\n", "```", table(res), "```", ""]
        if name == "smol":
            md += ["Bias sweep: miss rate and perplexity on held-out TinyStories (teacher-forced decode, so the "
                   "cache and the bias evolve as in generation):\n", "| rung | held-out miss rate | held-out ppl |",
                   "|---|---:|---:|"]
            md += [f"| {r['rung']} | {r['heldout_miss_rate']:.3f} | {r['heldout_ppl']:.3f} |" for r in res["rungs"]
                   if r.get("heldout_ppl")]
            md.append("")
    atomic_write(a.out / "ladders.json", json.dumps(out, indent=1, default=str) + "\n")
    atomic_write(a.out / "ladders.md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
