"""One command registry: each verb of `python -m workbench` is declared once, in the module where it lives.

    @command("bench", "measure decode speed, hits and flash wait", running, bench_flags)
    def cmd_bench(args): ...

The functions after the help add the verb's arguments to its parser. "eval ppl" is the verb ppl of the group
eval (declared with `group`). cli/ (the program) imports the modules that declare verbs, then runs `main`.
Every verb takes --json and then prints one JSON object on stdout; a WorkbenchError (a user can fix it) prints
one line on stderr and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
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


# Each flag that several parsers share, declared once: (argparse keywords). A parser takes them through flags().
FLAGS = {
    "model": dict(default="demo", help="a model: demo, a Hugging Face directory, a pack or a .gguf file "
                                     "(default: %(default)s)"),
    "preset": dict(default="on_demand", help="a design: a preset of workbench.presets (default: %(default)s)"),
    "design": dict(action="append", default=[], metavar="FILE.py:NAME",
                   help="a design of your own (path/to/file.py:Name or package.module:Name: a workbench.designs "
                        "Design, Predictor or Policy), in place of --preset (replay, ladder: beside them); repeatable"),
    "text": dict(default=None, metavar="CORPUS|FILE",
                 help="decode this text, forced token by token (the model's logits and routing computed at every "
                      "step): tinystories, wikitext2 or a text file (default: forced TinyStories validation on a "
                      "made checkpoint, the model's own tokens otherwise)"),
    "free": dict(action="store_true", help="decode the model's own greedy tokens, on a made checkpoint too"),
    "budget": dict(default=None, help="the expert cache: 0.25 (fraction of all experts), 96MiB, or all "
                                      "(default: the preset's)"),
    "engine": dict(default=None, help="numpy | packed | mlx | llamacpp (default: packed, or numpy for a pack it "
                                      "cannot compute: engines.default_engine)"),
    "page_cache": dict(action="store_true", help="buffered reads (labelled page-cache) instead of O_DIRECT"),
    "device": dict(default=None, help="emulate a device's flash (a profile in data/devices); labelled emulated"),
    "tokens": dict(type=int, default=64, help="tokens to generate (default: %(default)s)"),
    "prompt": dict(default="Once upon a time", help="the prompt text (default: %(default)s)"),
    "routing_trace": dict(default=None, metavar="FILE", help="route and predict as recorded in this routing trace"),
    "threads": dict(type=int, default=None, help="the cores the kernels share (default: every core, or one "
                                                 "where one computes faster; llama.cpp: every core)"),
    "set": dict(action="append", default=[], metavar="KNOB=VALUE",
                help="change one of the preset's knobs, by the name a run record's config gives it "
                     "(e.g. routing=prerouter:nolora); repeatable"),
    # a routing trace's window, for the verbs that replay one (simulate, replay): bench's --tokens after these
    "prompt_tokens": dict(type=int, default=4, help="trace rows replayed as the prompt (default: %(default)s)"),
    "skip": dict(type=int, default=0, help="trace rows before the window's first (default: %(default)s)"),
}


def flags(*names: str, **changed):
    """A function that adds the shared flags `names` (FLAGS) to a parser: a verb's flags for @command, or called on
    any argparse parser. changed: {name: default, or a dict of argparse keywords} where a parser differs."""
    def add(p):
        for name in names:
            kw = dict(FLAGS[name])
            if isinstance(changed.get(name), dict):
                kw.update(changed[name])
            elif name in changed:           # another default: the help says which
                kw["default"] = changed[name]
                kw["help"] = re.sub(r"\(default: [^)]*\)$", "(default: %(default)s)", kw.get("help", ""))
            p.add_argument("--" + name.replace("_", "-"), **kw)
        return p
    return add


running = flags("model", "preset", "budget", "engine", "page_cache")     # every verb that runs a model
flash = flags("device")             # the verbs whose reads may emulate a device's flash (workbench.devices)


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
        p.add_argument("--no-convert", action="store_true",
                       help="refuse, instead of writing, a pack the run needs (its size and place are said either way)")
        for flags in c.flags:
            flags(p)
        p.set_defaults(fn=c.run)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.no_convert:         # registry.resolve_pack reads it, in this process and the workers it starts
        os.environ["WORKBENCH_NO_CONVERT"] = "1"
    try:
        args.fn(args)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
