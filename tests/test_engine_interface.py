"""The engine interface (engines/base.py): engines own their position and token index, take their hooks at
construction, and declare what they can do; nothing outside engines/ sets an engine's state."""
from __future__ import annotations

import ast

import numpy as np
import pytest

from engines import ENGINES, engine_class
from engines.base import Engine, Hooks
from test_layering import modules
from workbench.errors import WorkbenchError
from runtime.session import open_session


def test_every_engine_is_an_engine():
    for name in ENGINES:
        try:
            cls = engine_class(name)
        except WorkbenchError:          # mlx where it is not installed
            continue
        assert issubclass(cls, Engine) and cls.name == name


def test_the_engine_counts_its_own_token_index(tiny_models):
    with open_session(str(tiny_models["qwen3_moe"]), "resident") as s:
        e = s.engine
        e.reset()
        logits = e.prefill([5, 9, 33])
        assert (e.pos, e.token_index) == (3, 0)
        e.decode([int(np.argmax(logits[-1]))])
        e.decode([7, 8, 9])                     # a token and two drafts to verify
        assert (e.pos, e.token_index) == (7, 2)
        e.truncate(5)                           # one draft accepted
        e.decode([4])
        assert (e.pos, e.token_index) == (6, 3)


def test_an_engine_without_hooks_refuses_them(tiny_models):
    """The llama.cpp engine routes inside llama.cpp: handed a predictor it says so, before exporting anything."""
    cls = engine_class("llamacpp")
    assert not cls.takes_hooks
    with open_session(str(tiny_models["qwen3_moe"]), "resident") as s:
        with pytest.raises(WorkbenchError, match="takes no predictor"):
            cls(s.pack, s.streamer, s.tel, Hooks(predictor=object()))
    for preset in ("les", "smol_bias", "edge0"):     # a session says so before building hooks it would refuse
        with pytest.raises(WorkbenchError, match="takes no predictor"):
            open_session(str(tiny_models["qwen3_moe"]), preset, engine="llamacpp")


def test_nothing_outside_engines_sets_engine_state():
    """No `<...>.engine.X = ...` or `engine.X = ...` anywhere but engines/ (hooks go in at construction)."""
    bad = []
    for name, path in modules().items():
        if name.startswith("engines"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for a in ast.walk(t):
                    if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store):
                        v = a.value
                        if (isinstance(v, ast.Name) and v.id in ("engine", "eng", "e")) or \
                                (isinstance(v, ast.Attribute) and v.attr == "engine"):
                            bad.append(f"{path.relative_to(path.parents[1])}:{node.lineno}")
    assert not bad, bad
