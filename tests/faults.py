"""A fault-injecting Reader: each preadv of expert bytes asks a plan what to do, so tests can fail a chosen read
with EIO, return a short read, stall past the read timeout, or truncate or replace the pack mid-run.

    with faults(monkeypatch, plan):      # every Session opened inside reads through a FaultyReader
        ...
    plan(call, pos, nbytes, reader) -> None | "eio" | "short" | "stall"   (call counts this reader's preadv calls)
"""
from __future__ import annotations

import errno
import os
import time
from contextlib import contextmanager

from workbench.io import ALIGN, Reader

STALL_S = 3.0


class FaultyReader(Reader):
    plan = staticmethod(lambda call, pos, n, reader: None)

    def _preadv(self, mv, pos: int) -> int:
        with self._lock:
            self.calls = getattr(self, "calls", 0) + 1
            call = self.calls
        what = type(self).plan(call, pos, len(mv), self)
        if what == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if what == "short":            # one block: the reader must ask again for the rest
            mv = mv[:ALIGN]
        if what == "stall":
            time.sleep(STALL_S)
        return super()._preadv(mv, pos)


@contextmanager
def faults(monkeypatch, plan):
    cls = type("Faulty", (FaultyReader,), {"plan": staticmethod(plan)})
    with monkeypatch.context() as m:
        m.setattr("workbench.devices.Reader", cls)      # open_reader builds the real reader from here
        yield cls
