"""Stream byte ranges (MoE expert weights) from an on-disk pack file.

`Reader` reads uncached by default: O_DIRECT on Linux, fcntl(F_NOCACHE) with read-ahead off on macOS, so expert
reads do not go through (or fill) the page cache; `mode` says which path was actually taken ("o_direct",
"f_nocache" or "page-cache", "+pread" where the platform has no preadv).  Reads are `preadv` calls (one `pread`
per buffer without it, workbench/host.py) into 4096-aligned numpy buffers; they release the GIL, so reads
submitted to the thread pool overlap compute in other threads.

A Reader of several files (a checkpoint's safetensors shards) holds one fd a file and reads file i's byte o at
offset i << SHARD_BITS | o (the offsets of an index, workbench/store/pack.py): no read spans two files, and each
keeps its place in its own file's pages.

The disk probes are workbench/disk_probe.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import heapq
import itertools
import os
import threading
import time
from functools import partial

import numpy as np
from isal import isal_zlib

from workbench import host, slot_reads
from workbench.slot_reads import ALIGN, IOV, SHARD_BITS, SHARD_MASK, SPLIT, ChecksumError, SlotRead, SlotReads  # noqa
from workbench.slot_reads import wait_for

KiB, MiB = 1024, 1024 * 1024
TRANSIENT = (errno.EIO, errno.EAGAIN)   # a read failing so is tried again, RETRIES times at most
RETRIES = 3


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """Uninitialised uint8 array of `nbytes` whose data address is a multiple of `align`."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes]


def _align_out(offset: int, length: int) -> tuple[int, int]:
    """The 4096-aligned range [start, end) covering [offset, offset + length)."""
    return offset // ALIGN * ALIGN, -(-(offset + length) // ALIGN) * ALIGN


def default_workers() -> int:
    """Reader threads: one core computes, the others read and dequantize, up to 4 (the queue depth at which
    these disks saturate). On 2 cores one reader beat four on LES (median 51 vs 37 tok/s, 5 alternating rounds on
    the demo at a 25% budget; on-demand 52 vs 54): threads contending for the GIL and the cores cost more than the
    extra queue depth gives."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def slot_readers() -> int:
    """Reader threads when reads land in a slot arena and a reader only reads and checks the crc (in a compiled
    loop that never takes the GIL where slot_reads runs; else ISA-L's crc32 releases it): they barely compete with compute,
    and two beat one on the demo at a 25% budget on these 2 cores (les, packed engine, shared machine: 134 and 107
    tok/s against 54 and 77 in two alternating rounds; four: 126, 90)."""
    return max(2, default_workers())


def drop_page_cache(path) -> str:
    """Evict a file from the page cache, so later buffered/mmap reads of it are cold; returns how, or that it was
    not (host.NOT_EVICTED: macOS, whose F_NOCACHE reads neither fill the cache nor empty it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return host.evict(fd, 0, 0, sync=True)
    finally:
        os.close(fd)


def _after(bufs: list, skip: int) -> list:
    """Views of `bufs` past their first `skip` bytes (where a short read resumes)."""
    views = []
    for b in bufs:
        if skip >= b.nbytes:
            skip -= b.nbytes
        else:
            views.append(memoryview(b)[skip:])
            skip = 0
    return views


def _merge(spans, gap: int, overlap: bool = True) -> list:
    """(start, end, member) spans -> [start, end, [members]] groups in file order: a span joins the group before it
    when it starts at most `gap` bytes past that group's end (overlapping and touching spans always do; with
    overlap False an overlapping span does not: reads scattered into buffers need each buffer's range its own)."""
    groups = []
    for start, end, member in sorted(spans, key=lambda s: (s[0], s[1])):
        if groups and start <= groups[-1][1] + gap and (overlap or start >= groups[-1][1]):
            groups[-1][1] = max(groups[-1][1], end)
            groups[-1][2].append(member)
        else:
            groups.append([start, end, [member]])
    return groups


def split_sizes(nbytes: int, workers: int) -> list[int]:
    """The pieces (in file order, 4 KiB-aligned but the last) one read of `nbytes` is split into for `workers`
    readers: one piece a reader at most, none under SPLIT. The simulator splits its reads by the same rule."""
    step = slot_reads.split_step(nbytes, workers)
    return [min(step, nbytes - at) for at in range(0, nbytes, step)]


def _split(groups: list, workers: int) -> list:
    """Merged reads [start, end, [(offset, buf, key, buffer index, where in that buffer)]] cut into the pieces of
    split_sizes: a buffer that straddles a cut is read as two views of it, each member keeping where it starts in
    its buffer (the crc runs are relative to the whole buffer)."""
    out = []
    for start, end, members in groups:
        sizes = split_sizes(end - start, workers)
        if len(sizes) == 1:
            out.append([start, end, members])
            continue
        a = start
        for n in sizes:
            b = a + n
            out.append([a, b, [(max(off, a), buf[max(off, a) - off:min(off + buf.nbytes, b) - off], key, i,
                                at + max(off, a) - off)
                               for off, buf, key, i, at in members if off < b and off + buf.nbytes > a]])
            a = b
    return out


def reads_of(ranges: list, total: int, workers: int) -> tuple[list, int]:
    """(start, end, (offset, buf, key, buffer index, 0)) ranges into buffers -> ([start, end, members] reads, ranges
    merged): touching ranges share a read, one of at least twice SPLIT goes in pieces to `workers` readers, and
    none scatters into more than IOV buffers. (The GIL-free readers' compiled planner, slot_reads._plan_jobs,
    makes the same reads.)"""
    merged = _merge(ranges, 0, overlap=False)
    groups = []
    # no merged read can reach two pieces' size when all of them together do not (split_sizes)
    for g in _split(merged, workers) if total >= 2 * SPLIT else merged:
        members = g[2]
        groups += [g] if len(members) <= IOV else [
            [ms[0][0], ms[-1][0] + ms[-1][1].nbytes, ms] for ms in (members[at:at + IOV]
                                                                   for at in range(0, len(members), IOV))]
    return groups, len(ranges) - len(merged)


def crc_of_runs(bufs, runs) -> int:
    """crc32 over runs (buffer index, start, end) of bufs, in order."""
    crc = 0
    for i, a, z in runs:
        crc = isal_zlib.crc32(bufs[i][a:z], crc)
    return crc


class Reader:
    """Positional reader of one file, or of several (path: a list; see the module's docstring); safe to use from
    many threads."""

    def __init__(self, path, direct: bool = True, workers: int | None = None):
        self.paths = [os.fspath(p) for p in (path if isinstance(path, (list, tuple)) else [path])]
        self.path = self.paths[0] if len(self.paths) == 1 else os.path.commonpath(self.paths)
        self.workers = workers or default_workers()
        self._direct = False                    # O_DIRECT: a short read off a block boundary is the end of the file
        self.cache = "page-cache"
        self.fds = self._open_all(direct)
        self.ends = np.array([os.fstat(fd).st_size for fd in self.fds], np.int64)   # a read may end past one (short)
        self.mode = self.cache if host.has_preadv() else f"{self.cache}+pread"
        self._lock = threading.Lock()
        self._heap: list = []                   # the reader threads' queue: (priority, seq, job), demand reads first
        self._ready = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._landed = threading.Condition(threading.Lock())   # notified each time a job's futures are set
        self._threads: list[threading.Thread] = []
        self._slot_threads: list[threading.Thread] = []     # the GIL-free readers (slot_reads), once started
        self._bytes = self._reads = 0           # the Python path's; stats() adds the GIL-free readers'
        self.merged = 0
        self._read_s = 0.0
        self.retries = 0          # transient errors that a later try of the same read got past
        self._busy = 0            # groups reading on the pool now
        self._closed = False
        self._slots: SlotReads | None = None

    @property
    def fd(self) -> int:
        """The (first) file's descriptor; -1 once closed."""
        return self.fds[0] if self.fds else -1

    def _open_all(self, direct: bool) -> list[int]:
        """An fd a file: uncached where every file allows it (one mode for the reader), else buffered."""
        fds = []
        try:
            if direct:
                for p in self.paths:
                    if (fd := self._open_uncached(p)) < 0:
                        break
                    fds.append(fd)
                else:
                    return fds
                for fd in fds:
                    os.close(fd)
                fds = []
                self._direct, self.cache = False, "page-cache"
            for p in self.paths:
                fds.append(os.open(p, os.O_RDONLY))
            return fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _open_uncached(self, path: str) -> int:
        """An fd whose reads bypass the page cache (self.cache says how), or -1 where the platform or the
        filesystem has no such reads."""
        if hasattr(os, "O_DIRECT"):
            return self._open_direct(path)
        fd = os.open(path, os.O_RDONLY)
        if host.no_cache(fd):
            self.cache = "f_nocache"
            return fd
        os.close(fd)
        return -1

    def _open_direct(self, path: str) -> int:
        """O_DIRECT fd, or -1 if the filesystem refuses O_DIRECT (EINVAL)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return -1
        # Some filesystems accept the open flag and only refuse the read itself.
        try:
            host.preadv(fd, [aligned_empty(ALIGN)], 0)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            return -1
        self._direct = True
        self.cache = "o_direct"
        return fd

    # -- reading ---------------------------------------------------------------

    def _pread(self, buf, pos: int, need: int) -> int:
        """Fill `buf` (an array, or a list of arrays filled in file order by one scattered preadv) from file offset
        `pos` until at least `need` bytes arrived.

        Returns the byte count, which is below `need` only at end of file.
        """
        bufs = buf if isinstance(buf, list) else [buf]
        got = calls = 0
        t0 = time.perf_counter()
        while got < need:
            n = self._preadv_retrying(_after(bufs, got) if got else bufs, pos + got)
            calls += 1
            if n == 0:
                break
            got += n
            # An O_DIRECT short read that ends off a block boundary is EOF; reading
            # on from there would be misaligned (EINVAL).
            if self._direct and got % ALIGN:
                break
        dt = time.perf_counter() - t0
        with self._lock:
            self._reads += calls
            self._bytes += got
            self._read_s += dt
        return got

    def _preadv(self, views: list, pos: int) -> int:
        return host.preadv(self.fds[pos >> SHARD_BITS], views, pos & SHARD_MASK)

    def _preadv_retrying(self, views: list, pos: int) -> int:
        for attempt in range(RETRIES + 1):
            try:
                return self._preadv(views, pos)
            except OSError as e:
                if e.errno not in TRANSIENT or attempt == RETRIES:
                    raise
                with self._lock:
                    self.retries += 1
                time.sleep(0.01 * 2 ** attempt)

    def needed(self, start: int, end: int) -> int:
        """slot_reads.needed of this reader's files."""
        return int(slot_reads.needed(start, end, self.ends))

    def _eof_error(self, offset: int, length: int, file_end: int) -> EOFError:
        return EOFError(f"{self.paths[offset >> SHARD_BITS]}: read past end of file: offset={offset & SHARD_MASK} "
                        f"length={length}, file ends at byte {file_end & SHARD_MASK}")

    def read(self, offset: int, length: int) -> np.ndarray:
        """The `length` bytes at `offset` (a view into an aligned buffer)."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        start, end = _align_out(offset, length)
        buf = aligned_empty(end - start)
        got = self._pread(buf, start, offset + length - start)
        if got < offset + length - start:
            raise self._eof_error(offset, length, start + got)
        return buf[offset - start:offset - start + length]

    def submit(self, requests, merge_gap: int = 0) -> dict:
        """Read `(key, offset, length)` requests on the worker pool.

        Requests whose aligned ranges overlap or are at most `merge_gap` bytes
        apart share one preadv.  Returns {key: Future resolving to the bytes}.
        """
        futures, spans = {}, []
        for key, offset, length in requests:
            if key in futures:
                raise ValueError(f"duplicate key {key!r}")
            if offset < 0 or length < 0:
                raise ValueError(f"bad range for {key!r}: offset={offset} length={length}")
            futures[key] = cf.Future()
            spans.append((*_align_out(offset, length), key, offset, length))
        groups = _merge([(start, end, (key, offset, length)) for start, end, key, offset, length in spans], merge_gap)
        with self._lock:
            self.merged += len(spans) - len(groups)
            self._queue([partial(self._run_group, start, end, members, futures) for start, end, members in groups])
        return futures

    def submit_into(self, requests, priority: int = 0, checks: dict | None = None) -> dict:
        """Read `(key, [(offset, buf), ...])` requests straight into their buffers (offsets, lengths and buffer
        addresses 4096-aligned; a buffer may reach past the end of the file, whose bytes there are left as they
        were): ranges that touch in the file share one preadv, scattered into their buffers (ranges that overlap,
        as a GGUF's experts' 4 KiB-aligned ranges can, do not).
        Lower `priority` is read first (demand 0 before prefetch 1; FIFO within one). A key's future resolves to
        its buffers once all have landed, and fails with a ChecksumError unless the crc32 of its `checks[key]`
        = (runs, crc32) is crc32, runs being (buffer index, start, end) in crc order.

        A plain Reader reads them on GIL-free threads (workbench/slot_reads.py, where it runs: Linux on x86-64);
        a subclass that changes how a read is made (an emulated device, injected faults) on Python threads."""
        checks = checks or {}
        if self._gil_free_readers() is not None:
            keys, parts, rows, crcs = [], [], [], []
            for k, (key, request) in enumerate(requests):
                keys.append(key)
                parts += [(off, buf.nbytes, slot_reads.address(buf), k, i) for i, (off, buf) in enumerate(request)]
                runs, crc = checks.get(key) or ((), -1)
                rows += [(k, *run) for run in runs]
                crcs.append(crc)
            futures = self.submit_parts(keys, np.array(parts, np.int64).reshape(-1, slot_reads.PART),
                                        np.array(rows, np.int64).reshape(-1, slot_reads.CHECK), crcs, priority,
                                        owner=requests)
            for key, request in requests:
                futures[key].bufs = [b for _, b in request]
            return futures
        t_submit = time.perf_counter_ns()
        futures, ranges, total = {}, [], 0
        for key, parts in requests:
            fut = futures[key] = cf.Future()
            fut.bufs, fut.left, fut.check = [b for _, b in parts], 0, checks.get(key)
            fut.priority, fut.t_submit = priority, t_submit
            for i, (off, buf) in enumerate(parts):
                ranges.append((off, off + buf.nbytes, (off, buf, key, i, 0)))
                total += buf.nbytes
        groups, merged = reads_of(ranges, total, self.workers)
        with self._lock:
            self.merged += merged
            for _, _, members in groups:        # a key lands once each of its buffers (or their pieces) has
                for m in members:
                    futures[m[2]].left += 1
            self._queue([partial(self._read_group, g, futures) for g in groups], priority)
            now = time.perf_counter_ns()
            for fut in futures.values():
                fut.t_queued = now
        return futures

    def submit_parts(self, keys: list, parts: np.ndarray, checks: np.ndarray, crcs, priority: int = 0,
                     owner=None) -> dict:
        """submit_into with the reads as arrays (slot_reads.SlotReads.submit: PART and CHECK rows, a key's parts
        together, in key order); owner: what holds the memory at those addresses (kept alive while reads may land
        there). A future's result is only whether the read is good: the buffers are the caller's. Where reads go
        on Python threads (see submit_into), the addresses are made into buffers again."""
        if (slots := self._gil_free_readers()) is not None:
            return slots.submit(keys, parts, checks, crcs, priority, owner)
        requests, chk = [], {}
        for k, key in enumerate(keys):
            mine = parts[parts[:, 3] == k]
            bufs = [slot_reads.buffer_at(a, n) for _, n, a, _, _ in mine]
            requests.append((key, list(zip(mine[:, 0].tolist(), bufs))))
            if crcs[k] >= 0:
                chk[key] = ([tuple(r) for r in checks[checks[:, 0] == k, 1:].tolist()], int(crcs[k]))
        futures = self.submit_into(requests, priority, chk)
        for fut in futures.values():
            fut.owner = owner           # its read's closure holds the future until it has landed
        return futures

    def _gil_free_readers(self) -> SlotReads | None:
        """The GIL-free readers where submit_into reads on them (started on first use), else None."""
        return self._slots or (self._slot_reads() if self._reads_gil_free() else None)

    def _reads_gil_free(self) -> bool:
        """Whether submit_into reads on the GIL-free readers: not where a subclass changes how a read is made
        (faults injected into _pread or _preadv), unless the compiled loop does what it changes (an emulation)."""
        return (slot_reads.runs_here() and type(self)._preadv is Reader._preadv
                and (type(self)._pread is Reader._pread or self.emulation() is not slot_reads.NO_DEVICE))

    def emulation(self) -> np.ndarray:
        """The device the GIL-free readers emulate (slot_reads.emulation), or none."""
        return slot_reads.NO_DEVICE

    def _slot_reads(self) -> SlotReads:
        """The GIL-free readers, started on first use. Each is busy (holds the file open) until close stops it."""
        with self._lock:
            if self._slots is None:
                self._slots = SlotReads(self)
                for i in range(self.workers):
                    t = threading.Thread(target=self._serve_slots, args=(i,), name="io-slot-reader", daemon=True)
                    t.start()
                    self._slot_threads.append(t)
                    self._busy += 1
        return self._slots

    def _serve_slots(self, i: int):
        try:
            self._slots.serve(i)
        finally:
            self._done_reading()

    def _queue(self, jobs, priority: int = 0):
        """Queue reads for the reader threads (started on first use; the lock is held). They are daemon threads:
        a read stuck in the kernel must not hold up the interpreter's exit, as a ThreadPoolExecutor's would (its
        workers are joined at exit)."""
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._serve, name="io-reader", daemon=True)
            t.start()
            self._threads.append(t)
        for job in jobs:
            heapq.heappush(self._heap, (priority, next(self._seq), job))
        self._ready.notify(len(jobs))

    def _serve(self):
        while True:
            with self._lock:
                while not self._heap:
                    self._ready.wait()
                _, _, job = heapq.heappop(self._heap)
                if job is None:
                    return
                self._busy += 1             # in the file: close() leaves the fd open until the last job is out
            try:
                job()
            finally:
                self._done_reading()
                with self._landed:
                    self._landed.notify_all()

    def wait(self, futures, timeout: float, every: bool = False) -> list:
        """The done ones of `futures` (this reader's), once any is done (every: all are), or at `timeout` seconds.
        One condition that the reader threads notify after each read, instead of concurrent.futures.wait's waiter
        objects installed on every future per call (CPU on the compute thread, a dozen calls a token)."""
        if futures and isinstance(futures[0], SlotRead):
            return self._slots.wait(futures, timeout, every)
        with self._landed:
            return wait_for(futures, timeout, every, self._landed.wait)

    def _read_group(self, group, futures):
        start, end, members = group
        t0 = time.perf_counter_ns()
        parts = {}                                      # a key's buffers (or pieces of them) in this group
        for m in members:
            parts[m[2]] = parts.get(m[2], 0) + 1
        try:
            got = self._pread([m[1] for m in members], start, end - start)
            if got < self.needed(start, end):
                raise self._eof_error(start, end - start, start + got)
        except BaseException as e:
            for key in parts:
                if not futures[key].done():
                    futures[key].set_exception(e)
            return
        for key, n in parts.items():
            fut = futures[key]
            with self._lock:
                fut.left -= n
                last = fut.left == 0
                fut.t_start = min(getattr(fut, "t_start", t0), t0)
                fut.t_end = time.perf_counter_ns()
            if last:
                try:
                    if fut.check is not None and (got := crc_of_runs(fut.bufs, fut.check[0])) != fut.check[1]:
                        raise ChecksumError(f"{self.path}: crc32 of {key!r} is {got:08x}, not {fut.check[1]:08x}")
                    fut.set_result(fut.bufs)
                except BaseException as e:
                    fut.set_exception(e)

    def _done_reading(self):
        """A reader thread is out of the file: close() closes it once the last one is."""
        with self._lock:
            self._busy -= 1
            if self._closed and not self._busy:
                self._close_fd()

    def _run_group(self, start, end, members, futures):
        live = [m for m in members if futures[m[0]].set_running_or_notify_cancel()]
        if not live:
            return
        buf = aligned_empty(end - start)
        try:
            got = self._pread(buf, start, max(off + n for _, off, n in live) - start)
        except BaseException as e:
            for key, _, _ in live:
                futures[key].set_exception(e)
            return
        # A short read (EOF) fails only the requests that reach past it.
        for key, off, n in live:
            if off + n <= start + got:
                futures[key].set_result(buf[off - start:off - start + n])
            else:
                futures[key].set_exception(self._eof_error(off, n, start + got))

    # -- bookkeeping -------------------------------------------------------------

    @property
    def poll_ns(self) -> int:
        """How long an idle reader thread polls for the next read before it sleeps (the slot readers'), else 0."""
        return int(self._slots.idle[slot_reads.SPIN_NS]) if self._slots is not None else 0

    def stats(self) -> dict:
        b, n, s, _ = self._slots.totals() if self._slots is not None else (0, 0, 0.0, 0.0)
        with self._lock:
            return {"path": self.path, "mode": self.mode, "bytes_read": self._bytes + b,
                    "reads": self._reads + n, "merged": self.merged, "read_s": self._read_s + s, "retries": self.retries}

    @property
    def bytes_read(self) -> int:
        return self.stats()["bytes_read"]

    def drop_cache(self) -> None:
        for p in self.paths:
            drop_page_cache(p)

    def close(self) -> None:
        """Queued reads are cancelled and the reader threads end; a read stuck in the kernel holds up the caller a
        second at most (the file is closed when it returns)."""
        with self._lock:
            self._heap.clear()
            for _ in self._threads:
                heapq.heappush(self._heap, (float("inf"), next(self._seq), None))
            self._ready.notify_all()
            threads, self._threads = self._threads + self._slot_threads, []
            self._slot_threads = []
            self._closed = True
            if self._slots is not None:
                self._slots.stop()
            if not self._busy:
                self._close_fd()
        deadline = time.monotonic() + 1.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _close_fd(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self._slots is not None:
            self._slots.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
