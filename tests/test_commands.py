"""One command registry (workbench/commands.py): each verb is declared once, in the module where it lives, and
no module reaches into another's argument parser."""
from __future__ import annotations

import ast

import pytest

import cli  # noqa: F401  the program: importing it declares every verb
from test_layering import modules
from workbench.commands import COMMANDS, command, parser


def test_every_verb_is_declared_where_it_lives():
    where = {name: c.run.__module__ for name, c in COMMANDS.items()}
    assert where == {
        "info": "runtime.verbs", "convert": "runtime.verbs", "probe-disk": "runtime.verbs",
        "make-model": "runtime.verbs", "generate": "runtime.verbs", "bench": "experiments.cli",
        "ladder": "experiments.cli", "trace": "experiments.cli", "import-trace": "experiments.cli",
        "replay": "experiments.cli", "simulate": "experiments.cli", "bench-peer": "experiments.cli",
        "routing-stats": "experiments.cli", "leaderboard": "experiments.cli",
        "eval ppl": "evals.cli", "eval teacher": "evals.cli", "eval lm": "evals.cli", "eval compare": "evals.cli",
        "eval report": "evals.cli", "serve": "evals.cli", "sweep": "evals.sweep",
        "export-gguf": "engines.llamacpp_cli"}
    args = parser().parse_args(["ladder", "edge0", "--chunks", "2"])     # one ladder verb, every ladder's flags
    assert (args.name, args.chunks, args.fn) == ("edge0", 2, COMMANDS["ladder"].run)


def test_a_verb_declared_twice_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        command("info", "again")(lambda args: None)


def test_no_module_reaches_into_a_parser():
    """argparse's private fields, handlers replaced after the fact, parsers built outside the registry."""
    bad = []
    for name, path in modules().items():
        if name == "workbench.commands":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_actions", "add_subparsers", "get_default"):
                bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, bad
