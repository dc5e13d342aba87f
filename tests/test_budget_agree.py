"""A budget buys the same expert slots wherever it is sized: bench's Session, `info`, the trace replay and the
simulator all count an expert as the engine's cache holds it (engines.slot_bytes) and turn the budget into
slots in one place (Budget.slots). Byte budgets are where they would drift apart: the packed engine's slot of
a q4 or q3 expert is a fraction of the f32 expert numpy holds.

The demo: 8 MoE layers of 32 experts (top-4), an expert 384 KiB in f32, so 96MiB is every expert in f32 and a
few times that many q4 slots; 4MiB and 12MiB hold some of the experts in every engine's unit."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path

import pytest

from experiments.compute_profile import load_compute
from experiments.simulate import run as simulate
from experiments.simulate import replay
from cli import main
from runtime.session import open_session

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "data" / "traces" / "demo-tinystories-256.parquet")
BUDGETS = ("4MiB", "12MiB", "96MiB", "0.1", "0.25", "0.5")
NEEDS = {"mlx": "mlx.core", "llamacpp": "llama_cpp"}       # the engines that need a package of their own


def engine_or_skip(engine):
    if engine == "mlx" and os.environ.get("WORKBENCH_REQUIRE_MLX"):    # CI installs it: a failed import is an error
        importlib.import_module(NEEDS[engine])
    elif engine in NEEDS:
        try:
            importlib.import_module(NEEDS[engine])
        except Exception as e:      # ImportError, or a shared library that does not load
            pytest.skip(f"--engine {engine}: {NEEDS[engine]} is not importable here ({type(e).__name__})")
    return engine


def session_slots(preset, budget, engine):
    with open_session("demo", preset, budget, engine=engine) as s:
        return s.cache.slots, s.slot_bytes


def info_slots(preset, budget, engine, capsys):
    argv = ["info", "--model", "demo", "--budget", budget, "--json"]
    argv += ["--preset", preset] if preset != "on_demand" else []
    argv += ["--engine", engine] if engine else []
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["memory"]["cache_slots"]


def replay_slots(preset, budget, engine):
    kw = {"engine": engine} if engine else {}
    return replay(TRACE, [preset], budget, tokens=2, **kw)["presets"][0]["cache_slots"]


def simulate_slots(preset, budget, engine):
    """The simulator on the measured profile of the demo (benchmarks/compute) as if measured on `engine`: what it
    buys depends on the engine, not on the times."""
    compute = load_compute(REPO / "benchmarks" / "compute" / f"demo-{preset}.json")
    if engine:
        compute = dataclasses.replace(compute, engine=engine)
    return simulate(TRACE, preset, budget, "this-machine", tokens=2, compute=compute, record=False)["cache_slots"]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("preset,engine", [("on_demand", None), ("on_demand", "numpy"), ("on_demand", "packed"),
                                           ("les", None), ("les", "numpy"), ("on_demand", "mlx"),
                                           ("on_demand", "llamacpp")])
def test_bench_info_replay_and_simulate_buy_the_same_slots(preset, engine, budget, capsys):
    engine_or_skip(engine)
    slots, item = session_slots(preset, budget, engine)
    assert 0 < slots
    assert info_slots(preset, budget, engine, capsys) == slots
    assert replay_slots(preset, budget, engine) == slots
    assert simulate_slots(preset, budget, engine) == slots


def test_a_byte_budget_holds_more_packed_experts_than_f32_ones():
    """What the agreement is about: the same bytes buy the packed engine several times the slots of numpy's."""
    packed, numpy_ = session_slots("on_demand", "12MiB", "packed"), session_slots("on_demand", "12MiB", "numpy")
    assert numpy_ == (12 * 2**20 // (4 * 3 * 256 * 128), 4 * 3 * 256 * 128)
    assert packed[0] > 4 * numpy_[0] and packed[0] == 12 * 2**20 // packed[1]
