"""The macOS surface on Linux, for tests: Python's `os` reduced to what macOS's has, fcntl with macOS's F_NOCACHE
and F_RDAHEAD, getrusage's ru_maxrss in bytes (macOS's unit), no /proc and no /sys, workbench.host answering as
on macOS (sysctl and vm_stat: tests/macos_site/bin), and all of it in every Python process a test starts
(tests/macos_site/sitecustomize.py, through PYTHONPATH).

The names taken from `os` are typeshed's (stdlib/os/__init__.pyi) Linux-only ones and those it lists as missing
on macOS, and preadv (Pythons built against macOS SDKs before 11 lack it: the reads fall back to pread).

What this cannot check: anything macOS's kernel does (whether F_NOCACHE reads bypass the cache, what vm_stat
and sysctl print on a real Mac, Metal, Apple silicon's MLX, the GIL-free readers never running there), and
libraries' own Linux code: they choose it by sys.platform, which stays linux (the surface hides /proc from the
repository's code only; threadpoolctl, for one, reads /proc/self/maps here and asks dyld on a Mac).
"""
from __future__ import annotations

import builtins
import errno
import io
import os
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = str(HERE.parent) + os.sep
STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
SITE = HERE / "macos_site"
FLAG = "WORKBENCH_TEST_MACOS_SURFACE"       # set in the environment of the processes a reduced test starts
F_NOCACHE, F_RDAHEAD = 48, 45               # macOS's <sys/fcntl.h>; no Linux fcntl command has these numbers

LINUX_ONLY = """GRND_NONBLOCK GRND_RANDOM MFD_ALLOW_SEALING MFD_CLOEXEC MFD_HUGETLB MFD_HUGE_16GB MFD_HUGE_16MB
MFD_HUGE_1GB MFD_HUGE_1MB MFD_HUGE_256MB MFD_HUGE_2GB MFD_HUGE_2MB MFD_HUGE_32MB MFD_HUGE_512KB MFD_HUGE_512MB
MFD_HUGE_64KB MFD_HUGE_8MB MFD_HUGE_MASK MFD_HUGE_SHIFT O_DIRECT O_LARGEFILE O_NOATIME O_PATH O_RSYNC O_TMPFILE
P_PIDFD RTLD_DEEPBIND SCHED_BATCH SCHED_IDLE SCHED_RESET_ON_FORK XATTR_CREATE XATTR_REPLACE XATTR_SIZE_MAX
copy_file_range getrandom getxattr listxattr memfd_create pidfd_open removexattr setxattr
CLONE_FILES CLONE_FS CLONE_NEWCGROUP CLONE_NEWIPC CLONE_NEWNET CLONE_NEWNS CLONE_NEWPID CLONE_NEWTIME CLONE_NEWUSER
CLONE_NEWUTS CLONE_SIGHAND CLONE_SYSVSEM CLONE_THREAD CLONE_VM setns unshare PIDFD_NONBLOCK
EFD_CLOEXEC EFD_NONBLOCK EFD_SEMAPHORE RWF_APPEND SPLICE_F_MORE SPLICE_F_MOVE SPLICE_F_NONBLOCK eventfd eventfd_read
eventfd_write splice""".split()
NOT_DARWIN = """POSIX_FADV_DONTNEED POSIX_FADV_NOREUSE POSIX_FADV_NORMAL POSIX_FADV_RANDOM POSIX_FADV_SEQUENTIAL
POSIX_FADV_WILLNEED RWF_DSYNC RWF_HIPRI RWF_NOWAIT RWF_SYNC ST_APPEND ST_MANDLOCK ST_NOATIME ST_NODEV ST_NODIRATIME
ST_NOEXEC ST_RELATIME ST_SYNCHRONOUS ST_WRITE fdatasync getresgid getresuid pipe2 posix_fadvise posix_fallocate
sched_getaffinity sched_getparam sched_getscheduler sched_param sched_rr_get_interval sched_setaffinity sched_setparam
sched_setscheduler setresgid setresuid""".split()
NO_PREADV = ["preadv", "pwritev"]
REMOVED = LINUX_ONLY + NOT_DARWIN + NO_PREADV

nocache_fds: set[int] = set()       # fds given F_NOCACHE 1 in this process (no read-ahead: rdahead_off_fds)
rdahead_off_fds: set[int] = set()


def _from_the_project() -> bool:
    """Whether the call being guarded comes from the repository's code (through the standard library, as pathlib's
    opens do): libraries choose their code by sys.platform, still linux here, and run their macOS code on a Mac."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(STDLIB) or name == __file__ or name.startswith("<"):
            f = f.f_back
            continue
        return name.startswith(REPO) and "site-packages" not in name
    return False


def hidden(path) -> bool:
    if isinstance(path, int) or not _from_the_project():
        return False
    try:
        p = os.fsdecode(path)
    except TypeError:
        return False
    return any(p == d or p.startswith(d + "/") for d in ("/proc", "/sys"))


def _missing(path):
    return FileNotFoundError(errno.ENOENT, "No such file or directory (the macOS surface has no /proc, no /sys)",
                             os.fsdecode(path))


def _guard(real):
    def guarded(path, *args, **kwargs):
        if hidden(path):
            raise _missing(path)
        return real(path, *args, **kwargs)
    guarded.__wrapped__ = real
    return guarded


def _fcntl(real):
    def fcntl(fd, cmd, arg=0, *rest):
        if cmd in (F_NOCACHE, F_RDAHEAD):   # accepted as macOS accepts them; Linux's page cache is not bypassed
            fd = fd if isinstance(fd, int) else fd.fileno()
            os.fstat(fd)                    # EBADF as the real call would
            if cmd == F_NOCACHE:
                (nocache_fds.add if arg else nocache_fds.discard)(fd)
            else:
                (rdahead_off_fds.discard if arg else rdahead_off_fds.add)(fd)
            return 0
        return real(fd, cmd, arg, *rest)
    return fcntl


def _getrusage(real):
    import resource

    def getrusage(who):
        r = real(who)
        return resource.struct_rusage(tuple(r[:2]) + (r.ru_maxrss * 1024,) + tuple(r[3:]))
    return getrusage


class _HostAsDarwin:
    """A meta-path finder that sets workbench.host.SYSTEM to "darwin" once the module is loaded (a child process
    imports it after this surface is on)."""

    def find_spec(self, name, path=None, target=None):
        if name != "workbench.host":
            return None
        from importlib.machinery import PathFinder
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_set(module):
                exec_module(module)
                module.SYSTEM = "darwin"
            spec.loader.exec_module = exec_and_set
        return spec


def put_env(undo: list, key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    undo.append(lambda: os.environ.pop(key) if old is None else os.environ.__setitem__(key, old))


def apply():
    """Put the surface on this process (and, through the environment, on the processes it starts); returns the
    function that takes it off."""
    import fcntl
    import resource
    undo = []

    def put(obj, name, value):
        had = hasattr(obj, name)
        old = getattr(obj, name, None)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    for name in REMOVED:
        if hasattr(os, name):
            old = getattr(os, name)
            delattr(os, name)
            undo.append(lambda name=name, old=old: setattr(os, name, old))
    for obj, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "listdir"), (os, "scandir"),
                      (os, "stat"), (os, "lstat"), (os, "access")):
        put(obj, name, _guard(getattr(obj, name)))
    put(fcntl, "F_NOCACHE", F_NOCACHE)
    real_close = os.close

    def close(fd):
        nocache_fds.discard(fd)            # a later open may get the same number
        rdahead_off_fds.discard(fd)
        real_close(fd)
    put(os, "close", close)
    put(fcntl, "fcntl", _fcntl(fcntl.fcntl))
    put(resource, "getrusage", _getrusage(resource.getrusage))
    finder = _HostAsDarwin()
    sys.meta_path.insert(0, finder)
    undo.append(lambda: sys.meta_path.remove(finder))
    if "workbench.host" in sys.modules:
        put(sys.modules["workbench.host"], "SYSTEM", "darwin")
    for key, first in (("PYTHONPATH", SITE), ("PATH", SITE / "bin")):
        old = os.environ.get(key)
        if str(first) not in (old or "").split(os.pathsep):
            put_env(undo, key, os.pathsep.join([str(first)] + ([old] if old else [])))
    put_env(undo, FLAG, "1")

    def take_off():
        for step in reversed(undo):
            step()
        nocache_fds.clear()
        rdahead_off_fds.clear()
    return take_off
