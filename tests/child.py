"""Run native-library work (llama.cpp) in a fresh child process, so that a crash there (SIGSEGV, SIGILL,
abort) fails the one test that asked, with the signal's name, instead of ending the whole test run."""
from __future__ import annotations

import multiprocessing as mp
import signal
import traceback

import pytest


def _call(conn, fn, args, kw):
    try:
        conn.send(("ok", fn(*args, **kw)))
    except BaseException as e:  # sent back and re-raised in the parent, so pytest.raises works across the boundary
        try:
            conn.send(("raised", e))
        except Exception:       # an exception that does not pickle: its text
            conn.send(("raised", RuntimeError("".join(traceback.format_exception(e)))))
    finally:
        conn.close()


def in_child(fn, *args, timeout: float = 600, **kw):
    """fn(*args, **kw) in a spawned process; its return value, or its exception re-raised here."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call, args=(send, fn, args, kw), daemon=True)
    p.start()
    send.close()
    try:
        got = recv.recv() if recv.poll(timeout) else None   # the result before join: a large one fills the pipe
    except EOFError:                                      # the child died before it could answer
        got = None
    finally:
        recv.close()
    p.join(None if got else 10)
    if got is None:
        if p.is_alive():
            p.kill()
            p.join()
            pytest.fail(f"{fn.__name__} did not finish within {timeout:.0f} s in its child process")
        code = p.exitcode
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        pytest.fail(f"{fn.__name__} crashed its child process ({why})")
    status, value = got
    if status == "raised":
        raise value
    return value
