"""A server in its own process for a test: a free loopback port, started, waited for, stopped."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(cmd: list[str], log, up, timeout: float, stop_s: float = 10, **popen):
    """Run `cmd` (its output to the file `log`) until the block ends; up() is true once it serves, and a test fails
    with the log's tail if it exits or `timeout` seconds pass first. Yields the process."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.time() + timeout
        while not up():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"{' '.join(map(str, cmd))}: not up:\n{open(log).read()[-3000:]}")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
