"""Sweeps with eval cells: the eval verbs as the quality cells of a sweep (experiments.sweep), and the verb

    python -m workbench sweep benchmarks/grids/demo_budgets.yaml [--address ADDR] [--out results/X.md] [--json]

The grid file and its cells are experiments.grid's; the Ray driver is experiments.sweep's. The evals sit above
the experiments, so the eval kinds' runners are given to the driver from here (RUNNERS).
"""
from __future__ import annotations

from experiments.grid import Cell, Runner
from workbench.commands import command, emit


def _text_kw(cell: Cell) -> dict:
    return dict(data=cell.get("data"), n_ctx=cell.get("ctx"), chunks=cell.get("chunks"))


def run_ppl(cell: Cell) -> dict:
    from evals.ppl import run
    return run(cell.model, cell.preset_obj(), cell.budget, **_text_kw(cell), progress=False, engine=cell.engine,
               direct=not cell.get("page_cache"))


def run_teacher(cell: Cell) -> dict:
    from evals.teacher import run
    return run(cell.model, cell.preset_obj(), cell.budget, **_text_kw(cell), progress=False, engine=cell.engine,
               direct=not cell.get("page_cache"))


def run_lm(cell: Cell) -> dict:
    """Per-item scores kept: `eval report` and `eval compare` pair presets with the teacher by them."""
    from evals.lm import run
    return run(cell.model, cell.preset_obj(), cell.budget, tasks=cell.task, limit=cell.get("limit"), progress=False,
               engine=cell.engine, direct=not cell.get("page_cache"), per_item=True)


def lm_columns(summary: dict) -> dict:
    """One column per task: its primary metric (lambada_openai acc, arc_easy acc_norm, ...)."""
    from evals.lm import primaries
    return {p.column: p.value for p in primaries(summary.get("results")).values()}


RUNNERS = {"eval ppl": Runner(run_ppl), "eval teacher": Runner(run_teacher), "eval lm": Runner(run_lm, lm_columns)}


def _sweep_flags(p):
    p.add_argument("grid", help="the grid file (YAML): models, cells, axes; see experiments/grid.py")
    p.add_argument("--address", default=None, help="a Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None,
                   help="also write this Markdown table and the sweep table beside it (.parquet)")


@command("sweep", "a grid of bench and eval cells on Ray (local, or a cluster with --address)", _sweep_flags)
def cmd_sweep(args):
    import os
    from pathlib import Path

    from experiments.grid import load_grid
    from experiments.sweep import markdown, run_grid, text
    from workbench.atomic import atomic_write
    grid = load_grid(args.grid)
    res = run_grid(grid, RUNNERS, address=args.address or os.environ.get("RAY_ADDRESS"), progress=not args.quiet)
    if args.out:
        out = Path(args.out)
        atomic_write(out.with_suffix(".parquet"), Path(res["table"]).read_bytes())
        atomic_write(out, markdown({**res, "table": str(out.with_suffix(".parquet"))},
                                   f"python -m workbench sweep {args.grid} --out {args.out}"))
    emit(args, res, text(res))
