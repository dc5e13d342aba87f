"""Where the live page listens, as the Makefile starts it, and the one-command booth (dashboards/booth.py).

`make demo` and `make booth` are read with `make -n` (their recipes as make would run them), run with this
interpreter, and the listening sockets of the server read back: this machine only unless HOST says otherwise.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dashboards import booth as B  # noqa: E402
from dashboards import kiosk as K  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe(target: str, *assignments: str) -> list[str]:
    """The command `make TARGET` runs (the venv taken as made), split as the shell would."""
    out = subprocess.run(["make", "-s", "-n", "-o", ".venv/.runtime", target, *assignments], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()
    return shlex.split(out[-1])


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def listening(pid: int) -> set[tuple[str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def serve_until(cmd: list[str], port: int, done, timeout: float = 180):
    """Run cmd (its python replaced by this interpreter) until done(port, log) is true, then terminate it; returns
    (what the server listens on, the log). Nothing it started outlives it."""
    log = Path(os.environ["WORKBENCH_RUNS"]).parent / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *cmd[1:]], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.time() + timeout
        while not done(port, log.read_text()):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"{shlex.join(cmd)}: not up:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        children = psutil.Process(proc.pid).children(recursive=True)
        return listening(proc.pid), log.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if "children" in locals():
            gone, alive = psutil.wait_procs(children, timeout=15)
            assert not alive, f"{shlex.join(cmd)} left {[p.cmdline() for p in alive]} running"


def healthy(port: int, _log: str = "") -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).status == 200
    except OSError:
        return False


def test_make_demo_listens_on_this_machine_only():
    port = free_port()
    cmd = recipe("demo", f"PORT={port}")
    assert cmd[1:4] == ["-m", "streamlit", "run"] and option(cmd, "--server.address") == "127.0.0.1"
    addresses, _ = serve_until([*cmd, "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
                               port, healthy)
    assert addresses == {("127.0.0.1", port)}


def test_host_opens_the_page_to_a_network_when_asked():
    assert option(recipe("demo", "HOST=0.0.0.0"), "--server.address") == "0.0.0.0"
    assert option(recipe("booth"), "--host") == "127.0.0.1"
    assert option(recipe("booth", "HOST=0.0.0.0"), "--host") == "0.0.0.0"
    assert K.is_local("127.0.0.1") and K.is_local("::1") and K.is_local("localhost")
    assert not K.is_local(None) and not K.is_local("") and not K.is_local("0.0.0.0") and not K.is_local("10.1.2.3")


def test_make_booth_prepares_then_serves_the_kiosk_on_this_machine_only():
    port = free_port()
    cmd = recipe("booth", f"PORT={port}", "ARGS=--designs on_demand,les --tokens 4")
    assert cmd[1:3] == ["-m", "dashboards.booth"]
    addresses, log = serve_until(cmd, port, lambda p, log: "booth: ready after" in log and healthy(p))
    assert addresses == {("127.0.0.1", port)}
    assert "booth: preparing 1/2: on_demand: its pack of demo" in log and "preparing 2/2: les" in log


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model"], "/nonexistent/model: no such model"),
    (["--trace", "/nonexistent/t.parquet"], "/nonexistent/t.parquet: no such trace file"),
    (["--shape", "gpt-5"], "--shape 'gpt-5': choose one of"),
    (["--shape", "qwen3.6-35b-a3b", "--model", "demo2"], "--shape replaces --model"),
    (["--device", "nokia-3310"], "--device 'nokia-3310': choose one of"),
    (["--designs", "les,warp"], "--designs warp: not presets"),
    (["--designs", "on_demand,les,smol,history,oracle"], f"--designs: at most {K.MAX_DESIGNS}"),
    (["--tokens", "0"], "--tokens 0: between 1 and 2048"),
])
def test_a_bad_booth_option_is_one_line_and_exit_2(args, message, capsys):
    assert B.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_the_booth_prepares_what_its_rounds_open(tmp_path):
    from dashboards.common import booth_round
    names = [what.split(":")[0] for what, _ in B.steps(K.Booth())]
    assert names == list(dict.fromkeys(booth_round(0)[1] + booth_round(1)[1]))
    trace = tmp_path / "mine.parquet"
    trace.write_bytes((REPO / "data" / "traces" / "demo-tinystories-256.parquet").read_bytes())
    booth = B.booth_from(B.args_parser().parse_args(["--model", str(REPO / "data" / "models" / "demo-moe"),
                                                     "--trace", str(trace), "--designs", "les"]))
    assert booth.models == {"demo-moe": str(REPO / "data" / "models" / "demo-moe")} and booth.model == "demo-moe"
    assert booth.traces == {"mine": str(trace)} and booth.trace == "mine"
    cfg, notes = K.settings({}, booth)
    assert not notes and cfg["model"] == booth.models["demo-moe"] and cfg["routing_trace"] == str(trace)
    assert K.settings({"model": "demo"}, booth)[0]["model"] == "demo", "the registered models stay on the list"


def test_a_taken_port_ends_the_booth_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "dashboards.booth", "--designs", "on_demand,les,smol", "--port",
                              str(port)], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("error: the page's server exited"), res.stderr[-2000:]
