"""What the expert cache costs in memory: peak RSS growth against the budget's bytes.

The slot arena is allocated (and its pages touched) when a Session opens, so "RSS before the cache fills" is
taken as a run of the same design at the smallest budget that runs (one layer's top-k slots): each run is a
fresh process that opens a Session, resets its peak RSS, generates the same tokens and reports that peak, and

    growth = peak RSS at `budget` - peak RSS at the smallest budget,  against  budget bytes - smallest budget bytes
    (medians of alternating pairs: peak RSS varies by a few hundred KB from run to run).

Everything but the cache (weights, KV cache, compiled kernels, read buffers) is the same in both runs and cancels.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss(model: str, preset: str, budget: str, tokens: int = 32) -> dict:
    """{"peak_rss_bytes", "budget_bytes", "arena_bytes"} of one Session, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "experiments.rss", model, preset, budget, str(tokens)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"experiments.rss {model} {preset} {budget}: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def smallest_budget(model: str, preset: str) -> str:
    """One layer's top-k expert slots, in bytes: the least a Session of this design runs with."""
    from runtime.session import open_session
    with open_session(model, preset, budget="all") as s:
        return str(s.spec.top_k * s.slot_bytes)


def growth(model: str = "demo", preset: str = "les", budget: str = "0.25", tokens: int = 32, repeats: int = 3) -> dict:
    """The medians of `repeats` alternating pairs of runs (smallest budget, `budget`)."""
    base = smallest_budget(model, preset)
    runs = [(peak_rss(model, preset, base, tokens), peak_rss(model, preset, budget, tokens)) for _ in range(repeats)]
    small, big = (statistics.median(r[i]["peak_rss_bytes"] for r in runs) for i in (0, 1))
    budget_grew = runs[0][1]["budget_bytes"] - runs[0][0]["budget_bytes"]
    return {"model": model, "preset": preset, "budget": budget, "smallest_budget": base, "tokens": tokens,
            "budget_bytes": runs[0][1]["budget_bytes"], "arena_bytes": runs[0][1]["arena_bytes"], "runs": runs,
            "peak_reset": all(r[i]["peak_reset"] for r in runs for i in (0, 1)), "rss_growth_bytes": big - small, "budget_growth_bytes": budget_grew, "ratio": (big - small) / budget_grew}


def _child(model, preset, budget, tokens):
    """Peak RSS over generation: the peak is reset (Linux clear_refs) once the Session is open, so the load's
    transients (the same at every budget, but noisy) are not in it; the arena, touched at open, is. Where the peak
    cannot be reset (macOS) it is the process's since it started, and "peak_reset" says so."""
    from workbench.host import peak_rss_bytes, reset_peak_rss
    from runtime.session import open_session
    with open_session(model, preset, budget=budget) as s:
        reset = reset_peak_rss()
        s.generate("Once upon a time", tokens=int(tokens))
        arena = s.arena.nbytes if s.arena is not None else 0
        print(json.dumps({"peak_rss_bytes": peak_rss_bytes(), "peak_reset": reset, "budget_bytes": s.budget_bytes,
                          "arena_bytes": arena}))


if __name__ == "__main__":
    _child(*sys.argv[1:])
