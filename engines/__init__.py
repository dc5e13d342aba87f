"""Engine adapters behind one facade: `load_engine(name, pack, streamer, telemetry)`.

numpy is the reference engine. Backends that need another compute framework are imported
here only, lazily, so the workbench runs without them.
"""
from __future__ import annotations

ENGINES = ("numpy",)


def load_engine(name: str, pack, streamer, telemetry, **kw):
    if name == "numpy":
        from engines.numpy_engine import NumpyEngine
        return NumpyEngine(pack, streamer, telemetry, **kw)
    from workbench.spec import WorkbenchError
    raise WorkbenchError(f"--engine {name!r}: choose one of {', '.join(ENGINES)}")
