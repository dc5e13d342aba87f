"""A fault-injecting Reader: each preadv of expert bytes asks a plan what to do, so tests can fail a chosen read
with EIO, return a short read, stall past the read timeout, or truncate or replace the pack mid-run.

    with faults(monkeypatch, plan):      # every Session opened inside reads through a FaultyReader
        ...
    plan(call, pos, nbytes, reader) -> None | "eio" | "short" | "stall"   (call counts this reader's preadv calls)

A sweep cell runs in a Ray worker, where no monkeypatch reaches: `eio_in_workers(offset)` is the runtime_env
under which every worker's Sessions fail each read at or past `offset` with EIO (eio_from_env, its setup hook).
"""
from __future__ import annotations

import errno
import os
import time
from contextlib import contextmanager
from pathlib import Path

from workbench.io import ALIGN, Reader

STALL_S = 3.0


class FaultyReader(Reader):
    plan = staticmethod(lambda call, pos, n, reader: None)

    def _preadv(self, views, pos: int) -> int:
        with self._lock:
            self.calls = getattr(self, "calls", 0) + 1
            call = self.calls
        what = type(self).plan(call, pos, sum(len(v) for v in views), self)
        if what == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if what == "short":            # one block: the reader must ask again for the rest
            views = [views[0][:ALIGN]]
        if what == "stall":
            time.sleep(STALL_S)
        return super()._preadv(views, pos)


@contextmanager
def faults(monkeypatch, plan):
    cls = type("Faulty", (FaultyReader,), {"plan": staticmethod(plan)})
    with monkeypatch.context() as m:
        m.setattr("workbench.devices.Reader", cls)      # open_reader builds the real reader from here
        yield cls


def eio_from_env():
    """Ray's worker_process_setup_hook: this worker's Sessions fail every read at or past $FAULT_EIO_FROM."""
    import workbench.devices
    start = int(os.environ["FAULT_EIO_FROM"])
    workbench.devices.Reader = type("Faulty", (FaultyReader,), {
        "plan": staticmethod(lambda call, pos, n, reader: "eio" if pos >= start else None)})


def eio_in_workers(offset: int) -> dict:
    here = Path(__file__).resolve().parent
    return {"worker_process_setup_hook": "faults.eio_from_env",
            "env_vars": {"FAULT_EIO_FROM": str(offset), "PYTHONPATH": f"{here.parent}{os.pathsep}{here}"}}
