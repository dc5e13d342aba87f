"""Reads into the slot arena with no GIL: the reader threads run a compiled loop.

A Python reader thread needs the GIL to take a job, to start its read and to finish it; beside a compute thread
that holds the GIL, a 48 KB read took 0.33 ms instead of 0.23, waited 0.2-0.6 ms in the queue, and up to the
switch interval (5 ms) when compute ran pure Python. Here a reader thread calls one compiled function (numba,
nogil) that never returns to Python until the reader closes:

    take a job id from a pipe (the demand pipe before the prefetch pipe; the kernel hands each id to one thread);
    when both are empty, poll them for a while (a ticket's wake-up of a sleeping reader is the costly part of a
    submit on a VM), then sleep until a ticket comes (an eventfd a submit writes when no reader polls)
    having taken an id, wake a sleeping reader while ids are left (the wake-up paid on a reader, not the submitter)
    preadv the job's range into its buffers (the slots' memory), crc32 each checked run (ISA-L), stamp the times
    (an emulated device: sleep until the profile's time for the read's size and the reads in flight has passed)
    mark the job done in an array, and count it on an eventfd that a waiting thread sleeps on once it has looked
    for a while (`SlotReads.wait`)

A job is one merged read (one preadv). Its row in preallocated arrays is written before its id goes into a pipe,
and its id before its ticket (system calls: the row is visible to the reader that takes the id). Anything but a whole read
(an error, a short read at the end of the file) is settled by the Python path on the thread that asks for the
result (`Reader._pread`: its retries, its end-of-file errors), so the fault paths stay one code.
"""
from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import platform
import select
import sys
import threading
import time
import weakref

import numpy as np
import llvmlite.binding as llvm
from isal import isal_zlib
from numba import njit, types

ALIGN = 4096        # O_DIRECT reads start, end and land on these boundaries
SHARD_BITS = 40     # a Reader of several files: an offset's file in the bits above, its byte offset (< 1 TiB) below
SHARD_MASK = (1 << SHARD_BITS) - 1
# A read of at least twice this goes to several readers at once, in pieces of at least this: flash reaches its
# bandwidth only with reads in flight together (smolmaxxing's UFS 2.2: about 940 MB/s with 2-4 reads of 256 KB or
# more, half of it for one), and these machines' virtio disks read their best from 256 KiB on (probe-disk).
SPLIT = 256 * 1024
IOV = 16            # buffers one job scatters into (a merged read of more is split)
RUNS = 3 * IOV      # checked runs one job holds (an expert's three parts per buffer at most)
QUEUED, DONE, RETRY = 1, 2, 3       # a job's state; RETRY: the read was not whole, Python reads it again
OFF, LEN, NIOV, NRUN = range(4)       # a job's row

# Where these readers run: Linux (eventfd) on x86-64, whose stores are seen in program order by other cores (a job's
# crc and stamps are written before its state, with no fence between them); elsewhere (macOS, ARM) a Reader reads
# into slots on Python threads. libc, libz and ISA-L by symbol name (resolved when the compiled code is loaded, so
# numba can cache it); pointers as u64. The readers' crc32 is ISA-L's (python-isal's extension exports it): the
# same crc as zlib's, several times faster, and the readers share the cores with compute (docs/numbers.md).
LIBZ = ctypes.util.find_library("z")
AVAILABLE = bool(sys.platform == "linux" and platform.machine() == "x86_64" and hasattr(os, "eventfd") and LIBZ)
if AVAILABLE:
    llvm.load_library_permanently(LIBZ)
    llvm.load_library_permanently(isal_zlib.__file__)


def runs_here() -> bool:
    """AVAILABLE, and os has the eventfd they wake on now (a test may take it away: tests/macos_surface.py)."""
    return AVAILABLE and hasattr(os, "eventfd")


_i32, _i64, _u64 = types.int32, types.int64, types.uint64
_preadv = types.ExternalFunction("preadv", _i64(_i32, _u64, _i32, _i64))
_read = types.ExternalFunction("read", _i64(_i32, _u64, _u64))
_write = types.ExternalFunction("write", _i64(_i32, _u64, _u64))
_clock = types.ExternalFunction("clock_gettime", _i32(_i32, _u64))
_crc32 = types.ExternalFunction("crc32_gzip_refl", types.uint32(types.uint32, _u64, _u64))
_sleep_until = types.ExternalFunction("clock_nanosleep", _i32(_i32, _i32, _u64, _u64))
_lock = types.ExternalFunction("pthread_mutex_lock", _i32(_u64))
_unlock = types.ExternalFunction("pthread_mutex_unlock", _i32(_u64))
_yield = types.ExternalFunction("sched_yield", _i32())
_poll = types.ExternalFunction("poll", _i32(_u64, _u64, _i32))
_crc32_combine = types.ExternalFunction("crc32_combine", _u64(_u64, _u64, _i64))
CLOCK_MONOTONIC, TIMER_ABSTIME = 1, 1      # time.perf_counter_ns's clock on Linux
POLLIN = 1
# the readers' idle row: readers polling the pipes now, at most, for how long; readers asleep on the tickets now
SPINNING, SPINNERS, SPIN_NS, SLEEPING = range(4)
PR_SET_TIMERSLACK = 29
MUTEX_BYTES = 64                    # >= glibc's pthread_mutex_t (40 B on x86-64), whose all-zero bytes are unlocked
NO_DEVICE = np.array([-1.0, 0.0, 0.0])


def emulation(profile) -> np.ndarray:
    """What the compiled loop needs of a device profile (workbench/devices.py): latency in ns, one read's bandwidth
    and the bandwidth all reads in flight share, in bytes per ns."""
    return np.array([profile.latency_s * 1e9, profile.read_bw / 1e9, profile.peak_bw / 1e9])


@njit(cache=True)
def address(buf) -> int:
    """A buffer's address: numpy's buf.ctypes.data builds a ctypes object per call (2.0 us here; this 0.3 us)."""
    return buf.ctypes.data


def buffer_at(addr: int, n: int) -> np.ndarray:
    """The n bytes at addr, as an array (memory someone else holds)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * int(n)).from_address(int(addr)))


@njit(cache=True, nogil=True)
def _now(ts):
    _clock(CLOCK_MONOTONIC, ts.ctypes.data)
    return ts[0] * 1_000_000_000 + ts[1]


@njit(cache=True, nogil=True)
def _take(demand, prefetch, jid) -> bool:
    """A queued job id into jid[0], the demand pipe's before the prefetch pipe's; False if both are empty."""
    return _read(demand, jid.ctypes.data, 4) == 4 or _read(prefetch, jid.ctypes.data, 4) == 4


@njit(cache=True, nogil=True)
def _pass_on(tickets, pipes, pfd, idle, one) -> None:
    """A reader that took an id wakes a sleeping one while ids are left in the pipes and no ticket is (a submit
    that a spinning reader catches writes none, so the wake-up of a second reader is paid here, off the submitting
    compute thread). The woken reader passes on in turn."""
    if idle[SLEEPING] > 0 and _poll(pipes.ctypes.data, 2, 0) > 0 and _poll(pfd.ctypes.data, 1, 0) == 0:
        _write(tickets, one.ctypes.data, 8)


@njit(cache=True, nogil=True)
def _next_job(tickets, demand, prefetch, jid, ticket, pfd, ts, idle, mutex) -> None:
    """Wait for a job id (into jid[0]): poll the pipes for idle[SPIN_NS] while fewer than idle[SPINNERS] other
    readers do, then sleep on the tickets. A submit writes tickets only where no reader spins: a ticket's wake-up
    of a sleeping thread costs the submitting thread far more (an interrupt to an idle virtual CPU) than a pipe
    poll, and a spinning reader wakes the next itself (_pass_on). A reader stops spinning under the mutex, then
    looks at the pipes once more (the submit writes its ids, then reads the count: one of the two sees the other);
    ids left while it reads are its own next ones whoever else wakes."""
    while True:
        if _take(demand, prefetch, jid):
            _read(tickets, ticket.ctypes.data, 8)       # the ticket of this id, if it was written (non-blocking)
            return
        _lock(mutex.ctypes.data)
        spins = idle[SPINNING] < idle[SPINNERS]
        if spins:
            idle[SPINNING] += 1
        _unlock(mutex.ctypes.data)
        if spins:
            end, got = _now(ts) + idle[SPIN_NS], False
            while not got and _now(ts) < end:
                _yield()
                got = _take(demand, prefetch, jid)
            _lock(mutex.ctypes.data)
            idle[SPINNING] -= 1
            _unlock(mutex.ctypes.data)
            if got or _take(demand, prefetch, jid):
                _read(tickets, ticket.ctypes.data, 8)
                return
        _lock(mutex.ctypes.data)
        idle[SLEEPING] += 1
        _unlock(mutex.ctypes.data)
        _poll(pfd.ctypes.data, 1, -1)               # sleeps until a ticket is there
        _lock(mutex.ctypes.data)
        idle[SLEEPING] -= 1
        _unlock(mutex.ctypes.data)
        if _read(tickets, ticket.ctypes.data, 8) == 8 and _take(demand, prefetch, jid):
            return
        # another reader took the ticket, or its id (a spinning one), or queued reads were dropped by close()


@njit(cache=True, nogil=True)
def _serve(fds, tickets, demand, prefetch, done, jobs, state, stamps, depths, iov, runs, stats, device, mutex, flight,
           idle):
    """One reader thread's loop; returns when it takes a negative job id. fds: the reader's files, the one a job
    reads named by its offset's high bits (SHARD_BITS). device: emulation() of a profile, or
    NO_DEVICE; then each read counts itself in flight (under mutex) and ends no earlier than the profile says."""
    jid = np.zeros(1, np.int32)
    one = np.ones(1, np.uint64)
    ticket = np.zeros(1, np.uint64)
    pfd = np.zeros(2, np.int32)                 # struct pollfd {int fd; short events, revents}
    pfd[0], pfd[1] = tickets, POLLIN
    pipes = np.zeros(4, np.int32)               # the two pipes' pollfds
    pipes[0], pipes[1], pipes[2], pipes[3] = demand, POLLIN, prefetch, POLLIN
    ts = np.zeros(2, np.int64)
    wake = np.zeros(2, np.int64)
    late = 100_000              # ns a sleep wakes after its time (learned)
    emulated = device[0] >= 0
    while True:
        _next_job(tickets, demand, prefetch, jid, ticket, pfd, ts, idle, mutex)
        j = jid[0]
        if j < 0:
            return
        _pass_on(tickets, pipes, pfd, idle, one)
        depth = 1
        if emulated:
            _lock(mutex.ctypes.data)
            flight[0] += 1
            depth = flight[0]
            _unlock(mutex.ctypes.data)
        t0 = _now(ts)
        got = _preadv(fds[jobs[j, OFF] >> SHARD_BITS], iov[j].ctypes.data, jobs[j, NIOV], jobs[j, OFF] & SHARD_MASK)
        if got == jobs[j, LEN]:
            for r in range(jobs[j, NRUN]):
                runs[j, r, 2] = _crc32(0, runs[j, r, 0], runs[j, r, 1])
        t1 = real = _now(ts)
        if emulated:            # latency + size / min(read_bw, peak_bw / depth), as DeviceProfile.read_s
            end = t0 + np.int64(np.ceil(device[0] + jobs[j, LEN] / min(device[1], device[2] / depth)))
            # Sleep to the lateness wake-ups have shown (late even with 1 ns of timer slack), then
            # yield the last stretch, as EmulatedReader._wait_until does: the read ends on its time, never before.
            while end - t1 > late + 20_000:
                want = end - late - 20_000
                wake[0], wake[1] = want // 1_000_000_000, want % 1_000_000_000
                _sleep_until(CLOCK_MONOTONIC, TIMER_ABSTIME, wake.ctypes.data, 0)
                t1 = _now(ts)
                late += (max(t1 - want, 0) - late) // 10
            while t1 < end:
                _yield()
                t1 = _now(ts)
            _lock(mutex.ctypes.data)
            flight[0] -= 1
            _unlock(mutex.ctypes.data)
        stamps[j, 0] = t0
        stamps[j, 1] = t1
        depths[j] = depth
        stats[0] += max(got, 0)
        stats[1] += 1
        stats[2] += real - t0
        stats[3] += t1 - real
        state[j] = DONE if got == jobs[j, LEN] else RETRY
        _write(done, one.ctypes.data, 8)

PART = 5            # a part's row: (file offset, bytes, buffer address, key, buffer index in the key's)
CHECK = 4           # a checked run's row: (key, buffer index, start, end), a key's rows in crc order
PIECE = 6           # a checked run's piece in a job: (key, place in crc order, start in its buffer, job, row, bytes)


@njit(cache=True)
def _plan_jobs(parts, checks, nkeys, workers, ends, free, nfree, refs, jobs, state, iov, runs):
    """Jobs for `parts` of keys 0..nkeys-1 written into the rows of free job ids (free[:nfree], taken from the end;
    enough of them: at most workers a part), as SlotReads.submit's docstring says. Returns (the job ids in file
    order, (key, job) pairs sorted by key, pieces (PIECE) sorted by key and crc order, where each key's pairs and
    pieces start, nfree left, reads merged)."""
    n = parts.shape[0]
    kstart = _starts(checks[:, 0], nkeys)
    by_end = np.argsort(parts[:, 0] + parts[:, 1], kind="mergesort")
    order = by_end[np.argsort(parts[by_end, 0], kind="mergesort")]        # by (start, end)
    gstart, gend, gfirst = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n + 1, np.int64)
    groups = 0
    for i in range(n):          # touching ranges share a read; overlapping ones do not (a buffer each range)
        p = order[i]
        a, z = parts[p, 0], parts[p, 0] + parts[p, 1]
        if groups and a == gend[groups - 1]:
            gend[groups - 1] = z
        else:
            gstart[groups], gend[groups], gfirst[groups] = a, z, i
            groups += 1
    gfirst[groups] = n
    pieces_split = parts[:, 1].sum() >= 2 * SPLIT
    ids = np.empty(min(nfree, n * workers), np.int64)
    pairs = np.empty((n * workers, 2), np.int64)                   # a part is in at most one piece a reader
    pieces = np.empty((checks.shape[0] * workers, PIECE), np.int64)
    nj = npair = npiece = 0
    for g in range(groups):
        step = split_step(gend[g] - gstart[g], workers if pieces_split else 1)
        a = gstart[g]
        while a < gend[g]:
            b = min(a + step, gend[g])
            j, niov, nrun, jstart = -1, 0, 0, a
            for i in range(gfirst[g], gfirst[g + 1]):
                p = order[i]
                off, key, bi = parts[p, 0], parts[p, 3], parts[p, 4]
                if off >= b or off + parts[p, 1] <= a:
                    continue
                lo, hi = max(off, a), min(off + parts[p, 1], b)
                at = lo - off                                   # where this piece starts in its buffer
                mine = 0
                for c in range(kstart[key], kstart[key + 1]):
                    if checks[c, 1] == bi and checks[c, 2] < at + hi - lo and checks[c, 3] > at:
                        mine += 1
                if j >= 0 and (niov == IOV or nrun + mine > RUNS):
                    jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3] = jstart, needed(jstart, lo, ends), niov, nrun
                    j = -1
                if j < 0:
                    nfree -= 1
                    j = free[nfree]
                    ids[nj] = j
                    nj += 1
                    niov, nrun, jstart = 0, 0, lo
                    state[j] = QUEUED
                    refs[j] = 0
                iov[j, niov, 0], iov[j, niov, 1] = parts[p, 2] + at, hi - lo
                niov += 1
                pairs[npair, 0], pairs[npair, 1] = key, j
                npair += 1
                for c in range(kstart[key], kstart[key + 1]):
                    if checks[c, 1] == bi and checks[c, 2] < at + hi - lo and checks[c, 3] > at:
                        ra, rz = max(checks[c, 2], at), min(checks[c, 3], at + hi - lo)
                        runs[j, nrun, 0], runs[j, nrun, 1] = parts[p, 2] + ra, rz - ra
                        pieces[npiece, 0], pieces[npiece, 1], pieces[npiece, 2] = key, c - kstart[key], ra
                        pieces[npiece, 3], pieces[npiece, 4], pieces[npiece, 5] = j, nrun, rz - ra
                        npiece += 1
                        nrun += 1
                end = hi
            jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3] = jstart, needed(jstart, end, ends), niov, nrun
            a = b
    pairs = pairs[:npair]
    pairs = pairs[np.argsort(pairs[:, 0] * (1 << 32) + pairs[:, 1], kind="mergesort")]
    keep = np.ones(npair, np.bool_)
    for i in range(1, npair):
        keep[i] = pairs[i, 0] != pairs[i - 1, 0] or pairs[i, 1] != pairs[i - 1, 1]
    pairs = pairs[keep]
    for i in range(pairs.shape[0]):
        refs[pairs[i, 1]] += 1
    pieces = pieces[:npiece]
    pieces = pieces[np.argsort((pieces[:, 0] * RUNS * IOV + pieces[:, 1]) * (1 << 34) + pieces[:, 2], kind="mergesort")]
    return ids[:nj], pairs, pieces, _starts(pairs[:, 0], nkeys), _starts(pieces[:, 0], nkeys), nfree, n - groups


@njit(cache=True)
def _starts(keys, nkeys):
    """Where each key's rows start in rows sorted by key (and where the last ends)."""
    return np.searchsorted(keys, np.arange(nkeys + 1))


@njit(cache=True)
def _release(jobs, stamps, refs, free, nfree):
    """A settled key's jobs: each with no other key left is free again. Returns (nfree, its first read's start,
    its last read's end)."""
    t0, t1 = stamps[jobs[0], 0], stamps[jobs[0], 1]
    for j in jobs:
        t0, t1 = min(t0, stamps[j, 0]), max(t1, stamps[j, 1])
        refs[j] -= 1
        if refs[j] == 0:
            free[nfree] = j
            nfree += 1
    return nfree, t0, t1


@njit(cache=True)
def _any(state, jobs, what) -> bool:
    for j in jobs:
        if state[j] == what:
            return True
    return False


@njit(cache=True)
def needed(start, end, ends):
    """The bytes a read of [start, end) into buffers must bring, `ends` each file's size: it may reach past the end of
    its file (a GGUF's last expert, read to the 4 KiB boundary after it), not start there."""
    size = (start & ~SHARD_MASK) + ends[start >> SHARD_BITS]
    return end - start if start >= size else min(end, size) - start


@njit(cache=True)
def split_step(nbytes, workers):
    """The piece (4 KiB-aligned) a read of `nbytes` is cut into for `workers` readers: one piece a reader at most,
    none under SPLIT; nbytes itself where it stays whole (io.split_sizes lists the pieces)."""
    k = min(workers, nbytes // SPLIT)
    return nbytes if k < 2 else (nbytes + k * ALIGN - 1) // (k * ALIGN) * ALIGN


def wait_for(futures, timeout: float, every: bool, sleep) -> list:
    """The done ones of `futures` once any is done (every: all are), or at `timeout` seconds; sleep(seconds)
    until something may have landed."""
    deadline = time.monotonic() + timeout
    while True:
        done = [f for f in futures if f.done()]
        if done and (not every or len(done) == len(futures)):
            return done
        left = deadline - time.monotonic()
        if left <= 0:
            return done
        sleep(left)


class ChecksumError(ValueError):
    """A key's bytes landed whole but their crc32 is not the one the request gave."""


class SlotRead:
    """A key's read into its buffers: done once every job it is in is done; result() is its buffers (None where the
    caller gave addresses, not buffers), or raises the read's error or a ChecksumError. Settled (crc combined and
    compared, a Python retry run) by the first thread that asks."""

    __slots__ = ("reads", "key", "bufs", "crc", "jobs", "pieces", "t_submit", "t_queued", "t_start", "t_end",
                 "priority", "settled", "error")

    def __init__(self, reads, key, crc: int, jobs, pieces, priority: int, t_submit: int):
        self.reads, self.key, self.bufs, self.crc = reads, key, None, crc      # crc: -1, nothing to compare
        self.jobs, self.pieces = jobs, pieces       # its job ids; its checked runs' pieces (PIECE rows)
        self.priority, self.t_submit, self.t_queued = priority, t_submit, 0     # ns: its submit began, its jobs queued
        self.t_start = self.t_end = 0       # ns (perf_counter_ns): its first read started, its last landed
        self.settled, self.error = False, None

    def done(self) -> bool:
        if self.settled:
            return True
        if _any(self.reads._state, self.jobs, QUEUED):
            return False
        self.reads.settle(self)
        return True

    def exception(self, timeout=None):
        if not self.done() and not self.reads.wait([self], float("inf") if timeout is None else timeout, True):
            raise TimeoutError(f"{self.reads.reader.path}: reading {self.key!r} took over {timeout} s")
        return self.error

    def result(self, timeout=None):
        if self.exception(timeout) is not None:
            raise self.error
        return self.bufs


@njit(cache=True)
def _combined_crc(runs, pieces) -> int:
    """The crc32 of a key's checked runs from its pieces' crcs (the readers'), in crc order."""
    crc = runs[pieces[0, 3], pieces[0, 4], 2]
    for i in range(1, pieces.shape[0]):
        crc = _crc32_combine(crc, runs[pieces[i, 3], pieces[i, 4], 2], pieces[i, 5])
    return crc


class SlotReads:
    """The jobs of one Reader's GIL-free readers (see the module's docstring)."""

    CAPACITY = 1024         # job rows: reads queued or in flight at once (a submit of more waits for room)
    # Idle readers that poll the pipes before they sleep, and for how long; how long a waiting thread looks again at
    # once before it sleeps. A polling reader catches the next read of a burst (a layer's reads, then the next
    # layer's) without a wake-up, but takes a core the compute thread may want: the best setting moves with the
    # machine (the cost of a wake-up, the cores to spare). These won or tied against more polling and against none,
    # alternating arms in one process, on this machine's reads and an emulated device's; measure again on another.
    SPINNERS, SPIN_US, WAIT_SPIN_S = 1, 200, 1e-3

    def __init__(self, reader):
        capacity = self.CAPACITY
        self.reader = weakref.proxy(reader)        # the reader holds these
        self.fds = np.array(reader.fds, np.int32)   # a job's file: its offset's high bits (workbench/io.py)
        self._jobs = np.zeros((capacity, 4), np.int64)              # offset, bytes, buffers, checked runs
        self._state = np.zeros(capacity, np.int64)
        self._stamps = np.zeros((capacity, 2), np.int64)            # read started, landed (ns)
        self._depths = np.zeros(capacity, np.int64)                 # reads in flight as it started (emulation)
        self._iov = np.zeros((capacity, IOV, 2), np.uint64)         # struct iovec {base, len}
        self._runs = np.zeros((capacity, RUNS, 3), np.uint64)       # (address, bytes, crc32)
        # flat views: an element costs a third of numpy's indexing from Python
        self.jobs, self.state, self.stamps, self.depths, self.iov, self.runs = (
            memoryview(a).cast("B").cast(a.dtype.char) for a in (self._jobs, self._state, self._stamps, self._depths,
                                                                  self._iov, self._runs))
        self._free, self.nfree = np.arange(capacity - 1, -1, -1, dtype=np.int64), capacity     # free[:nfree]
        self._refs = np.zeros(capacity, np.int64)       # a job's keys not yet settled
        self._owners: list = [None] * capacity          # what holds a job's buffers' memory: kept while it may land
        self.unsettled: set[SlotRead] = set()
        self._lock = threading.RLock()         # the job rows' bookkeeping: submit and settle
        self.demand, demand_w = os.pipe()
        self.prefetch, prefetch_w = os.pipe()
        self.writers = (demand_w, prefetch_w)
        for fd in (self.demand, self.prefetch):
            os.set_blocking(fd, False)
        self.tickets = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # one per queued id to wake for
        self.done_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(self.done_fd, select.POLLIN)
        self.stats = np.zeros((reader.workers, 4), np.int64)    # per thread: bytes, reads, ns in preadv, ns waited
        self.device = reader.emulation()            # an emulated device's profile for the loop, or NO_DEVICE
        self.mutex, self.flight = np.zeros(MUTEX_BYTES, np.uint8), np.zeros(1, np.int64)
        self.idle = np.array([0, self.SPINNERS, self.SPIN_US * 1000, 0], np.int64)   # SPINNING, SPINNERS, SPIN_NS, SLEEPING
        self.log = None         # [(bytes, depth, start s, end s)] of each read settled, when a test asks

    def serve(self, i: int) -> None:
        if self.device[0] >= 0:     # this thread's sleeps end on time, not up to the default 50 us of timer slack late
            ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        _serve(self.fds, self.tickets, self.demand, self.prefetch, self.done_fd, self._jobs, self._state,
               self._stamps, self._depths, self._iov, self._runs, self.stats[i], self.device, self.mutex, self.flight,
               self.idle)

    @property
    def free(self) -> list[int]:
        return self._free[:self.nfree].tolist()

    def submit(self, keys: list, parts: np.ndarray, checks: np.ndarray, crcs, priority: int, owner) -> dict:
        """Read parts (PART rows: file offset, bytes, buffer address, index in `keys`, buffer index in that key's)
        into their buffers; checks: CHECK rows (key index, buffer index, start, end), each key's in crc order;
        crcs: a key's crc32 over them, or -1. Returns key -> SlotRead. Parts whose ranges touch in the file are one
        read (one preadv scattered into their buffers; ranges that overlap, as a GGUF's experts' 4 KiB-aligned
        ranges can, are not), a read of at least twice SPLIT goes in pieces to several readers (io.split_sizes),
        a read of more than IOV buffers or RUNS checked runs in several. owner: what holds the buffers' memory,
        referred to until their jobs' rows are taken again (a session may let go of its arena while a prefetch
        nobody asked for is still landing in it). At most half the job rows go to one turn
        (keys whole), so a turn that waits for room waits on keys that can settle."""
        t_submit = time.perf_counter_ns()
        room = max(self.CAPACITY // 2 // len(self.stats), 1)     # parts a turn (a part: workers pieces at most)
        if len(parts) <= room:
            return self._turn(keys, parts, checks, crcs, priority, t_submit, owner)
        first = np.searchsorted(parts[:, 3], np.arange(len(keys) + 1))    # parts come grouped by key
        kstart = np.searchsorted(checks[:, 0], np.arange(len(keys) + 1))
        futures, k = {}, 0
        while k < len(keys):
            z = max(int(np.searchsorted(first, first[k] + room, "right")) - 1, k + 1)
            turn = parts[first[k]:first[z]].copy(), checks[kstart[k]:kstart[z]].copy()
            turn[0][:, 3] -= k
            turn[1][:, 0] -= k
            futures.update(self._turn(keys[k:z], *turn, crcs[k:z], priority, t_submit, owner))
            k = z
        return futures

    def _turn(self, keys, parts, checks, crcs, priority, t_submit, owner) -> dict:
        with self._lock:
            self._make_room(min(len(parts) * len(self.stats), self.CAPACITY))
            ids, pairs, pieces, jstart, pstart, self.nfree, merged = _plan_jobs(
                parts, checks, len(keys), len(self.stats), self.reader.ends, self._free, self.nfree, self._refs,
                self._jobs, self._state, self._iov, self._runs)
            futures = {}
            for i, key in enumerate(keys):
                futures[key] = SlotRead(self, key, int(crcs[i]), pairs[jstart[i]:jstart[i + 1], 1],
                                        pieces[pstart[i]:pstart[i + 1]], priority, t_submit)
            self.unsettled.update(futures.values())
            ids = ids.tolist()
            for j in ids:
                self._owners[j] = owner
        with self.reader._lock:
            self.reader.merged += merged
        self._queue(ids, priority)
        now = time.perf_counter_ns()
        for fut in futures.values():
            fut.t_queued = now
        return futures

    def _queue(self, ids, priority):
        data = array.array("i", ids).tobytes()
        for at in range(0, len(data), 4096):            # a pipe write of at most PIPE_BUF is atomic
            os.write(self.writers[priority > 0], data[at:at + 4096])
        wake = 0 if self.idle[SPINNING] else len(ids)     # after the write: see _next_job
        if wake:
            os.eventfd_write(self.tickets, wake)

    def _make_room(self, need: int):
        """Fewer than `need` job rows are free: settle the keys whose reads are done that nobody asked about yet,
        else wait for a read to land."""
        while self.nfree < need:
            for fut in list(self.unsettled):
                fut.done()
            if self.nfree < need:
                self._sleep(0.002)

    def settle(self, fut: SlotRead) -> None:
        """A key whose jobs are all done: retry what did not read whole (Python path), compare its crc, free jobs."""
        with self._lock:
            if fut.settled:
                return
            jobs = fut.jobs
            try:
                if _any(self._state, jobs, RETRY):
                    for j in jobs[self._state[jobs] == RETRY]:
                        self._retry(int(j))
                if fut.crc >= 0 and (crc := _combined_crc(self._runs, fut.pieces)) != fut.crc:
                    raise ChecksumError(f"{self.reader.path}: crc32 of {fut.key!r} is {crc:08x}, not {fut.crc:08x}")
            except BaseException as e:
                fut.error = e
            fut.settled = True
            self.unsettled.discard(fut)
            if len(jobs):
                was = self.nfree
                self.nfree, fut.t_start, fut.t_end = _release(jobs, self._stamps, self._refs, self._free, self.nfree)
                if (log := getattr(self.reader, "log", None)) is not None:
                    log.extend((self.jobs[4 * j + LEN], self.depths[j], self.stamps[2 * j] / 1e9,
                                self.stamps[2 * j + 1] / 1e9) for j in self._free[was:self.nfree].tolist())

    def _retry(self, j: int) -> None:
        """Read job j again on the Python path (its retries and errors), then its crcs."""
        start = self.jobs[4 * j + OFF]
        bufs = [buffer_at(a, n) for a, n in self._iov[j, :self.jobs[4 * j + NIOV]]]
        end = start + sum(b.nbytes for b in bufs)
        self.stamps[2 * j] = time.perf_counter_ns()
        got = self.reader._pread(bufs, start, end - start)
        if got < self.reader.needed(start, end):
            raise self.reader._eof_error(start, end - start, start + got)
        for r in range(self.jobs[j * 4 + NRUN]):
            at = (j * RUNS + r) * 3
            self.runs[at + 2] = isal_zlib.crc32((ctypes.c_char * self.runs[at + 1]).from_address(self.runs[at]))
        self.state[j] = DONE
        self.stamps[2 * j + 1] = time.perf_counter_ns()
        with self.reader._lock:
            self.reader.retries += 1        # the read the compiled loop did not get whole, got now

    def wait(self, futures, timeout: float, every: bool) -> list:
        """Look again for WAIT_SPIN_S (a reader waking a sleeping thread costs more than looking), yielding the core
        between looks, then sleep on the readers' count, looking again within 2 ms (another waiting thread may take
        it). The yield hands the core to a reader that is ready to run there: an emulated read ends on a reader's
        timed wake-up, which a spin that keeps its core delays to the scheduler's next tick. Against a spin without
        yields it was faster under an emulated device and no slower on real reads (alternating arms)."""
        spin_until = time.perf_counter() + self.WAIT_SPIN_S

        def sleep(left):
            if time.perf_counter() >= spin_until:
                self._sleep(min(left, 0.002))
            else:
                os.sched_yield()
        return wait_for(futures, timeout, every, sleep)

    def _sleep(self, seconds: float):
        """Until a read lands (the readers count each on done_fd) or `seconds` pass."""
        if self.poller.poll(seconds * 1e3):
            try:
                os.eventfd_read(self.done_fd)
            except BlockingIOError:
                pass

    def totals(self) -> tuple[int, int, float, float]:
        """Bytes read, reads, seconds in preadv, seconds waited out for an emulated device."""
        b, n, ns, waited = self.stats.sum(axis=0)
        return int(b), int(n), float(ns) / 1e9, float(waited) / 1e9

    def stop(self) -> None:
        """Queued reads are dropped; each reader thread takes a stop and returns."""
        for fd in (self.demand, self.prefetch):
            try:
                while os.read(fd, 65536):
                    pass
            except BlockingIOError:
                pass
        os.write(self.writers[0], np.full(len(self.stats), -1, np.int32).tobytes())
        os.eventfd_write(self.tickets, len(self.stats))

    def close(self) -> None:
        for fd in (self.demand, self.prefetch, *self.writers, self.tickets, self.done_fd):
            os.close(fd)
        self.unsettled.clear()      # reads never settled (prefetches nobody asked for) refer back to these
        self._owners = [None] * len(self._owners)
