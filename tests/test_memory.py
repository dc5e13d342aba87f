"""The memory guard: a configuration that cannot fit in available memory is refused up front, naming what it
needs and what is available; `info` says the largest budget that fits."""
from __future__ import annotations

import json
import re

import pytest

import workbench.memory as memory
from engines import slot_bytes
from cli import main
from workbench.memory import largest_budget, memory_needs
from workbench.presets import Budget
from workbench.store.pack import Pack, convert

MiB = 2 ** 20


@pytest.fixture(scope="module")
def pack(tiny_models, tmp_path_factory):
    return convert(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("mem") / "tiny.pack")


@pytest.fixture(scope="module")
def sizes(pack):
    p = Pack(pack)
    m = memory_needs(p.spec, {n: t["shape"] for n, t in p.tensors.items()}, Budget("all"), slot_bytes("numpy", p))
    return m["resident_f32_bytes"], m["all_experts_cache_bytes"]


def test_available_memory_is_what_the_system_reports():
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 0 < memory.available_bytes() <= total


def test_model_bytes_are_what_a_resident_session_holds(pack, sizes):
    from runtime.session import open_session
    dense, experts = sizes
    with open_session(str(pack), "resident", budget="all", engine="numpy") as s:      # sizes counts f32 experts
        assert experts == s.all_expert_bytes
        held = sum(w.nbytes for k, w in s.engine.w.items() if k != "lm_head" or "lm_head" in s.pack.tensors)
        assert dense == held


def test_a_budget_that_cannot_fit_is_refused_with_the_numbers(pack, sizes, monkeypatch, capsys):
    dense, experts = sizes
    monkeypatch.setattr(memory, "available_bytes", lambda: dense + experts // 4)
    assert main(["generate", "--model", str(pack), "--engine", "numpy", "--budget", "all", "--tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    m = re.search(r"needs (\d+) MiB .* (\d+) MiB available: choose a smaller --budget \(largest that fits: (0\.\d\d)\)",
                  err)
    assert m, err
    assert int(m[1]) == round((dense + experts) / MiB) and int(m[2]) == round((dense + experts // 4) / MiB)
    assert m[3] == "0.25"
    assert main(["generate", "--model", str(pack), "--engine", "numpy", "--budget", m[3], "--tokens", "2", "--json"]) == 0


def test_what_fits():
    assert largest_budget(100, 1000, available=2000) == "all"
    assert largest_budget(100, 1000, available=430) == "0.33"
    assert largest_budget(100, 1000, available=50).startswith("none")


def test_info_says_what_fits(pack, sizes, monkeypatch, capsys):
    dense, experts = sizes
    monkeypatch.setattr(memory, "available_bytes", lambda: dense + experts // 2)
    assert main(["info", "--model", str(pack), "--engine", "numpy", "--budget", "all", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert {k: mem[k] for k in ("available_bytes", "resident_f32_bytes", "all_experts_cache_bytes", "needed_bytes",
                                "largest_budget")} == {
        "available_bytes": dense + experts // 2, "resident_f32_bytes": dense, "all_experts_cache_bytes": experts,
        "needed_bytes": dense + experts, "largest_budget": "0.50"}
    assert main(["info", "--model", str(pack), "--engine", "numpy", "--budget", "0.25", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["needed_bytes"] == dense + experts // 4


def test_info_and_the_guard_use_the_same_numbers(pack, monkeypatch, capsys):
    """The budget info says fits is accepted; one that info says needs more than is available is refused."""
    assert main(["info", "--model", str(pack), "--budget", "0.5", "--json"]) == 0
    need = json.loads(capsys.readouterr().out)["memory"]["needed_bytes"]
    monkeypatch.setattr(memory, "available_bytes", lambda: need)
    assert main(["generate", "--model", str(pack), "--budget", "0.5", "--tokens", "1", "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    assert main(["generate", "--model", str(pack), "--budget", "0.5", "--tokens", "1"]) == 2
    assert f"needs {round(need / MiB)} MiB" in capsys.readouterr().err


def test_expert_reads_leave_no_cyclic_garbage(pack):
    """Streamed experts are freed when the cache lets them go, not at the next full GC: a long-running server's
    RSS stays flat (the cycle read future -> callback -> futures once kept every read buffer alive)."""
    import gc
    from concurrent.futures import Future
    from runtime.session import open_session
    with open_session(str(pack), "on_demand", budget="0.25") as s:
        s.generate("Once upon a time", tokens=2)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            s.generate("Once upon a time", tokens=6)
            gc.collect()
            futures = [o for o in gc.garbage if isinstance(o, Future)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert futures == []


def test_the_guard_counts_the_weights_as_each_engine_holds_them(pack, sizes, monkeypatch):
    """The guard follows what an engine declares it holds (engines/base.py, resident_bytes), not its name: numpy
    holds the non-expert weights in f32, packed its encoded matrices (q4 here) and f32 for the rest, both beside
    their expert cache; llama.cpp holds its own GGUF and is given only the routers and norms."""
    from engines import engine_class
    from engines.packed_engine import Encoded
    from workbench.errors import WorkbenchError
    from runtime.session import open_session
    p = Pack(pack)
    dense, _ = sizes
    held = {}
    for engine in ("numpy", "packed"):
        with open_session(str(pack), "resident", engine=engine) as s:
            held[engine] = sum(w.nbytes for k, w in s.engine.w.items() if k != "lm_head" or "lm_head" in p.tensors)
            assert engine_class(engine).resident_bytes(p) == held[engine]
            assert engine == "numpy" or any(isinstance(w, Encoded) for w in s.engine.w.values())
    assert held["numpy"] == dense and held["packed"] < dense / 2 and engine_class("llamacpp").resident_bytes(p) is None
    for engine in ("numpy", "packed"):
        monkeypatch.setattr(memory, "available_bytes", lambda: held[engine] // 2)
        with pytest.raises(WorkbenchError, match="needs"):
            open_session(str(pack), "resident", engine=engine)
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable (pip install -e '.[llamacpp]')")
    with open_session(str(pack), "resident", engine="llamacpp") as s:
        assert all(n.endswith(("router", "norm", "router_bias")) for n in s.engine.w)
        assert {f"layers.{i}.router" for i in s.spec.moe_layers} <= set(s.engine.w)


def test_a_safetensors_shard_is_read_slice_by_slice_without_holding_the_file(tmp_path):
    """convert and export-gguf read a Hugging Face checkpoint one tensor (one expert of a fused tensor) at a time:
    reading every slice of a 256 MiB shard grows the process's peak resident set by far less than the shard."""
    import subprocess
    import sys
    import numpy as np
    from safetensors.numpy import save_file
    shard = tmp_path / "model.safetensors"
    save_file({"experts.down_proj": np.ones((64, 1024, 1024), np.float32)}, str(shard))
    script = f"""
import json
from pathlib import Path
from workbench.models.hf import Shard
from workbench.host import peak_rss_bytes
sh = Shard(Path({str(shard)!r}))
before = peak_rss_bytes()
total = sum(float(sh.array("experts.down_proj", e)[0, 0]) for e in range(64))
print(json.dumps({{"grew": peak_rss_bytes() - before, "total": total}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert out["total"] == 64.0
    assert out["grew"] < shard.stat().st_size / 8, out


@pytest.mark.parametrize("engine", ["packed", "numpy"])
def test_a_closed_session_leaves_nothing_of_its_own_to_the_garbage_collector(engine):
    """close() lets go of the reader and the slot arena, and no part of a session refers back to another in a cycle:
    once dropped, its weights, cache and reads are freed at once (reference counting), not at the next full
    collection."""
    import gc
    import weakref
    from runtime.session import open_session
    gc.disable()
    try:
        with open_session("demo", "les", "0.25", engine=engine) as s:
            s.generate("Once upon a time", tokens=4)
            parts = {name: weakref.ref(getattr(s, name)) for name in ("engine", "streamer", "cache", "reader", "tel")}
            parts["schedule"] = weakref.ref(s.streamer.schedule)
            parts["experts"] = weakref.ref(s.engine.experts)
        del s
        alive = sorted(name for name, ref in parts.items() if ref() is not None)
    finally:
        gc.enable()
    assert alive == []
