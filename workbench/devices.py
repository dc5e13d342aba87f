"""Device profiles (data/devices/NAME.json) and the emulated reader: this machine's disk made to read like a phone's.

A profile models one read of `size` bytes issued while `depth` reads are in flight (itself included) as

    read_s(size, depth) = latency + size / min(read_bw, peak_bw / depth)

latency: a lone small read's cost; read_bw: what one read streams at alone; peak_bw: what all reads in flight share.
The three numbers (and the queue depth the device saturates at) come with their sources in the profile file.

`EmulatedReader` does every read for real (O_DIRECT, so the bytes and the byte counts are real) and then waits
out whatever the profile says is left, so a read never completes earlier than the device allows. Overlap, queue
depth and read merging then behave as on that device. Reads into slots (the packed engine's) do this in the
GIL-free readers' compiled loop (workbench/slot_reads.py), as the real device's reads do; other reads here.
Everything it produces is labelled emulated.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workbench import slot_reads
from workbench.io import KiB, MiB, Reader
from workbench.errors import WorkbenchError

DEVICES = Path(__file__).resolve().parents[1] / "data" / "devices"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    label: str
    latency_s: float
    read_bw: float            # bytes/s of one read alone
    peak_bw: float            # bytes/s shared by all reads in flight
    queue_depth: int          # reads in flight at which the device saturates (the emulated reader's pool size)
    memory_bytes: int | None = None
    sources: dict | None = None

    def read_s(self, size: int, depth: int = 1) -> float:
        return self.latency_s + size / min(self.read_bw, self.peak_bw / max(1, depth))

    def as_probe(self, sizes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB), depths=(1, 2, 4, 8)) -> dict:
        """The profile in probe_disk's shape (MB/s per size and depth), for the floor and the dashboards."""
        points = [{"size": s, "depth": d, "mb_s": d * s / self.read_s(s, d) / 1e6,
                   "lat_ms_p50": self.read_s(s, d) * 1e3, "lat_ms_p99": self.read_s(s, d) * 1e3, "reads": 0}
                  for s in sizes for d in depths]
        return {"path": f"device:{self.name}", "mode": f"emulated:{self.name}", "points": points,
                "best_mb_s": max(p["mb_s"] for p in points)}

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "emulated": True, "latency_us": self.latency_s * 1e6,
                "read_mb_s": self.read_bw / 1e6, "peak_mb_s": self.peak_bw / 1e6, "queue_depth": self.queue_depth,
                "memory_bytes": self.memory_bytes}


def names() -> list[str]:
    return sorted(p.stem for p in DEVICES.glob("*.json"))


def load(name: str) -> DeviceProfile:
    """A profile by name (a file in data/devices) or by path to a profile file."""
    path = Path(name) if name.endswith(".json") else DEVICES / f"{name}.json"
    if not path.is_file():
        raise WorkbenchError(f"--device {name!r}: no such profile (choose one of {', '.join(names())}, or a .json path)")
    try:
        d = json.loads(path.read_text())
        r = d["read"]
        return DeviceProfile(name=d["name"], label=d["label"], latency_s=r["latency_us"] * 1e-6,
                             read_bw=r["read_mb_s"] * 1e6, peak_bw=r["peak_mb_s"] * 1e6,
                             queue_depth=int(r["queue_depth"]), memory_bytes=d.get("memory_bytes"),
                             sources=d.get("sources"))
    except (ValueError, KeyError, TypeError) as e:
        raise WorkbenchError(f"{path}: not a device profile ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class ServedReads:
    """How this machine's readers served a streaming run's reads (experiments.compute_profile._read_floor): a read
    that starts while `depth` reads are in flight, itself included, takes latency + size / bandwidth, each the
    first entry's for a read alone and the second's beside others. A sleeping reader starts a read wake_s after
    its submit call returns; one that landed a read less than poll_s before polls for the next, and starts the
    first read of a submit wake_polling_s after it (the simulator's reader pool charges these)."""
    wake_s: float
    latency_s: list           # [alone, beside others]
    read_bw: list
    poll_s: float = 0.0
    wake_polling_s: float = 0.0
    name: str = "this-machine-streaming"

    def read_s(self, size: int, depth: int = 1) -> float:
        i = min(depth, len(self.latency_s)) - 1
        return self.latency_s[i] + size / self.read_bw[i]

    def describe(self) -> dict:
        return {"name": self.name, "label": "this machine's readers in a streaming run (the compute profile's "
                "read_floor)", "wake_us": self.wake_s * 1e6, "wake_polling_us": self.wake_polling_s * 1e6,
                "poll_us": self.poll_s * 1e6, "latency_us": [x * 1e6 for x in self.latency_s],
                "read_mb_s": [x / 1e6 for x in self.read_bw]}


@dataclass(frozen=True)
class Slowest:
    """Reads that take the longer of two profiles' times: a device emulated on this machine (real read, then the
    remainder waited) cannot read faster than this machine does."""
    device: DeviceProfile
    floor: DeviceProfile | ServedReads

    def read_s(self, size: int, depth: int = 1) -> float:
        return max(self.device.read_s(size, depth), self.floor.read_s(size, depth))

    def __getattr__(self, name):
        return getattr(self.device, name)

    def describe(self) -> dict:
        return {**self.device.describe(), "floor": self.floor.describe()}


class EmulatedReader(Reader):
    """A Reader whose every read takes at least the profile's time for its size and the reads in flight."""

    def __init__(self, path, profile: DeviceProfile, direct: bool = True, workers: int | None = None):
        super().__init__(path, direct=direct, workers=workers or profile.queue_depth)
        self.profile = profile
        self.mode = f"{self.mode}+emulated:{profile.name}"
        self._flight = threading.Lock()
        self.in_flight = 0
        self.emulated_wait_s = 0.0
        self._late = 100e-6         # how late time.sleep wakes (learned; _wait_until)
        self.log: list[tuple[int, int, float, float]] | None = None   # (bytes, depth, start, end) when a test asks

    def _pread(self, buf, pos: int, need: int) -> int:
        size = sum(b.nbytes for b in buf) if isinstance(buf, list) else len(buf)     # a list: one scattered read
        with self._flight:
            self.in_flight += 1
            depth = self.in_flight
        t0 = time.perf_counter()
        try:
            got = super()._pread(buf, pos, need)
            real = time.perf_counter()
            self._wait_until(t0 + self.profile.read_s(size, depth))
            t1 = time.perf_counter()
        finally:
            with self._flight:
                self.in_flight -= 1
        with self._lock:
            self.emulated_wait_s += max(0.0, t1 - real)          # the remainder waited after the real read
            if self.log is not None:
                self.log.append((size, depth, t0, t1))
        return got

    def emulation(self):
        return slot_reads.emulation(self.profile)

    def _wait_until(self, deadline: float):
        """Sleep, then yield the last stretch: time.sleep wakes late (timer slack, which can be as long as a small
        read's whole profile time, so every emulated read would be that much slower than its profile). The stretch
        yielded is the lateness seen so far, plus 20 us."""
        while (left := deadline - time.perf_counter()) > self._late + 20e-6:
            want = time.perf_counter() + left - self._late - 20e-6
            time.sleep(left - self._late - 20e-6)
            self._late += 0.1 * (max(0.0, time.perf_counter() - want) - self._late)
        while time.perf_counter() < deadline:
            os.sched_yield()        # releases the GIL: another thread may run

    def stats(self) -> dict:
        waited = self._slots.totals()[3] if self._slots is not None else 0.0
        return {**super().stats(), "device": self.profile.describe(), "emulated_wait_s": self.emulated_wait_s + waited}


def open_reader(path, device: str | None = None, direct: bool = True, workers: int | None = None) -> Reader:
    """The real reader, or (device given) the emulated one."""
    if not device:
        return Reader(path, direct=direct, workers=workers)
    return EmulatedReader(path, load(device), direct=direct, workers=workers)
