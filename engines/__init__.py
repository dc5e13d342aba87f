"""Engines by name behind one interface (engines/base.py): `engine_class(name)`, `load_engine(name, ...)`.

numpy is the reference engine. Backends that need another compute framework are imported only when asked
for, so the workbench runs without them.
"""
from __future__ import annotations

import importlib

from workbench.errors import WorkbenchError

ENGINES = {"numpy": "engines.numpy_engine:NumpyEngine",
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


def load_engine(name: str, pack, streamer, telemetry, hooks=None, **kw):
    from engines.base import Hooks
    return engine_class(name)(pack, streamer, telemetry, hooks or Hooks(), **kw)


def available() -> list[str]:
    """The engines that can run here: mlx only where `import mlx.core` works (a dashboard's selector)."""
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return ["numpy"]
    return ["numpy", "mlx"]
