"""Run records: runs/<utc-time>-<preset>-<id>/ with config, env, summary JSON and Parquet tables.

Written into a temporary directory, every file fsynced, then renamed into place: a reader
never sees half a record.
"""
from __future__ import annotations

import json
import os
import platform
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from workbench import host
from workbench.atomic import atomic_path
from workbench.registry import REPO


def runs_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_RUNS", REPO / "runs"))


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    pkgs = {}
    for name in ("numpy", "pyarrow", "tokenizers", "streamlit", "llama-cpp-python", "mlx", "lm-eval", "torch"):
        try:
            pkgs[name] = version(name)
        except PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"machine": platform.machine(), "system": platform.platform(), "cpu": host.cpu_name(), "cores": os.cpu_count(),
            "python": sys.version.split()[0], "packages": pkgs, "git_commit": commit}


def _write(path: Path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_table(table, path) -> Path:
    """Write a pyarrow table as Parquet atomically."""
    import pyarrow.parquet as pq
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def _parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), sink)
    return sink.getvalue().to_pybytes()


def write_run(preset: str, config: dict, summary: dict, layers: list[dict], events: list[dict],
              tokens: list[dict] | None = None, root: Path | None = None, failed: bool = False) -> Path:
    """failed: the summary goes to failed.json, so readers of finished runs (list_runs) pass the record by."""
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", preset).strip("_")
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{slug}-{secrets.token_hex(3)}"
    dumps = lambda o: (json.dumps(o, indent=1, default=str) + "\n").encode()
    files = {"config.json": dumps(config), "env.json": dumps(environment()),
             ("failed.json" if failed else "summary.json"): dumps(summary),
             "layers.parquet": _parquet(layers), "events.parquet": _parquet(events)}
    if tokens is not None:
        files["tokens.parquet"] = _parquet(tokens)
    return place_run(name, files, root)


def place_run(name: str, files: dict[str, bytes], root: Path | None = None) -> Path:
    """Write a run record given as files (a new one, or a sweep cell's from another machine) under root, atomically."""
    root = root or runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    for fname, data in files.items():
        _write(tmp / fname, data)
    os.replace(tmp, root / name)
    return root / name


def read_run(path) -> dict:
    import pyarrow.parquet as pq
    p = Path(path)
    out = {k: json.loads((p / f"{k}.json").read_text()) for k in ("config", "env", "summary")}
    for k in ("layers", "events", "tokens"):
        if (p / f"{k}.parquet").exists():
            out[k] = pq.read_table(p / f"{k}.parquet").to_pylist()
    return out


def list_runs(root: Path | None = None) -> list[Path]:
    root = root or runs_dir()
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "summary.json").exists())
