"""The GIL-free readers (workbench/slot_reads.py): what a plain Reader does with reads into slots."""
from __future__ import annotations

import gc
import os
import sys
import time
import weakref
import zlib

import numpy as np
import pytest

from workbench import io, slot_reads
from workbench.io import ALIGN, Reader, aligned_empty
from workbench.slot_reads import SlotReads

pytestmark = pytest.mark.skipif(not slot_reads.AVAILABLE, reason="GIL-free readers run on Linux x86-64 only")


def _file(tmp_path, blocks=512):
    data = np.random.default_rng(1).integers(0, 256, blocks * ALIGN, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_reads_land_while_the_compute_thread_holds_the_gil(tmp_path):
    """A Python reader thread cannot start or finish a read while another thread runs Python without a break;
    these readers do: the read is stamped done before the busy thread lets go of the GIL."""
    path, data = _file(tmp_path)
    with Reader(path, workers=1) as r:
        r.submit_into([("warm", [(0, aligned_empty(ALIGN))])])["warm"].result()    # threads started, code loaded
        buf = aligned_empty(16 * ALIGN)
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)                 # no thread may take the GIL from this one for 30 s
        try:
            fut = r.submit_into([("k", [(32 * ALIGN, buf)])], checks={"k": ([(0, 0, buf.nbytes)],
                                                                          zlib.crc32(data[32 * ALIGN:48 * ALIGN]))})["k"]
            end = time.perf_counter() + 0.5
            while time.perf_counter() < end:       # pure Python: holds the GIL throughout
                pass
            held_until = time.perf_counter_ns()
        finally:
            sys.setswitchinterval(old)
        assert fut.result() == [buf] and fut.t_end < held_until
        np.testing.assert_array_equal(buf, data[32 * ALIGN:48 * ALIGN])


def test_more_reads_than_job_rows_wait_for_room_and_all_land(tmp_path, monkeypatch):
    monkeypatch.setattr(SlotReads, "CAPACITY", 4)
    path, data = _file(tmp_path)
    with Reader(path, workers=2) as r:
        bufs = {i: aligned_empty(ALIGN) for i in range(0, 400, 2)}      # none adjacent: one read each
        futs = r.submit_into([(i, [(i * ALIGN, b)]) for i, b in bufs.items()], priority=1,
                             checks={i: ([(0, 0, ALIGN)], zlib.crc32(data[i * ALIGN:(i + 1) * ALIGN])) for i in bufs})
        assert len(r.wait(list(futs.values()), 30, every=True)) == len(bufs)
        for i, f in futs.items():
            assert f.exception() is None
            np.testing.assert_array_equal(bufs[i], data[i * ALIGN:(i + 1) * ALIGN])
        assert sorted(r._slots.free) == list(range(4))          # every job row given back
        assert r.stats()["reads"] == len(bufs) and r.stats()["bytes_read"] == len(bufs) * ALIGN


@pytest.mark.parametrize("polling", [True, False])
def test_idle_readers_poll_before_they_sleep_and_a_submit_wakes_only_sleeping_ones(tmp_path, monkeypatch, polling):
    """A wake-up of a sleeping thread is the costly part of a submit on a VM: while idle readers poll the pipes, a
    submit writes no ticket (a polling reader takes the id); once they sleep, it writes one. The read lands either
    way."""
    monkeypatch.setattr(SlotReads, "SPIN_US", 60_000_000 if polling else 0)
    monkeypatch.setattr(SlotReads, "SPINNERS", 2)   # both poll: the one that does not take the id still polls
    tickets = []
    write = os.eventfd_write
    monkeypatch.setattr(os, "eventfd_write", lambda fd, n: (tickets.append(n), write(fd, n))[1])
    path, data = _file(tmp_path)
    with Reader(path, workers=2) as r:
        r.submit_into([("warm", [(0, aligned_empty(ALIGN))])])["warm"].result()
        idle, want = r._slots.idle, (2 if polling else 0)
        deadline = time.monotonic() + 10
        while idle[slot_reads.SPINNING] != want and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
        assert idle[slot_reads.SPINNING] == want
        tickets.clear()
        buf = aligned_empty(4 * ALIGN)
        fut = r.submit_into([("k", [(8 * ALIGN, buf)])],
                            checks={"k": ([(0, 0, buf.nbytes)], zlib.crc32(data[8 * ALIGN:12 * ALIGN]))})["k"]
        assert fut.result(timeout=10) == [buf]
        np.testing.assert_array_equal(buf, data[8 * ALIGN:12 * ALIGN])
        assert tickets == ([] if polling else [1])


def test_a_waiting_thread_gives_its_core_away_while_it_looks_again(tmp_path, monkeypatch):
    """Before it sleeps, a thread waiting for a read looks again and again; between looks it yields its core (an
    emulated read ends when its reader wakes on a timer, and that reader may need this core). Past the spin it
    sleeps: no yields then."""
    from workbench.devices import EmulatedReader, load
    yields = []
    real = os.sched_yield
    monkeypatch.setattr(slot_reads.os, "sched_yield", lambda: (yields.append(time.perf_counter()), real())[1])
    path, data = _file(tmp_path)
    slow = load("ufs22-phone")
    with EmulatedReader(path, slow, workers=1) as r:
        r.submit_into([("warm", [(0, aligned_empty(ALIGN))])])["warm"].result()
        buf = aligned_empty(64 * ALIGN)             # 256 KiB: past the phone's latency, about 0.6 ms
        yields.clear()
        fut = r.submit_into([("k", [(64 * ALIGN, buf)])])["k"]
        t0 = time.perf_counter()
        assert r.wait([fut], 10, every=True) == [fut]
        assert yields and all(t - t0 < SlotReads.WAIT_SPIN_S + 0.01 for t in yields)
        np.testing.assert_array_equal(buf, data[64 * ALIGN:128 * ALIGN])


def test_more_experts_than_job_rows_land_checked_when_their_parts_interleave_in_the_file(tmp_path, monkeypatch):
    """A native layout's parts lie apart (every gate, then every up, then every down), so a large submit's keys are
    each in several jobs: making room must not settle a key on the jobs it has so far (its crc over part of it)."""
    monkeypatch.setattr(SlotReads, "CAPACITY", 8)
    path, data = _file(tmp_path)
    n = 40
    with Reader(path, workers=2) as r:
        bufs = {k: [aligned_empty(ALIGN) for _ in range(3)] for k in range(n)}
        offs = {k: [(p * n + k) * 2 * ALIGN for p in range(3)] for k in range(n)}     # none adjacent
        crc = {k: zlib.crc32(b"".join(data[o:o + ALIGN].tobytes() for o in offs[k])) for k in range(n)}
        futs = r.submit_into([(k, list(zip(offs[k], bufs[k]))) for k in range(n)],
                             checks={k: ([(i, 0, ALIGN) for i in range(3)], crc[k]) for k in range(n)})
        assert len(r.wait(list(futs.values()), 30, every=True)) == n
        for k, f in futs.items():
            assert f.exception() is None, k
            for o, b in zip(offs[k], bufs[k]):
                np.testing.assert_array_equal(b, data[o:o + ALIGN])
        assert sorted(r._slots.free) == list(range(8))


def test_a_spinning_reader_that_takes_an_id_wakes_a_sleeping_one_for_the_rest(tmp_path, monkeypatch):
    """A submit that a spinning reader catches writes no ticket: the reader that takes the first id wakes the
    sleeping one (its wake-up paid on a reader thread, not the submitter), and the two read side by side. (Where the
    spinner is quicker than the submitter's look at it, the submitter writes its tickets too: about half the runs
    on an idle 2-core machine.)"""
    from workbench.devices import EmulatedReader, load
    monkeypatch.setattr(SlotReads, "SPIN_US", 60_000_000)
    monkeypatch.setattr(SlotReads, "SPINNERS", 1)
    tickets = []
    write = os.eventfd_write
    monkeypatch.setattr(os, "eventfd_write", lambda fd, n: (tickets.append(n), write(fd, n))[1])
    path, data = _file(tmp_path, blocks=4096)
    with EmulatedReader(path, load("ufs22-phone"), workers=2) as r:      # a read of 4 MiB takes some ms: time to wake
        r.submit_into([("warm", [(0, aligned_empty(ALIGN))])])["warm"].result()
        idle = r._slots.idle
        deadline = time.monotonic() + 10
        while (idle[slot_reads.SPINNING], idle[slot_reads.SLEEPING]) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert (idle[slot_reads.SPINNING], idle[slot_reads.SLEEPING]) == (1, 1)
        tickets.clear()
        before = r._slots.stats[:, 1].copy()
        n = 1024 * ALIGN
        bufs = [aligned_empty(n) for _ in range(2)]
        futs = r.submit_into([(i, [((1 + 2 * i) * n, b)]) for i, b in enumerate(bufs)])
        assert len(r.wait(list(futs.values()), 10, every=True)) == 2
        for i, b in enumerate(bufs):
            np.testing.assert_array_equal(b, data[(1 + 2 * i) * n:(2 + 2 * i) * n])
        # the submitter woke nobody, unless the spinning reader took the first id before the submitter looked at
        # the spinning count after its write (then it writes one ticket per id: _queue's rule, a race by design)
        assert tickets in ([], [len(futs) * 2]), tickets
        assert ((r._slots.stats[:, 1] - before) >= 1).all()     # both readers read (4 MiB reads go in pieces)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_planner_makes_the_python_paths_reads_and_checks_the_same(tmp_path, seed):
    """Experts of several buffers each (touching, overlapping and far apart in the file, some large enough to go
    in pieces to both readers), checked runs within and across buffers, some crcs wrong: the compiled planner's
    jobs are the Python path's reads (io.reads_of), and the GIL-free readers land the same bytes with the same
    verdicts as Python threads do."""
    rng = np.random.default_rng(seed)
    path, data = _file(tmp_path, blocks=1024)
    requests, checks, at = [], {}, 0
    for k in range(int(rng.integers(3, 40))):
        parts = []
        for i in range(int(rng.integers(1, 4))):
            at = max(0, at + int(rng.choice([0, 0, -1, 3])) * ALIGN)       # touching, overlapping, apart
            n = int(rng.choice([1, 2, 5, 70, 140])) * ALIGN
            if at + n > len(data):
                at = 0
            parts.append((at, aligned_empty(n)))
            at += n
        runs = [(i, a, min(a + int(rng.integers(1, 3 * ALIGN)), b.nbytes))
                for i, (_, b) in enumerate(parts) for a in [int(rng.integers(0, b.nbytes))]]
        crc = 0
        for i, a, z in runs:
            crc = zlib.crc32(data[parts[i][0] + a:parts[i][0] + z], crc)
        requests.append((k, parts))
        checks[k] = (runs, crc ^ (k % 5 == 0))                          # every fifth key's crc is wrong

    ranges = [(off, off + b.nbytes, (off, b, k, i, 0)) for k, parts in requests for i, (off, b) in enumerate(parts)]
    want, _ = io.reads_of(ranges, sum(b.nbytes for _, parts in requests for _, b in parts), 2)
    with Reader(path, workers=2) as r:
        futs = r.submit_into(requests, checks=checks)
        slots = r._slots
        got = sorted((int(slots._jobs[j, 0]), [tuple(int(x) for x in v) for v in slots._iov[j, :slots._jobs[j, 2]]])
                     for f in futs.values() for j in f.jobs.tolist())
        verdicts = {k: f.exception(30) is not None for k, f in futs.items()}
        landed = {k: [b.copy() for _, b in parts] for k, parts in requests}
    assert sorted(set(map(lambda g: (g[0], tuple(g[1])), got))) == sorted(
        (start, tuple((slot_reads.address(m[1]), m[1].nbytes) for m in members)) for start, _, members in want)

    class PythonThreads(Reader):
        def _pread(self, buf, pos, need):           # any override sends reads to Python threads
            return super()._pread(buf, pos, need)

    for _, parts in requests:
        for _, b in parts:
            b[:] = 0
    with PythonThreads(path, workers=2) as r:
        futs = r.submit_into(requests, checks=checks)
        assert {k: f.exception(30) is not None for k, f in futs.items()} == verdicts
    assert verdicts == {k: k % 5 == 0 for k in verdicts}
    for k, parts in requests:
        for (off, b), was in zip(parts, landed[k]):
            np.testing.assert_array_equal(b, was)
            np.testing.assert_array_equal(b, data[off:off + b.nbytes])


def test_the_memory_a_read_lands_in_is_held_while_the_read_may_land(tmp_path):
    """Reads go to the readers as addresses: the reader holds what owns that memory (a session's arena) until the
    job's row is free for another read or the reader closes, so a session that lets go of its arena while a
    prefetch is still landing does not have the memory freed under the read."""
    path, data = _file(tmp_path)
    with Reader(path, workers=1) as r:
        buf = aligned_empty(4 * ALIGN)
        owner = weakref.ref(buf.base if buf.base is not None else buf)
        parts = np.array([[8 * ALIGN, 4 * ALIGN, slot_reads.address(buf), 0, 0]], np.int64)
        fut = r.submit_parts(["k"], parts, np.zeros((0, slot_reads.CHECK), np.int64), [-1], owner=buf)["k"]
        fut.result(10)
        np.testing.assert_array_equal(buf, data[8 * ALIGN:12 * ALIGN])
        del buf
        gc.collect()
        assert owner() is not None
    gc.collect()
    assert owner() is None
