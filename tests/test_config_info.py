"""`info` before the download: a config.json alone (a directory holding only it, or the file) says what `info` says of
the whole checkpoint, from the shapes: memory by kind, the cache at a budget, the expected reads a token (from a
real model's LRU hit curve, workbench/real_routing.py), the smallest budget that runs, and the verdict."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.memory import memory_needs, tensor_shapes, verdict
from workbench.models.hf import HFModel
from workbench.presets import Budget
from workbench.real_routing import LRU_HITS, lru_hit_rate

REPO = Path(__file__).resolve().parents[1]
COMPARED = ["resident_bytes", "cache_bytes", "needed_bytes", "run_bytes", "all_experts_cache_bytes",
            "expected_read_bytes_per_token", "smallest_budget_bytes"]


def test_the_spec_alone_gives_every_tensor_shape_of_every_family(tiny_models, hybrid_models):
    for family, path in {**tiny_models, **hybrid_models}.items():
        m = HFModel(path)
        assert tensor_shapes(m.spec) == {n: tuple(m.tensor_shape(n)) for n in m.names()}, family


def info(model, *args) -> dict:
    res = subprocess.run([sys.executable, "-m", "workbench", "info", "--model", str(model), "--json", *args],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow
def test_a_config_alone_sizes_the_model_within_5_percent(tmp_path):
    """The demo and every seed shape (make-model, one layer, top-k experts): the config alone agrees with the whole
    checkpoint on every number within 5% (the process's own runtime is the only difference)."""
    from workbench.shapes import SHAPES, make_model
    models = {"demo": REPO / "data" / "models" / "demo-moe"}
    for shape, s in SHAPES.items():
        models[shape] = make_model(shape, 1, tmp_path / shape, experts=s["num_experts_per_tok"])
    for name, whole in models.items():
        alone = tmp_path / f"{name}-config"
        alone.mkdir()
        shutil.copy(whole / "config.json", alone / "config.json")
        for args in [(), ("--preset", "les", "--budget", "0.1")]:
            w = info(whole, *args)
            for where in (alone, alone / "config.json"):
                o = info(where, *args)
                assert o["kind"] == "config" and o["spec"] == w["spec"]
                for k in COMPARED:
                    assert abs(o["memory"][k] - w["memory"][k]) <= 0.05 * w["memory"][k], (name, args, k)


def test_expected_reads_follow_the_measured_hit_curve():
    for fraction, hits in LRU_HITS:
        assert lru_hit_rate(fraction) == hits
    assert lru_hit_rate(0.2) == pytest.approx((0.66 + 0.81) / 2) and lru_hit_rate(2.0) == 1.0
    m = HFModel(REPO / "data" / "models" / "demo-moe")
    s, shapes = m.spec, tensor_shapes(m.spec)
    n = s.num_experts * len(s.moe_layers)
    for budget in ("0.1", "0.25", "0.5"):
        got = memory_needs(s, shapes, Budget(budget), 4096)
        held = Budget(budget).slots(4096, n) / n
        assert got["expected_read_bytes_per_token"] == pytest.approx(
            (1 - lru_hit_rate(held)) * s.top_k * len(s.moe_layers) * 4096)
    per_layer = memory_needs(s, shapes, Budget("0.1"), 4096, scope="per_layer")
    assert per_layer["smallest_budget_slots"] == s.top_k * len(s.moe_layers)


def test_the_verdict_is_one_line_for_each_case(monkeypatch):
    import workbench.memory as memory
    m = HFModel(REPO / "data" / "models" / "demo-moe")
    shapes = tensor_shapes(m.spec)
    for available, starts in [(2**40, "verdict: runs resident"), (16 * 2**20, "verdict: streams"),
                              (2**20, "verdict: does not run here")]:
        monkeypatch.setattr(memory, "available_bytes", lambda available=available: available)
        line = verdict(memory_needs(m.spec, shapes, Budget("0.1"), 4096 * 15))
        assert line.startswith(starts) and "\n" not in line, line
