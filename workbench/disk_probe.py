"""Disk probing, in one place: what the disk under a path delivers and what this machine's reads cost now.

    probe_disk      random-read MB/s and latency per read size and queue depth (tight loops of preads)
    probe           probe_disk of the pack directory's disk, cached per device (the floor's, probe-disk's)
    bandwidth_at    a probe's bytes/s at a read size and queue depth
    profile_from_probe  a device profile file's content fitted to a probe (probe-disk --save-device)
    probe_reader    this machine as the engine's reader pool sees it now, as a DeviceProfile

MB here is 10**6 bytes.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from workbench.atomic import atomic_write
from workbench.devices import DeviceProfile
from workbench.errors import WorkbenchError
from workbench.io import ALIGN, KiB, MiB, Reader, aligned_empty
from workbench.registry import cache_dir


SCRATCH_BYTES = 64 * MiB


def _write_scratch(directory: str) -> str:
    fd, path = tempfile.mkstemp(prefix=".probe-", dir=directory)
    try:
        rng = np.random.default_rng()
        for _ in range(SCRATCH_BYTES // (4 * MiB)):
            os.write(fd, rng.bytes(4 * MiB))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path



def _probe_point(reader: Reader, file_size: int, size: int, depth: int, seconds: float) -> dict:
    blocks = (file_size - size) // ALIGN + 1
    lat = [[] for _ in range(depth)]

    def worker(i):
        rnd = random.Random()
        buf = aligned_empty(size)
        deadline = time.perf_counter() + seconds
        while True:  # at least one read, however small the budget
            t0 = time.perf_counter()
            reader._pread(buf, rnd.randrange(blocks) * ALIGN, size)
            t1 = time.perf_counter()
            lat[i].append(t1 - t0)
            if t1 >= deadline:
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ms = np.concatenate([np.asarray(x) for x in lat]) * 1e3
    return {"size": size, "depth": depth, "mb_s": len(ms) * size / elapsed / 1e6,
            "lat_ms_p50": float(np.percentile(ms, 50)), "lat_ms_p99": float(np.percentile(ms, 99)),
            "reads": len(ms)}



def probe_disk(path, sizes=(4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB), depths=(1, 2, 4, 8),
               seconds_per_point: float = 0.3, direct: bool = True) -> dict:
    """Random-read throughput and latency of the disk holding `path`.

    Reads `path` itself if it is a file of at least 64 MiB, else a temporary
    64 MiB scratch file written next to it (deleted afterwards).  Each point runs
    `depth` threads of random aligned reads of `size` bytes for the time budget.
    """
    path = os.fspath(path)
    scratch = None
    if os.path.isfile(path) and os.path.getsize(path) >= SCRATCH_BYTES:
        target = path
    else:
        scratch = target = _write_scratch(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    try:
        with Reader(target, direct=direct) as reader:
            if reader.cache == "page-cache":
                reader.drop_cache()  # start cold; buffered reads still warm up as they go
            file_size = os.path.getsize(target)
            points = [_probe_point(reader, file_size, size, depth, seconds_per_point)
                      for size in sizes if size <= file_size for depth in depths]
            mode = reader.mode
    finally:
        if scratch:
            os.unlink(scratch)
    return {"path": path, "mode": mode, "points": points,
            "best_mb_s": max((p["mb_s"] for p in points), default=0.0)}



def probe(path=None, seconds_per_point: float = 0.3, refresh: bool = False) -> dict:
    target = Path(path) if path else cache_dir() / "packs"
    target.mkdir(parents=True, exist_ok=True) if not target.exists() and not target.suffix else None
    dev = os.stat(target).st_dev
    saved = cache_dir() / "probes" / f"dev-{dev}.json"
    if saved.exists() and not refresh:
        return json.loads(saved.read_text())
    res = probe_disk(target, seconds_per_point=seconds_per_point)
    atomic_write(saved, json.dumps(res))
    return res



def bandwidth_at(probe: dict, size: int, depth: int | None = None) -> float:
    """Bytes/s for reads of `size` at most `depth` in flight (None: any): at each probed size the best depth up to
    `depth` (the lowest probed if none is that low), interpolated linearly in log size between the probed sizes
    around `size` (the nearest one outside them)."""
    points = probe["points"]
    if not points:
        raise ValueError("probe has no points")
    best = {}
    for sz in {p["size"] for p in points}:
        at = [p for p in points if p["size"] == sz]
        if depth is not None:
            at = [p for p in at if p["depth"] <= depth] or [min(at, key=lambda p: p["depth"])]
        best[sz] = max(p["mb_s"] for p in at) * 1e6
    sizes = sorted(best)
    return float(np.interp(np.log(size), np.log(sizes), [best[s] for s in sizes]))



def profile_from_probe(probe: dict, name: str, label: str) -> dict:
    """A profile file's content fitted to a probe_disk result: latency from the smallest lone read,
    read_bw from the largest lone read, peak_bw and queue depth from the best point."""
    pts = probe["points"]
    lone = sorted((p for p in pts if p["depth"] == 1), key=lambda p: p["size"])
    if not lone:
        raise WorkbenchError("the probe has no queue-depth-1 points to fit a profile to")
    read_bw = lone[-1]["mb_s"] * 1e6
    latency = max(0.0, lone[0]["lat_ms_p50"] * 1e-3 - lone[0]["size"] / read_bw)
    best = max(pts, key=lambda p: p["mb_s"])
    src = f"probe-disk ({probe['mode']}) of {probe['path']} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    return {"name": name, "label": label,
            "read": {"latency_us": round(latency * 1e6, 1), "read_mb_s": round(read_bw / 1e6, 1),
                     "peak_mb_s": round(best["mb_s"], 1), "queue_depth": best["depth"]},
            "sources": {"latency_us": f"{src}: p50 of {lone[0]['size']} B reads at depth 1 less their transfer time",
                        "read_mb_s": f"{src}: {lone[-1]['size']} B reads at depth 1",
                        "peak_mb_s": f"{src}: best point ({best['size']} B, depth {best['depth']})",
                        "queue_depth": f"{src}: depth of the best point"},
            "probe": probe}



def probe_reader(path, workers: int = 1, sizes=(16 * KiB, 64 * KiB, 256 * KiB), reads: int = 64,
                 direct: bool = True) -> DeviceProfile:
    """This machine as the engine's reader sees it now: one read at a time into an aligned buffer through a Reader
    pool (submit_into, as the packed engine reads into its slots: the GIL-free readers where they run; wait for it),
    random aligned offsets in `path`, the median time per size, fitted to latency + size / bandwidth; alternating with
    one read per reader at once, whose times give the bandwidth the readers share (peak_bw; at most workers x a
    single read's).
    Under a shared, loaded machine this is slower than probe-disk's tight loops (thread wake-ups, other I/O).

    Where the GIL-free readers stamp when a read landed, a read's time is from its submit to that stamp (the
    reader's wake-up and the transfer), and the rest, until the waiting thread has it, is that thread's wake-up:
    sources["wake_s"] (its median), which the simulator charges once per wait that blocks
    (experiments/compute_profile.py ComputeProfile.wake_s), not once per read."""
    size_of = os.path.getsize(path)
    pts, wakes, together = [], [], []
    with Reader(path, direct=direct, workers=workers) as r:
        rnd = random.Random(0)
        for size in sizes:
            ts, tw = [], []
            bufs = [aligned_empty(size) for _ in range(workers)]
            for i in range(reads):
                n = 1 if i % 2 == 0 or workers == 1 else workers    # alternately one read, and one per reader
                offs = [rnd.randrange(max(1, (size_of - size) // 4096)) * 4096 for _ in range(n)]
                t0 = time.perf_counter_ns()
                futs = r.submit_into([(j, [(off, bufs[j])]) for j, off in enumerate(offs)])
                for f in futs.values():
                    f.result()
                seen = time.perf_counter_ns()
                landed = max(getattr(f, "t_end", 0) or seen for f in futs.values())   # no stamp: all of it is the read
                (ts if n == 1 else tw).append((landed - t0) / 1e9)
                wakes.append((seen - landed) / 1e9)
            pts.append((size, statistics.median(ts)))
            if tw:
                together.append((size, statistics.median(tw)))
    slope, icept = (float(v) for v in np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1))
    bw = 1 / slope if slope > 0 else float("inf")
    peak = bw * workers
    if together:        # `workers` reads at once: the bandwidth they share (a disk does not scale with the readers),
        # the one that fits their times past the latency best in relative error: sum r^2 / sum r, r = bytes / time
        rs = [workers * n / (t - icept) for n, t in together if t > icept]
        peak = min(peak, sum(r * r for r in rs) / sum(rs)) if rs else peak
    return DeviceProfile("this-machine-in-situ", "this machine through the engine's reader, now (measured)",
                         latency_s=max(0.0, icept), read_bw=bw, peak_bw=peak, queue_depth=workers,
                         sources={"fit": [{"size": s, "median_s": t} for s, t in pts],
                                  "together": [{"size": s, "reads": workers, "median_s": t} for s, t in together],
                                  "wake_s": statistics.median(wakes)})
