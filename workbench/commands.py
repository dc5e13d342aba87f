"""One command registry: each verb of `python -m workbench` is declared once, in the module where it lives.

    @command("bench", "measure decode speed, hits and flash wait", running, bench_flags)
    def cmd_bench(args): ...

The functions after the help add the verb's arguments to its parser. "eval ppl" is the verb ppl of the group
eval (declared with `group`). workbench/cli.py imports the modules that declare verbs, then runs `main`.
Every verb takes --json and then prints one JSON object on stdout; a WorkbenchError (a user can fix it) prints
one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable

from workbench.errors import WorkbenchError


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable
    flags: tuple


COMMANDS: dict[str, Command] = {}
GROUPS: dict[str, str] = {}


def command(name: str, help: str, *flags: Callable):
    def declare(run):
        if name in COMMANDS:
            raise ValueError(f"verb {name!r} is declared twice")
        COMMANDS[name] = Command(name, help, run, flags)
        return run
    return declare


def group(name: str, help: str):
    GROUPS[name] = help


def running(p):
    """The flags of every verb that runs a model."""
    p.add_argument("--model", default="demo")
    p.add_argument("--preset", default="on_demand")
    p.add_argument("--budget", default=None, help="0.25 (fraction of all experts), 96MiB, or all")
    p.add_argument("--engine", default=None)   # None: packed, or numpy for packs it cannot compute (engines.default_engine)
    p.add_argument("--page-cache", action="store_true", help="buffered reads (labelled page-cache) instead of O_DIRECT")
    p.add_argument("--threads", type=int, default=None, help="the cores the kernels share (default: every core)")
    return p


def flash(p):
    """The flag of the verbs whose reads may emulate a device's flash (workbench.devices)."""
    p.add_argument("--device", default=None, help="emulate a device's flash (a profile in data/devices); labelled emulated")
    return p


def emit(args, obj: dict, human: str):
    """The verb's result: one JSON object with --json, else the human-readable text."""
    print(json.dumps(obj, default=jsonable) if args.json else human)


def jsonable(o):
    import numpy as np
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench", description="MoE expert-streaming workbench")
    sub = ap.add_subparsers(dest="verb", required=True)
    groups = {}
    for c in COMMANDS.values():
        head, _, verb = c.name.partition(" ")
        if verb and head not in groups:
            groups[head] = sub.add_parser(head, help=GROUPS[head]).add_subparsers(dest=f"{head}_verb", required=True)
        p = (groups[head] if verb else sub).add_parser(verb or head, help=c.help)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        for flags in c.flags:
            flags(p)
        p.set_defaults(fn=c.run)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
