"""Booth rounds, shared: every session that shows the same program (the booth screen, a visitor's phone) sees the
same runs, so a second viewer starts no second set of processes. A round starts a few seconds after the last one
ended, and only while someone watches: each viewing session ticks its program's loop.
"""
from __future__ import annotations

import threading
import time

from dashboards import common as C
from workbench.errors import WorkbenchError

_LOOPS: dict[tuple, "Loop"] = {}
_LOCK = threading.Lock()
KEEP = 32           # programs remembered; past that, the idle ones are forgotten (a URL can name many)


class Loop:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.round = -1                 # the round on show (-1: none yet)
        self.run_ids: list[str] = []
        self.done_at: float | None = None
        self.paused = False
        self.waiting: str | None = None   # why the next round has not started (the machine's runs are at the cap)
        self.lock = threading.Lock()

    def runs(self) -> list[C.DesignRun]:
        return C.get_runs(self.run_ids)

    def tick(self, now: float | None = None) -> bool:
        """Start the next round when it is due; True when one started."""
        now = time.time() if now is None else now
        with self.lock:
            runs = self.runs()
            if self.paused or any(r.active for r in runs):
                return False
            if runs and self.done_at is None:
                self.done_at = now
            if runs and now - self.done_at < self.cfg["pause"]:
                return False
            return self._next()

    def _next(self) -> bool:
        cfg = self.cfg
        prompt, designs = C.booth_round(self.round + 1, cfg["model"])
        designs, lever = cfg["designs"] or designs, cfg.get("lever")
        try:
            # beside a lever each design runs twice and the teacher judges both: two designs a round
            ids = C.start_runs(cfg["model"], designs[:2] if lever else designs, "0.25", prompt,
                               cfg["tokens"], cfg["device"], cfg["routing_trace"], lever=lever)
        except WorkbenchError as e:
            self.waiting = str(e)
            return False
        self.round, self.run_ids, self.done_at, self.waiting = self.round + 1, ids, None, None
        return True

    def stop(self):
        """A visitor's Stop: the round ends and no next one starts until Start."""
        with self.lock:
            self.paused = True
            C.stop_runs(self.run_ids)

    def start(self) -> bool:
        """A visitor's Start: the next round now, unless one is running."""
        with self.lock:
            self.paused = False
            if any(r.active and not r.stopping for r in self.runs()):
                return False
            return self._next()


def loop(cfg: dict) -> Loop:
    key = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(cfg.items()))
    with _LOCK:
        if key not in _LOOPS and len(_LOOPS) >= KEEP:
            for k in [k for k, lp in _LOOPS.items() if not any(r.active for r in lp.runs())]:
                del _LOOPS[k]
        return _LOOPS.setdefault(key, Loop(cfg))


def reset():
    """Forget every loop and stop its runs (tests)."""
    with _LOCK:
        for lp in _LOOPS.values():
            C.stop_runs(lp.run_ids)
        _LOOPS.clear()
