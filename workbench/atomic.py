"""Atomic writes: a file appears whole under its name or not at all (temp name beside it, fsync, rename).

A writer killed outright (SIGKILL, power loss) cannot remove its temp file; the next write to the same path
removes the temps of writers that are no longer running."""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from contextlib import contextmanager
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_dead_temps(path: Path):
    """Remove `.NAME.<pid>-<thread>.tmp` files beside `path` whose writer process is gone."""
    for t in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = t.name[len(path.name) + 2:].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            t.unlink(missing_ok=True)


@contextmanager
def atomic_path(path):
    """Yield a temp path beside `path` to write. If the block ends without error the temp file is fsynced
    and renamed to `path`; otherwise it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to path atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def replace_dir(src, dst) -> None:
    """Put directory `src` in the place of directory `dst` (which may exist) so that `dst` is always the old
    directory or the new one: Linux's renameat2(RENAME_EXCHANGE) swaps them in one step, then the old one goes.
    Elsewhere (or where the filesystem refuses), two renames, with the old directory kept as DST.old between."""
    import shutil
    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.replace(src, dst)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2") and libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), 2) == 0:
        shutil.rmtree(src)                    # AT_FDCWD = -100, RENAME_EXCHANGE = 2: src now holds the old one
        return
    old = dst.with_name(dst.name + ".old")
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old)
