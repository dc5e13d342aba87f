"""Facts about the machine this process runs on, one place for each: available memory, resident set (now and at
its peak), CPU name, usable cores, Apple silicon, and lowering this process's priority.

Linux answers from /proc (and the cgroup's memory files); macOS from `sysctl`, `vm_stat` and getrusage; any other
POSIX system (or a Linux without /proc) from os.sysconf and getrusage where they say, else None.
SYSTEM is sys.platform, read through this module so that tests can run the macOS branches on Linux
(tests/macos_surface.py, which also supplies their commands' output).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

SYSTEM = sys.platform
F_RDAHEAD_DARWIN = 45      # <sys/fcntl.h>; Python's fcntl names it from 3.13 on
NOT_EVICTED = "not dropped: no posix_fadvise here"


def _proc(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _field_kib(text: str | None, name: str) -> int | None:
    """Bytes of a `name:   N kB` line of a /proc status-like file."""
    for line in (text or "").splitlines():
        if line.startswith(name + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _run(*cmd: str) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def sysctl(name: str) -> str | None:
    """macOS's `sysctl -n name`, or None."""
    out = _run("sysctl", "-n", name) if SYSTEM == "darwin" else None
    return out.strip() if out and out.strip() else None


def vm_stat_available(text: str) -> int | None:
    """Free plus inactive pages of macOS's `vm_stat` output, in bytes (what psutil calls available there)."""
    lines = text.splitlines()
    try:
        page = int(lines[0].split("page size of")[1].split()[0])
        pages = {k.strip(): int(v.strip().rstrip(".")) for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                 if v.strip().rstrip(".").isdigit()}
        return (pages["Pages free"] + pages["Pages inactive"]) * page
    except (IndexError, KeyError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Bytes this process can still take, or None where the system does not say."""
    meminfo = _proc("/proc/meminfo")
    if meminfo is not None:
        avail = _field_kib(meminfo, "MemAvailable")
        if avail is None:
            return None
        cg = Path("/sys/fs/cgroup")
        try:
            limit = (cg / "memory.max").read_text().strip()
            if limit != "max":
                avail = min(avail, int(limit) - int((cg / "memory.current").read_text()))
        except (OSError, ValueError):
            pass
        return max(0, avail)
    if SYSTEM == "darwin":
        out = _run("vm_stat")
        return None if out is None else vm_stat_available(out)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def peak_rss_bytes() -> int:
    """This process's high-water resident set. Linux's VmHWM where /proc has it, not getrusage's ru_maxrss: a
    process started from a larger one (a benchmark's or a test's child) inherits that one's ru_maxrss across fork
    and exec. Elsewhere ru_maxrss (bytes on macOS, KiB on the others)."""
    hwm = _field_kib(_proc("/proc/self/status"), "VmHWM")
    if hwm is not None:
        return hwm
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if SYSTEM == "darwin" else ru * 1024


def reset_peak_rss() -> bool:
    """Start the peak over from the resident set now (Linux's clear_refs); False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes(pid: int | None = None) -> int | None:
    """The resident set now of this process (or `pid`): /proc's VmRSS, else `ps` (KiB on Linux and macOS), else None."""
    rss = _field_kib(_proc(f"/proc/{pid or 'self'}/status"), "VmRSS")
    if rss is not None:
        return rss
    out = _run("ps", "-o", "rss=", "-p", str(pid or os.getpid()))
    try:
        return int(out.split()[0]) * 1024 if out else None
    except (IndexError, ValueError):
        return None


def rss_parts() -> dict:
    """Linux's split of the resident set (VmRSS, RssAnon, RssFile, RssShmem, VmHWM), in bytes; {} without /proc."""
    status = _proc("/proc/self/status")
    return {k: v for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
            if (v := _field_kib(status, k)) is not None}


def cpu_name() -> str:
    """The CPU's model name ("" where the system does not say)."""
    info = _proc("/proc/cpuinfo")
    if info is not None:
        return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return sysctl("machdep.cpu.brand_string") or platform.processor() or ""


def cores() -> int:
    """The cores this process may run on: its affinity where the system has one, else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def apple_silicon() -> bool:
    return SYSTEM == "darwin" and platform.machine() == "arm64"


def lower_priority(nice: int) -> None:
    """Run this process at `nice`. Linux's nice is per thread: every thread of it (later ones inherit it); macOS's
    is the process's."""
    tasks = None
    try:
        tasks = os.listdir("/proc/self/task") if SYSTEM == "linux" else None
    except OSError:
        pass
    for task in tasks or [0]:
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except OSError:
            pass    # a thread that ended since the listing


# -- reads ---------------------------------------------------------------------------


def has_preadv() -> bool:
    return hasattr(os, "preadv")


_LIBC = None


def _pread(fd: int, address: int, n: int, pos: int) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
        _LIBC.pread.restype = ctypes.c_ssize_t
    while True:                     # the GIL is released for the call, as os.preadv releases it
        got = _LIBC.pread(fd, address, n, pos)
        if got >= 0:
            return got
        if (e := ctypes.get_errno()) != errno.EINTR:
            raise OSError(e, os.strerror(e))


def preadv(fd: int, bufs: list, pos: int) -> int:
    """os.preadv where the platform has it; else one pread per buffer, straight into it, up to a short read."""
    if has_preadv():
        return os.preadv(fd, bufs, pos)
    got = 0
    for b in bufs:
        a = np.frombuffer(b, np.uint8)
        n = _pread(fd, a.ctypes.data, a.nbytes, pos + got)
        got += n
        if n < a.nbytes:
            break
    return got


def no_cache(fd: int) -> bool:
    """Make reads of `fd` bypass the page cache the macOS way (F_NOCACHE, and read-ahead off); False where fcntl
    has no F_NOCACHE or the filesystem refuses it."""
    import fcntl
    if not hasattr(fcntl, "F_NOCACHE"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
        fcntl.fcntl(fd, getattr(fcntl, "F_RDAHEAD", F_RDAHEAD_DARWIN), 0)
    except OSError:
        return False
    return True


def evict(fd: int, start: int, n: int, sync: bool = False) -> str:
    """Drop bytes [start, start + n) of `fd`'s file (n 0: to its end) from the page cache: how it was done, or
    NOT_EVICTED where the platform cannot (macOS has no per-file eviction; `sudo purge` empties the whole cache).
    sync: write the file's dirty pages first (DONTNEED leaves them)."""
    if not hasattr(os, "posix_fadvise"):
        return NOT_EVICTED
    if sync:
        os.fdatasync(fd)
    os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
    return "posix_fadvise(DONTNEED)"
