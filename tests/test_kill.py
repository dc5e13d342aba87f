"""Crash-safe writes, proven by killing: each writer is SIGKILLed at seeded random moments of its run, then
  - the destination is the old file or the complete new one, never a mix or a stub,
  - a temp file the killed writer left is ignored by readers and removed by the next write to that path,
  - running again succeeds.
KILLS moments per writer (spread over a clean run's duration); WORKBENCH_KILLS=N tries N. The two trainers take
minutes on two cores (corpus encoding, a 300 MB demo checkpoint per step), so they run with WORKBENCH_KILL_TRAINERS=1.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from workbench.registry import block_experts
from workbench.runs import list_runs, read_run
from workbench.store.pack import Pack

REPO = Path(__file__).resolve().parents[1]
KILLS = int(os.environ.get("WORKBENCH_KILLS", 2))
trainer = pytest.mark.skipif(not os.environ.get("WORKBENCH_KILL_TRAINERS"),
                             reason="minutes on two cores: WORKBENCH_KILL_TRAINERS=1 runs it")


def start(*argv, stderr=subprocess.PIPE, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env})


def finish(*argv, **env) -> float:
    """Run to the end; its wall time."""
    t0 = time.monotonic()
    p = start(*argv, **env)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-2000:]
    return time.monotonic() - t0


def killed_at(seconds: float, *argv, **env) -> bool:
    """Start, SIGKILL after `seconds`; False if it finished first."""
    p = start(*argv, **env)
    try:
        p.wait(seconds)
        return False
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return True


def moments(duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return sorted(rng.uniform(0.1, 1.0) * duration for _ in range(KILLS))


def temps(path: Path) -> list[Path]:
    return list(path.parent.glob(f".{path.name}.*.tmp"))


def watched(argv, dst: Path, kill_at: float | None = None, in_write: bool = False, **env) -> tuple[bool, float, float]:
    """Run, SIGKILL `kill_at` seconds after the start (in_write: after dst's temp file appeared). Returns (killed,
    seconds run, seconds from the temp file's appearance to the end)."""
    err = tempfile.TemporaryFile()
    p = start(*argv, stderr=err, **env)
    t0, t_temp = time.monotonic(), None
    while p.poll() is None:
        now = time.monotonic()
        if t_temp is None and temps(dst):
            t_temp = now
        base = t_temp if in_write else t0
        if kill_at is not None and base is not None and now - base >= kill_at:
            p.kill()
            p.wait()
            return True, now - t0, now - (t_temp or now)
        time.sleep(0.001)
    err.seek(0)
    assert kill_at is not None or p.returncode == 0, err.read().decode()[-2000:]
    end = time.monotonic()
    return False, end - t0, end - (t_temp or end)


def kill_and_check(argv, dst: Path, old: bytes, is_new, seed: int, **env) -> list[str]:
    """Restore the old file, kill the writer at KILLS moments of its run and KILLS moments of its write (after its
    temp file appears), and check what is left each time. Returns the outcomes."""
    dst.write_bytes(old)
    _, duration, writing = watched(argv, dst, **env)
    new = dst.read_bytes()
    assert is_new(dst) and new != old
    rng, outcomes = random.Random(seed), []
    plan = [(rng.uniform(0.1, 1.0) * duration, False) for _ in range(KILLS)] + \
           [(rng.uniform(0.0, 1.0) * writing, True) for _ in range(KILLS)]
    for t, in_write in plan:
        dst.write_bytes(old)
        killed, _, _ = watched(argv, dst, kill_at=t, in_write=in_write, **env)
        now = dst.read_bytes()
        assert now == old or is_new(dst), f"killed at {t:.3f} s: {dst} is neither the old file nor a whole new one"
        outcomes.append(f"{'write+' if in_write else ''}{t:.3f}s:{'old' if now == old else 'new'}"
                        f"{'' if killed else '(finished)'}")
    left = temps(dst)
    assert watched(argv, dst, **env)[0] is False   # running again succeeds, and sweeps what the killed ones left
    assert is_new(dst) and not temps(dst), (left, temps(dst))
    print(f"{dst.name}: {outcomes}; temp files left by kills: {len(left)}")
    return outcomes


def test_convert(tiny_models, tmp_path):
    src, dst = tiny_models["qwen3_moe"], tmp_path / "tiny.pack"
    subprocess.run([sys.executable, "-m", "workbench", "convert", str(src), str(dst), "--experts", "q8"], check=True,
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)

    def whole_q4(path):
        p, data = Pack(path), np.fromfile(path, np.uint8)
        for L in p.spec.moe_layers:                # every expert's bytes match their checksum
            for e in range(p.spec.num_experts):
                p.decode_expert(L, e, [data[off:off + n] for off, n in p.expert_reads(L, e)])
        return p.quant["experts"] == block_experts("q4")       # convert's default (ggml's blocks where installed)

    kill_and_check(["-m", "workbench", "convert", str(src), str(dst)], dst, dst.read_bytes(), whole_q4, seed=1)


def test_export_gguf(tiny_models, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[llamacpp]')")
    from workbench.models.gguf_model import GGUFModel
    src, dst = tiny_models["qwen3_moe"], tmp_path / "tiny.gguf"
    argv = ["-m", "workbench", "export-gguf", "--model", str(src), str(dst)]
    finish(*argv, "--type", "q8_0")

    def whole_f16(path):
        g = GGUFModel(path)
        return "F16" in {t.tensor_type.name for t in g.reader.tensors} and g.expert(0, 0)["gate"].shape[0] > 0

    kill_and_check(argv + ["--type", "f16"], dst, dst.read_bytes(), whole_f16, seed=2)


def test_bench_run_records(tiny_models, tmp_path):
    """A run record is a directory renamed into place: every listed run reads whole; a killed writer's temp
    directory is hidden (a dot name) and never listed."""
    runs = tmp_path / "runs"
    argv = ["-m", "workbench", "bench", "--model", str(tiny_models["qwen3_moe"]), "--tokens", "4", "--json"]
    duration = finish(*argv, WORKBENCH_RUNS=str(runs))
    for t in moments(duration, seed=3):
        killed_at(t, *argv, WORKBENCH_RUNS=str(runs))
        for r in list_runs(runs):
            assert read_run(r)["summary"]["tok_s"] > 0
    n = len(list_runs(runs))
    finish(*argv, WORKBENCH_RUNS=str(runs))
    assert len(list_runs(runs)) == n + 1


@trainer
def test_edge0_prerouter_training(tiny_models, tmp_path):
    from workbench.edge0.artifacts import load_safetensors
    dst = tmp_path / "prerouter.safetensors"
    argv = ["-m", "training.edge0_prerouter", "--model", str(tiny_models["qwen3_moe"]), "--windows", "4",
            "--ctx", "32", "--batch", "32", "--out", str(dst)]
    finish(*argv, "--steps", "5", "--seed", "1")
    old = dst.read_bytes()

    def whole_new(path):
        t, meta = load_safetensors(path, "prerouter")
        return meta["steps"] == 20 and all(v.size for v in t.values())

    kill_and_check(argv + ["--steps", "20", "--seed", "2"], dst, old, whole_new, seed=4)


@trainer
def test_demo_trainer_checkpoint(tmp_path):
    """The checkpoint (weights, optimizer, RNG, step) written every step: a kill leaves the last whole one, and a
    restart resumes from it to the end."""
    import torch
    out = tmp_path / "train"
    argv = ["-m", "training.demo", "--out", str(out), "--batch", "1", "--ctx", "16", "--ckpt-every", "1",
            "--threads", "1"]
    ck = out / "ckpt.pt"
    finish(*argv, "--steps", "1")
    steps = []
    duration = finish(*argv, "--steps", "2")             # resumes at 1, writes 2
    for i, t in enumerate(moments(duration, seed=5)):
        killed_at(t, *argv, "--steps", str(3 + i))        # each run resumes from the last whole checkpoint
        steps.append(torch.load(ck, weights_only=False)["step"])
    assert steps == sorted(steps) and steps[0] >= 2
    finish(*argv, "--steps", str(3 + KILLS))
    assert torch.load(ck, weights_only=False)["step"] == 3 + KILLS and not temps(ck)
    print(f"demo trainer: checkpoint steps after each kill: {steps}")


def test_the_next_write_sweeps_only_dead_writers_temps(tmp_path):
    from workbench.atomic import atomic_write
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dst = tmp_path / "f.json"
    left, live = tmp_path / f".f.json.{dead.pid}-1.tmp", tmp_path / ".f.json.1-1.tmp"   # pid 1 is always running
    left.write_text("half")
    live.write_text("being written")
    atomic_write(dst, "{}")
    assert dst.read_text() == "{}" and not left.exists() and live.exists()
