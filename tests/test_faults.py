"""Injected I/O faults (tests/faults.py) against the verbs that read experts.

A read that keeps failing, a stalled read, or a pack truncated mid-run ends the verb with one line naming the file,
the offset and the expert, exit code 2, no hang, and (bench) a run record marked failed with what completed.
Transient errors are retried a bounded number of times and counted; short reads and a pack replaced by rename
while a run is going change nothing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from faults import STALL_S, faults
from cli import main
from workbench.io import RETRIES
from workbench.runs import runs_dir
from runtime.session import open_session
from workbench.store.pack import Pack, convert

FLAGS = ["--preset", "on_demand", "--budget", "0.25"]
VERBS = {
    "generate": ["generate", *FLAGS, "--tokens", "6"],
    "bench": ["bench", *FLAGS, "--tokens", "6"],
    "eval ppl": ["eval", "ppl", *FLAGS, "--ctx", "32", "--chunks", "1", "--no-record"],
    "eval teacher": ["eval", "teacher", *FLAGS, "--ctx", "32", "--chunks", "1", "--no-record"],
    "trace": ["trace", "--engine", "numpy", "--preset", "on_demand", "--tokens", "16"],
}
ERROR = re.compile(r"error: (?:ladder [^:]*: )?(\S+): reading expert (\d+) of layer (\d+) (?:failed )?at offset (\d+) \((\d+) bytes\)")


@pytest.fixture(scope="module")
def pack(tiny_models, tmp_path_factory):
    return convert(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("faults") / "tiny.pack")


@pytest.fixture(scope="module")
def first_expert(pack) -> int:
    """The file offset where expert bytes begin (reads before it are the probe and nothing else)."""
    p = Pack(pack)
    return min(off for L in p.spec.moe_layers for e in range(p.spec.num_experts) for off, _ in p.expert_reads(L, e))


def run_verb(verb, pack, tmp_path, capsys):
    argv = VERBS[verb] + ["--model", str(pack)] + (["--out", str(tmp_path / "t.parquet")] if verb == "trace" else [])
    rc = main(argv + ["--json"])
    out, err = capsys.readouterr()
    return rc, out, err


def generate(pack, **kw):
    with open_session(str(pack), "on_demand", budget="0.25", **kw) as s:
        out = s.generate("Once upon a time", tokens=8)
        return out["tokens"], s.summary()


def assert_names_the_read(err, pack, like=None):
    """like: a pack with the same layout, for one that is no longer whole."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]    # (eval's progress bars go before)
    assert len(lines) == 1 and "Traceback" not in err, err
    m = ERROR.match(lines[0])
    assert m and m[1] == str(pack), lines[0]
    L, e, off, n = int(m[3]), int(m[2]), int(m[4]), int(m[5])
    assert (off, n) in Pack(like or pack).expert_reads(L, e)      # the offset and length are that expert's own
    return lines[0]


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_read_that_keeps_failing(verb, pack, first_expert, tmp_path, capsys, monkeypatch, fast_probe):
    with faults(monkeypatch, lambda call, pos, n, r: "eio" if pos >= first_expert else None):
        rc, out, err = run_verb(verb, pack, tmp_path, capsys)
    assert rc == 2 and out == ""
    assert "Input/output error" in assert_names_the_read(err, pack)
    assert not (tmp_path / "t.parquet").exists()


@pytest.mark.macos
def test_a_failed_bench_is_recorded_as_failed(pack, first_expert, tmp_path, capsys, monkeypatch, fast_probe):
    """The warm-up and prefill read fine; the disk fails from the third decode step's reads on."""
    state = {"armed": False}

    def plan(call, pos, n, reader):
        return "eio" if state["armed"] and pos >= first_expert else None

    import experiments.bench as wb
    real_measure = wb.measure

    def measure(session, prompt, tokens, warmup=4, warm=False):
        def on_step(*a):
            if session.tel.summary()["decode_steps"] >= 2:
                state["armed"] = True
        real_step = session.step
        session.step = lambda ids, phase: (on_step(), real_step(ids, phase))[1]
        return real_measure(session, prompt, tokens, warmup, warm)

    monkeypatch.setattr(wb, "measure", measure)
    before = set(os.listdir(runs_dir())) if runs_dir().exists() else set()
    with faults(monkeypatch, plan):
        rc, out, err = run_verb("bench", pack, tmp_path, capsys)
    assert rc == 2 and "failed run recorded in" in assert_names_the_read(err, pack)
    new = [runs_dir() / d for d in set(os.listdir(runs_dir())) - before]
    assert len(new) == 1 and not (new[0] / "summary.json").exists()
    failed = json.loads((new[0] / "failed.json").read_text())
    assert failed["status"] == "failed" and "Input/output error" in failed["error"]
    assert failed["decode_steps"] >= 2 and failed["prefill_tokens"] > 0


@pytest.mark.macos
def test_transient_errors_are_retried_and_counted(pack, first_expert, monkeypatch):
    clean, _ = generate(pack)
    failed_once = set()

    def plan(call, pos, n, reader):       # every expert read fails once, then succeeds
        if pos >= first_expert and pos not in failed_once:
            failed_once.add(pos)
            return "eio"

    with faults(monkeypatch, plan):
        tokens, summary = generate(pack)
    assert tokens == clean
    assert summary["read_retries"] == len(failed_once) > 0


def test_retries_are_bounded(pack, first_expert, monkeypatch):
    calls = []

    def plan(call, pos, n, reader):
        if pos >= first_expert:
            calls.append(pos)
            return "eio"

    with faults(monkeypatch, plan), pytest.raises(Exception, match="Input/output error"):
        generate(pack)
    assert 0 < max(calls.count(p) for p in set(calls)) <= RETRIES + 1


@pytest.mark.macos
def test_short_reads_change_nothing(pack, first_expert, monkeypatch):
    clean, _ = generate(pack)
    with faults(monkeypatch, lambda call, pos, n, r: "short" if pos >= first_expert else None):
        tokens, summary = generate(pack)
    assert tokens == clean and summary["read_retries"] == 0


def test_a_stalled_read_fails_within_the_timeout(pack, first_expert, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORKBENCH_READ_TIMEOUT", "0.5")
    t0 = time.monotonic()
    with faults(monkeypatch, lambda call, pos, n, r: "stall" if pos >= first_expert else None):
        rc, out, err = run_verb("generate", pack, tmp_path, capsys)
    took = time.monotonic() - t0
    assert rc == 2 and "did not complete within 0.5 s" in assert_names_the_read(err, pack)
    assert took < STALL_S, f"the verb waited {took:.1f} s: for the stalled read, not the timeout"


def test_a_pack_truncated_mid_run(pack, first_expert, tmp_path, capsys, monkeypatch):
    victim = tmp_path / "victim.pack"
    shutil.copy(pack, victim)
    cut = Pack(victim).header["file_size"] // 2

    def plan(call, pos, n, reader):
        if pos >= first_expert and os.path.getsize(victim) > cut:
            os.truncate(victim, cut)          # the file shrinks under the running verb

    with faults(monkeypatch, plan):
        rc, out, err = run_verb("generate", victim, tmp_path, capsys)
    assert rc == 2 and "past the end of the file" in assert_names_the_read(err, victim, like=pack)


def test_a_pack_replaced_mid_run(pack, first_expert, tmp_path, monkeypatch):
    """Replaced by rename (as convert writes): the run keeps reading the file it opened, and finishes unchanged."""
    victim, other = tmp_path / "victim.pack", tmp_path / "other.pack"
    shutil.copy(pack, victim)
    clean, _ = generate(victim)

    once = threading.Lock()         # two reader threads may ask at once: one of them replaces the file

    def plan(call, pos, n, reader):
        if pos >= first_expert and once.acquire(blocking=False):
            other.write_bytes(b"\0" * 4096)
            os.replace(other, victim)

    with faults(monkeypatch, plan):
        tokens, _ = generate(victim)
    assert tokens == clean and victim.stat().st_size == 4096


# ---------------------------------------------------------------- serve, eval lm

@pytest.mark.macos
def test_serve_a_read_fault_fails_the_request_not_the_server(pack, first_expert, monkeypatch):
    """The request whose reads fail gets a 500 naming the read; the next one is answered as before the fault."""
    from evals.server import make_server
    from test_eval_server import jcall
    armed = threading.Event()
    ask = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    with faults(monkeypatch, lambda call, pos, n, r: "eio" if armed.is_set() and pos >= first_expert else None), \
            open_session(str(pack), "on_demand", budget="0.25") as s:
        srv = make_server(s, "127.0.0.1", 0, model_id="tiny", quiet=True)
        th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        th.start()
        try:
            clean = jcall(srv, "POST", "/v1/completions", ask)
            armed.set()
            failed = jcall(srv, "POST", "/v1/completions", ask)
            armed.clear()
            again = jcall(srv, "POST", "/v1/completions", ask)
        finally:
            srv.shutdown()
            srv.server_close()
            th.join(5)
    assert clean[0] == 200 and again[0] == 200, (failed, again)
    assert again[1]["choices"][0]["text"] == clean[1]["choices"][0]["text"]
    status, body = failed
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "Input/output error" in assert_names_the_read("error: " + body["error"]["message"], pack)


def test_eval_lm_a_read_that_keeps_failing(pack, first_expert, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with faults(monkeypatch, lambda call, pos, n, r: "eio" if pos >= first_expert else None):
        rc = main(["eval", "lm", "--tasks", "arc_easy", "--limit", "2", "--model", str(pack), *FLAGS, "--quiet",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "Input/output error" in assert_names_the_read(err, pack)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


# ---------------------------------------------------------------- ladder (its rungs are sweep cells on Ray)

def test_ladder_a_read_that_keeps_failing(pack, first_expert, tmp_path, capsys, monkeypatch):
    """Every rung fails in its Ray worker: one line naming the read and the failed record brought home,
    exit 2, nothing on stdout, and under runs/ only whole failed records."""
    ray = pytest.importorskip("ray")
    from faults import eio_in_workers
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2 ** 20, logging_level="ERROR",
             runtime_env=eio_in_workers(first_expert))
    try:
        rc = main(["ladder", "les", "--model", str(pack), "--tokens", "3", "--rounds", "1", "--json"])
    finally:
        ray.shutdown()
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    line = assert_names_the_read(err, pack)
    assert line.startswith("error: ladder les, rung 'on_demand': ") and "Input/output error" in line
    records = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "sweeps")
    assert records and all(not p.name.startswith(".") and {"failed.json", "config.json"} <= {f.name for f in p.iterdir()}
                           and not (p / "summary.json").exists() for p in records)
    named = [p for p in records if f"failed run recorded in {p})" in line]
    assert len(named) == 1 and json.loads((named[0] / "config.json").read_text())["rung"] == "on_demand"
    failed = json.loads((named[0] / "failed.json").read_text())
    assert failed["status"] == "failed" and "Input/output error" in failed["error"]
    table = pq.read_table(tmp_path / "runs" / "sweeps" / "ladder_les.parquet").to_pylist()
    assert {r["status"] for r in table} == {"failed"} and {r["run"] for r in table} == set(map(str, records))


def test_a_stalled_read_does_not_hold_up_the_process_exit(pack, first_expert, tmp_path):
    """The verb fails at the read timeout and the process ends then, not when the stalled read returns (reader
    threads are daemons: a ThreadPoolExecutor's workers would be joined at exit). A read stuck in the kernel in
    uninterruptible sleep still holds the exit until the kernel gives it up: results/reliability.md."""
    stall = 30.0
    script = tmp_path / "stall.py"
    script.write_text(
        "import sys, faults, workbench.devices\n"
        f"faults.STALL_S = {stall}\n"
        "workbench.devices.Reader = type('F', (faults.FaultyReader,), {'plan': staticmethod("
        f"lambda c, pos, n, r: 'stall' if pos >= {first_expert} else None)}})\n"
        "from cli import main\n"
        f"sys.exit(main(['generate', '--model', {str(pack)!r}, *{FLAGS!r}, '--tokens', '4', '--engine', 'numpy']))\n")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{here.parent}{os.pathsep}{here}", "WORKBENCH_READ_TIMEOUT": "0.5"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=2 * stall)
    took = time.monotonic() - t0
    assert out.returncode == 2 and "did not complete within 0.5 s" in assert_names_the_read(out.stderr, pack)
    assert took < stall, f"the process took {took:.1f} s to end: it waited for the stalled read"
