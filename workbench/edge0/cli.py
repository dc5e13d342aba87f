"""CLI hook: `python -m workbench ladder edge0 ...` (registered from workbench/cli.py with one line).

If a `ladder` verb already exists (the designs' ladders), "edge0" is added to its choices and its handler
dispatches edge0 here; otherwise a `ladder` verb with the single choice edge0 is created.
"""
from __future__ import annotations

import json


def cmd_ladder_edge0(args):
    from workbench.edge0.ladder import run_edge0, table
    res = run_edge0(args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds, chunks=args.chunks,
                    chunk_tokens=args.chunk_tokens, skip_layers=args.skip_layers,
                    progress=None if args.json else print, record=not getattr(args, "no_record", False))
    if args.json:
        from workbench.cli import _jsonable
        print(json.dumps(res, default=_jsonable))
    else:
        print(table(res))


def register(sub, verb):
    p = sub.choices.get("ladder")
    if p is None:
        p = verb("ladder", cmd_ladder_edge0, "a design's ablation ladder (edge0: quality rungs, recall, speed A/B)")
        p.add_argument("name", choices=["edge0"])
        p.add_argument("--model", default="demo")
        p.add_argument("--budget", default="0.25")
        p.add_argument("--tokens", type=int, default=48)
        p.add_argument("--rounds", type=int, default=3)
        other = None
    else:
        for act in p._actions:
            if act.dest == "name" and act.choices is not None and "edge0" not in act.choices:
                act.choices = list(act.choices) + ["edge0"]
        other = p.get_default("fn")
    p.add_argument("--chunks", type=int, default=4, help="edge0: held-out chunks for the quality rungs")
    p.add_argument("--chunk-tokens", type=int, default=256, help="edge0: tokens per held-out chunk")
    p.add_argument("--skip-layers", type=int, default=None, help="edge0: MoE layers routed exactly (default: the heads')")
    p.set_defaults(fn=lambda args: cmd_ladder_edge0(args) if args.name == "edge0" else other(args))
