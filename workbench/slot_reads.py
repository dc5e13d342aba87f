"""Reads into the slot arena with no GIL: the reader threads run a compiled loop.

A Python reader thread needs the GIL to take a job, to start its read and to finish it; beside a compute thread
that holds the GIL, a 48 KB read took 0.33 ms instead of 0.23, waited 0.2-0.6 ms in the queue, and up to the
switch interval (5 ms) when compute ran pure Python. Here a reader thread calls one compiled function (numba,
nogil) that never returns to Python until the reader closes:

    take a job id from a pipe (the demand pipe before the prefetch pipe; the kernel hands each id to one thread);
    when both are empty, poll them for a while (a ticket's wake-up of a sleeping reader is the costly part of a
    submit on a VM), then sleep until a ticket comes (an eventfd a submit writes when no reader polls)
    having taken an id, wake a sleeping reader while ids are left (the wake-up paid on a reader, not the submitter)
    preadv the job's range into its buffers (the slots' memory), crc32 each checked run (libz), stamp the times
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
import zlib

import numpy as np
import llvmlite.binding as llvm
from numba import njit, types

SHARD_BITS = 40     # a Reader of several files: an offset's file in the bits above, its byte offset (< 1 TiB) below
SHARD_MASK = (1 << SHARD_BITS) - 1
IOV = 16            # buffers one job scatters into (a merged read of more is split)
RUNS = 3 * IOV      # checked runs one job holds (an expert's three parts per buffer at most)
QUEUED, DONE, RETRY = 1, 2, 3       # a job's state; RETRY: the read was not whole, Python reads it again
OFF, LEN, NIOV, NRUN = range(4)       # a job's row

# Where these readers run: Linux (eventfd) on x86-64, whose stores are seen in program order by other cores (a job's
# crc and stamps are written before its state, with no fence between them); elsewhere (macOS, ARM) a Reader reads
# into slots on Python threads. libc and libz by symbol name (resolved when the compiled code is loaded, so numba
# can cache it); pointers as u64.
LIBZ = ctypes.util.find_library("z")
AVAILABLE = bool(sys.platform == "linux" and platform.machine() == "x86_64" and hasattr(os, "eventfd") and LIBZ)
if AVAILABLE:
    llvm.load_library_permanently(LIBZ)


def runs_here() -> bool:
    """AVAILABLE, and os has the eventfd they wake on now (a test may take it away: tests/macos_surface.py)."""
    return AVAILABLE and hasattr(os, "eventfd")


_i32, _i64, _u64 = types.int32, types.int64, types.uint64
_preadv = types.ExternalFunction("preadv", _i64(_i32, _u64, _i32, _i64))
_read = types.ExternalFunction("read", _i64(_i32, _u64, _u64))
_write = types.ExternalFunction("write", _i64(_i32, _u64, _u64))
_clock = types.ExternalFunction("clock_gettime", _i32(_i32, _u64))
_crc32 = types.ExternalFunction("crc32", _u64(_u64, _u64, types.uint32))
_sleep_until = types.ExternalFunction("clock_nanosleep", _i32(_i32, _i32, _u64, _u64))
_lock = types.ExternalFunction("pthread_mutex_lock", _i32(_u64))
_unlock = types.ExternalFunction("pthread_mutex_unlock", _i32(_u64))
_yield = types.ExternalFunction("sched_yield", _i32())
_poll = types.ExternalFunction("poll", _i32(_u64, _u64, _i32))
if AVAILABLE:
    crc32_combine = ctypes.CDLL(LIBZ).crc32_combine
    crc32_combine.argtypes, crc32_combine.restype = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long], ctypes.c_ulong
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
def _address(buf) -> int:
    """A buffer's address: numpy's buf.ctypes.data builds a ctypes object per call (2.0 us here; this 0.3 us)."""
    return buf.ctypes.data


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
    """A key's read into its buffers: done once every job it is in is done; result() is its buffers, or raises
    the read's error or a ChecksumError. Settled (crc compared, a Python retry run) by the first thread that asks."""

    __slots__ = ("reads", "key", "bufs", "check", "jobs", "runs", "t_submit", "t_queued", "t_start", "t_end", "priority",
                 "settled", "error", "open")

    def __init__(self, reads, key, bufs, check, priority: int = 0, t_submit: int = 0):
        self.reads, self.key, self.bufs, self.check = reads, key, bufs, check
        self.priority, self.t_submit, self.t_queued = priority, t_submit, 0     # ns: its submit began, its jobs queued
        self.open = False                   # a submit has not made all of its jobs yet: not done, whatever they are
        self.jobs: list[int] = []
        # (place in crc order, start in its buffer, job, row, bytes) of each checked run, or piece of one
        self.runs: list[tuple] = []
        self.t_start = self.t_end = 0       # ns (perf_counter_ns): its first read started, its last landed
        self.settled, self.error = False, None

    def done(self) -> bool:
        if self.settled:
            return True
        if self.open:
            return False
        state = self.reads.state
        for j in self.jobs:
            if state[j] == QUEUED:
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
        self.members: dict[int, list] = {}              # job -> the SlotReads in it not yet settled; the rest free
        self.free = list(range(capacity - 1, -1, -1))
        self.groups: dict[int, tuple] = {}              # job -> (start, end, buffers) for a Python retry
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

    def submit(self, groups, priority: int, futures: dict) -> None:
        """groups: [start, end, [(offset, buf, key, index of buf in the key's, where buf starts in that buffer), ...]]
        merged reads (a buffer split across reads is in each as a view of its piece), each at most IOV buffers and
        RUNS checked runs; futures: key -> SlotRead. A key is open until its last group is a job: making room for
        the rest must not settle it on the jobs it has so far (Reader.submit_into sends at most half the rows at a
        time, so the other half belongs to keys that can settle)."""
        last = {m[2]: g for g, (_, _, members) in enumerate(groups) for m in members}
        for key in last:
            futures[key].open = True
        ids = []
        with self._lock:
            for g, (start, end, members) in enumerate(groups):
                if not self.free:
                    self._queue(ids, priority)
                    ids = []
                    self._make_room()
                ids.append(self._job(start, end, members, futures))
                for m in members:
                    if last[m[2]] == g:
                        futures[m[2]].open = False
        self._queue(ids, priority)
        now = time.perf_counter_ns()
        for fut in futures.values():
            fut.t_queued = fut.t_queued or now

    def _queue(self, ids, priority):
        data = array.array("i", ids).tobytes()
        for at in range(0, len(data), 4096):            # a pipe write of at most PIPE_BUF is atomic
            os.write(self.writers[priority > 0], data[at:at + 4096])
        wake = 0 if self.idle[SPINNING] else len(ids)     # after the write: see _next_job
        if wake:
            os.eventfd_write(self.tickets, wake)

    def _make_room(self):
        """Every job row is taken: settle the done ones whose keys nobody asked about yet, else wait for one."""
        while not self.free:
            for j in [j for j in self.members if self.state[j] != QUEUED]:
                for fut in list(self.members.get(j, ())):
                    fut.done()
            if not self.free:
                self._sleep(0.002)

    def _job(self, start, end, members, futures) -> int:
        j = self.free.pop()
        iov, runs, nrun = self.iov, self.runs, 0
        self.members[j] = mine = []
        for i, (_, buf, key, b, p) in enumerate(members):          # p: where this buffer (or piece) starts in b
            addr, n, at = _address(buf), buf.nbytes, (j * IOV + i) * 2
            iov[at], iov[at + 1] = addr, n
            fut = futures[key]
            if j not in fut.jobs:
                fut.jobs.append(j)
                mine.append(fut)
            for order, (chunk, a, z) in enumerate(fut.check[0] if fut.check else ()):
                if chunk == b and a < p + n and z > p:            # the part of the run in this piece
                    a, z = max(a, p), min(z, p + n)
                    at = (j * RUNS + nrun) * 3
                    runs[at], runs[at + 1] = addr + a - p, z - a
                    fut.runs.append((order, a, j, nrun, z - a))
                    nrun += 1
        at = j * 4
        self.jobs[at], self.jobs[at + 1], self.jobs[at + 2], self.jobs[at + 3] = (start, self.reader.needed(start, end),
                                                                              len(members), nrun)
        self.state[j] = QUEUED
        self.groups[j] = (start, end, members)
        return j

    def settle(self, fut: SlotRead) -> None:
        """A key whose jobs are all done: retry what did not read whole (Python path), compare its crc, free jobs."""
        with self._lock:
            if fut.settled:
                return
            try:
                for j in fut.jobs:
                    if self.state[j] == RETRY:
                        self._retry(j)
                if fut.check is not None:
                    (_, _, j, r, _), *rest = sorted(fut.runs)      # in crc order, then file order
                    crc = self.runs[(j * RUNS + r) * 3 + 2]
                    for _, _, j, r, n in rest:
                        crc = crc32_combine(crc, self.runs[(j * RUNS + r) * 3 + 2], n)
                    if crc != fut.check[1]:
                        raise ChecksumError(f"{self.reader.path}: crc32 of {fut.key!r} is {crc:08x}, "
                                            f"not {fut.check[1]:08x}")
            except BaseException as e:
                fut.error = e
            fut.settled = True
            fut.t_start = min(self.stamps[2 * j] for j in fut.jobs)
            fut.t_end = max(self.stamps[2 * j + 1] for j in fut.jobs)
            log = getattr(self.reader, "log", None)
            for j in fut.jobs:
                left = self.members[j]
                left.remove(fut)
                if not left:
                    if log is not None:
                        log.append((self.jobs[4 * j + LEN], self.depths[j], self.stamps[2 * j] / 1e9,
                                    self.stamps[2 * j + 1] / 1e9))
                    del self.members[j], self.groups[j]
                    self.free.append(j)

    def _retry(self, j: int) -> None:
        """Read job j again on the Python path (its retries and errors), then its crcs."""
        start, end, members = self.groups[j]
        bufs = [m[1] for m in members]
        self.stamps[2 * j] = time.perf_counter_ns()
        got = self.reader._pread(bufs, start, end - start)
        if got < self.reader.needed(start, end):
            raise self.reader._eof_error(start, end - start, start + got)
        for r in range(self.jobs[j * 4 + 3]):
            at = (j * RUNS + r) * 3
            self.runs[at + 2] = zlib.crc32((ctypes.c_char * self.runs[at + 1]).from_address(self.runs[at]))
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
        self.members.clear()        # reads never settled (prefetches nobody asked for) refer back to these
        self.groups.clear()
