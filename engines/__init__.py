"""Engines by name behind one interface (engines/base.py): `engine_class(name)`, and what one expert costs in an
engine's cache, the slot a budget buys (`slot_bytes`).

packed is the default (experts computed from their packed bytes, results/targets.md), mlx on Apple silicon where
MLX is installed (default_engine); numpy is the reference engine, the correctness oracle. Backends that need
another compute framework are imported only when asked for, so the workbench runs without them.
"""
from __future__ import annotations

import importlib

from workbench.errors import WorkbenchError

DEFAULT = "packed"
ENGINES = {"numpy": "engines.numpy_engine:NumpyEngine",
           "packed": "engines.packed_engine:PackedEngine",   # experts computed from their packed bytes, in slots
           "mlx": "engines.mlx_engine:MlxEngine",
           "llamacpp": "engines.llamacpp_engine:LlamaCppEngine"}   # stock llama.cpp on a GGUF export of the pack


def engine_class(name: str):
    if name not in ENGINES:
        raise WorkbenchError(f"--engine {name!r}: choose one of {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        if name != "mlx":
            raise
        raise WorkbenchError(f"--engine mlx: cannot import MLX ({e}); pip install -e '.[mlx]' "
                             f"(mlx on macOS, mlx[cpu] on Linux)") from None


def default_engine(pack=None) -> str:
    """On Apple silicon with MLX installed, the MLX engine (what a Mac user runs; Edge0 was built on it) for a pack
    whose experts it computes. Else the packed engine, or the numpy engine for a pack whose experts it cannot
    compute (a GGUF's own blocks). No pack (a model not converted yet, a trace's spec): MLX or packed, which
    compute every precision the workbench writes."""
    from workbench.host import apple_silicon
    if apple_silicon() and "mlx" in available() and (pack is None or engine_class("mlx").computes(pack)):
        return "mlx"
    return DEFAULT if pack is None or engine_class(DEFAULT).computes(pack) else "numpy"


def slot_bytes(engine: str | None, model, storage=None) -> int:
    """What one expert costs in `engine`'s expert cache, the budget's unit (Budget.slots turns a budget into slots
    of it): of `model`, a Pack, or a MoESpec with the presets.Storage its pack would be written at (the simulator,
    the trace replay, `info` on a checkpoint). engine None: the default engine (default_engine)."""
    engine = engine or default_engine(model if storage is None else None)
    if storage is not None:             # the format the Session converts the preset's precision to for this engine
        from dataclasses import replace
        from workbench.registry import experts_for
        storage = replace(storage, experts=experts_for(storage.experts, engine))
    return int(engine_class(engine).slot_bytes(model, storage))


def available() -> list[str]:
    """The engines that can run here: mlx only where `import mlx.core` works (a dashboard's selector)."""
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return ["numpy", "packed"]
    return ["numpy", "packed", "mlx"]
