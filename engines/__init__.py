"""Engines by name behind one interface (engines/base.py): `engine_class(name)`, `load_engine(name, ...)`.

packed is the default (experts computed from their packed bytes, results/targets.md); numpy is the reference
engine, the correctness oracle. Backends that need another compute framework are imported only when asked
for, so the workbench runs without them.
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


def default_engine(pack) -> str:
    """The packed engine, or the numpy engine for a pack whose experts it cannot compute (a GGUF's own blocks)."""
    return DEFAULT if engine_class(DEFAULT).computes(pack) else "numpy"


def load_engine(name: str, pack, streamer, telemetry, hooks=None, **kw):
    from engines.base import Hooks
    return engine_class(name)(pack, streamer, telemetry, hooks or Hooks(), **kw)


def available() -> list[str]:
    """The engines that can run here: mlx only where `import mlx.core` works (a dashboard's selector)."""
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return ["numpy", "packed"]
    return ["numpy", "packed", "mlx"]
