"""Engine adapters behind one facade: `load_engine(name, pack, streamer, telemetry)`.

numpy is the reference engine. Backends that need another compute framework are imported
here only, lazily, so the workbench runs without them.
"""
from __future__ import annotations

ENGINES = ("numpy", "mlx", "llamacpp")


def load_engine(name: str, pack, streamer, telemetry, **kw):
    if name == "numpy":
        from engines.numpy_engine import NumpyEngine
        return NumpyEngine(pack, streamer, telemetry, **kw)
    from workbench.errors import WorkbenchError
    if name == "mlx":
        try:
            from engines.mlx_engine import MlxEngine
        except ImportError as e:
            raise WorkbenchError(f"--engine mlx: cannot import MLX ({e}); pip install -e '.[mlx]' "
                                 f"(mlx on macOS, mlx[cpu] on Linux)") from None
        return MlxEngine(pack, streamer, telemetry, **kw)
    if name == "llamacpp":      # stock llama.cpp on a GGUF export of the pack (engines/llamacpp_engine.py)
        from engines.llamacpp_engine import LlamaCppEngine
        return LlamaCppEngine(pack, streamer, telemetry, **kw)
    raise WorkbenchError(f"--engine {name!r}: choose one of {', '.join(ENGINES)}")


def available() -> list[str]:
    """The engines that can run here: mlx only where `import mlx.core` works (a dashboard's selector)."""
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return ["numpy"]
    return ["numpy", "mlx"]
