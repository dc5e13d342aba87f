"""Device profiles and the emulated reader: every read takes at least what the profile allows, and returns real bytes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from workbench import devices, disk_probe, slot_reads
from workbench.errors import WorkbenchError
from workbench.io import aligned_empty

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def data_file():
    root = REPO / ".pytest_tmp"
    root.mkdir(exist_ok=True)
    fd, path = tempfile.mkstemp(dir=root)
    payload = np.random.default_rng(0).integers(0, 256, 4 * 2**20, dtype=np.uint8).tobytes()
    os.write(fd, payload)
    os.close(fd)
    yield path, payload
    os.unlink(path)


def test_every_shipped_profile_loads_and_cites_a_source_for_each_number():
    assert {"ufs22-phone", "tv-box", "iphone-les", "mac-mini-m4", "this-machine"} <= set(devices.names())
    for name in devices.names():
        prof = devices.load(name)
        raw = json.loads((devices.DEVICES / f"{name}.json").read_text())
        for key in raw["read"]:
            assert raw["sources"].get(key), f"{name}: {key} has no source"
        assert prof.read_s(4096, 1) > 0 and prof.peak_bw >= prof.read_bw


def test_read_time_model_matches_the_seed_numbers_for_the_ufs_phone():
    p = devices.load("ufs22-phone")
    lone_4k = 4096 / p.read_s(4096, 1) / 1e6                   # smolmaxxing: 28-81 MB/s for single 4 KB reads
    assert 28 <= lone_4k <= 81
    deep = 4 * 256 * 1024 / p.read_s(256 * 1024, 4) / 1e6      # about 940 MB/s with 2-4 reads of 256 KB in flight
    assert 800 <= deep <= 940


def test_emulated_reader_never_completes_a_read_earlier_than_its_profile_allows(data_file):
    path, payload = data_file
    prof = devices.DeviceProfile("slow", "test", latency_s=2e-3, read_bw=50e6, peak_bw=80e6, queue_depth=3)
    with devices.EmulatedReader(path, prof) as r:
        r.log = []
        reqs = [(i, i * 300_000 + 17, 200_000 + i * 1000) for i in range(9)]
        futs = r.submit(reqs)
        for key, off, n in reqs:                               # the bytes are the file's, read for real
            assert futs[key].result().tobytes() == payload[off:off + n]
        assert bytes(r.read(5, 1000)) == payload[5:1005]
        assert len(r.log) == 10 and max(d for _, d, _, _ in r.log) > 1   # reads overlapped on the pool
        for nbytes, depth, t0, t1 in r.log:
            assert t1 - t0 >= prof.read_s(nbytes, depth), (nbytes, depth, t1 - t0)
        assert r.stats()["device"]["emulated"] and "emulated:slow" in r.mode


@pytest.mark.skipif(not slot_reads.AVAILABLE, reason="GIL-free readers run on Linux x86-64 only")
def test_emulated_reads_into_slots_run_in_the_gil_free_readers_and_never_end_early(data_file):
    """The packed engine's reads (into slots) are emulated inside the compiled reader loop, as the real device's
    reads run there: same bytes, each read no shorter than the profile's time at the depth it started at."""
    path, payload = data_file
    prof = devices.DeviceProfile("slow", "test", latency_s=2e-3, read_bw=50e6, peak_bw=80e6, queue_depth=3)
    n = 64 * 1024
    with devices.EmulatedReader(path, prof) as r:
        r.log = []
        bufs = {i: aligned_empty(n) for i in range(9)}
        futs = r.submit_into([(i, [(2 * i * n, b)]) for i, b in bufs.items()])      # apart: one read each
        assert len(r.wait(list(futs.values()), 30, every=True)) == 9
        for i, b in bufs.items():
            assert b.tobytes() == payload[2 * i * n:(2 * i + 1) * n]
        assert r._slots is not None, "read on Python threads, not the compiled loop"
        assert len(r.log) == 9 and max(d for _, d, _, _ in r.log) > 1       # reads overlapped on the pool
        for nbytes, depth, t0, t1 in r.log:
            assert 1 <= depth <= prof.queue_depth and t1 - t0 >= prof.read_s(nbytes, depth), (nbytes, depth, t1 - t0)
        assert r.stats()["emulated_wait_s"] > 0 and r.stats()["bytes_read"] == 9 * n


def test_profile_fitted_to_a_probe_reproduces_its_lone_reads():
    probe = {"path": "x", "mode": "o_direct", "points": [
        {"size": 4096, "depth": 1, "mb_s": 40.0, "lat_ms_p50": 0.1},
        {"size": 2**20, "depth": 1, "mb_s": 1000.0, "lat_ms_p50": 1.05},
        {"size": 2**20, "depth": 4, "mb_s": 1600.0, "lat_ms_p50": 2.6}]}
    d = disk_probe.profile_from_probe(probe, "m", "m")
    assert d["read"] == {"latency_us": pytest.approx(95.9, abs=0.1), "read_mb_s": 1000.0, "peak_mb_s": 1600.0,
                         "queue_depth": 4}


def test_unknown_device_is_a_one_line_error():
    with pytest.raises(WorkbenchError, match="no such profile"):
        devices.load("pager-on-a-toaster")


def test_a_ladder_rung_runs_on_the_emulated_device_it_is_given(tmp_path, monkeypatch):
    """ladder --device: the rung's bench cell carries the device, and its bench reads through the profile."""
    from experiments.grid import Cell, run_bench
    from workbench.presets import get_preset
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path))
    cell = Cell.of("bench", "demo", get_preset("on_demand"), "on_demand", budget="0.25", tokens=2, rounds=1,
                   device="ufs22-phone")
    res = run_bench(cell)
    assert res["emulated"] and res["device"]["name"] == "ufs22-phone" and "emulated:ufs22-phone" in res["reader_mode"]
    plain = Cell.of("bench", "demo", get_preset("on_demand"), "on_demand", budget="0.25", tokens=2, rounds=1)
    assert "device" not in dict(plain.settings)                    # a cell without one is the cell it always was
