"""The workbench on macOS, checked on Linux: the macOS surface itself (tests/macos_surface.py), the machine's facts
as workbench/host.py reads them there, the engine a Mac chooses, and the llama.cpp peer's GPU layers.
Tests marked `macos` elsewhere (streaming, bench, serve, the live page's workers) run once more on the surface."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import macos_surface
from workbench import host
from workbench import io as wio

# vm_stat on a Mac mini (macOS 15), as it prints
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3016.
Pages active:                            467005.
Pages inactive:                          462171.
Pages speculative:                         2513.
Pages throttled:                              0.
Pages wired down:                        183512.
Pages purgeable:                           8761.
"Translation faults":                 912344123.
Pages copy-on-write:                   26547617.
"""


def _real_proc(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_the_surface_takes_linux_from_os_and_proc_from_every_process_it_starts():
    take_off = macos_surface.apply()
    try:
        for name in ("O_DIRECT", "posix_fadvise", "eventfd", "sched_getaffinity", "preadv", "fdatasync"):
            assert not hasattr(os, name), name
        with pytest.raises(FileNotFoundError):
            open("/proc/self/status")
        with pytest.raises(FileNotFoundError):
            os.listdir("/proc/self/task")
        assert host.SYSTEM == "darwin" and not os.path.exists("/sys/fs/cgroup")
        # the child's workbench reads no /proc: its CPU's name is sysctl's (tests/macos_site/bin)
        child = subprocess.run([sys.executable, "-c", "import os, workbench.host as h; print(hasattr(os, 'O_DIRECT'), "
                                "h.SYSTEM, h.cpu_name())"], capture_output=True, text=True)
        assert child.stdout.split() == ["False", "darwin", "Apple", "M4", "Pro"], child.stderr
    finally:
        take_off()
    assert hasattr(os, "O_DIRECT") and os.path.exists("/proc/self/status") and host.SYSTEM == sys.platform


def test_vm_stat_available_is_free_plus_inactive_pages():
    assert host.vm_stat_available(VM_STAT) == (3016 + 462171) * 16384
    assert host.vm_stat_available("no numbers here") is None


@pytest.mark.macos
def test_the_machine_facts_come_from_where_the_system_keeps_them(surface):
    """Linux: /proc; macOS: vm_stat, sysctl and getrusage (in bytes there); the resident set from `ps`."""
    available = host.available_memory_bytes()
    if surface == "macos":
        out = subprocess.run(["vm_stat"], capture_output=True, text=True).stdout
        assert available > 0 and abs(available - host.vm_stat_available(out)) < 0.1 * available   # memory moves
        assert host.cpu_name() == "Apple M4 Pro"
        assert host.cores() == os.cpu_count()
        assert host.reset_peak_rss() is False and host.rss_parts() == {}
    else:
        assert 0 < available <= host._field_kib(_real_proc("/proc/meminfo"), "MemTotal")
        assert host.cpu_name() and host.cpu_name() != "Apple M4 Pro"
        assert host.cores() == len(os.sched_getaffinity(0))
        assert set(host.rss_parts()) >= {"VmHWM", "VmRSS"}
    rss = host.rss_bytes()
    assert rss is not None and 10 * 2**20 < rss <= 1.1 * host.peak_rss_bytes()   # over 10 MiB: Python with numpy
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert 0 < host.rss_bytes(child.pid) < rss        # another process's, by its id (benchmarks/server_load.py)
    finally:
        child.kill()
        child.wait()


def test_peak_rss_on_the_surface_is_getrusages_in_bytes_and_agrees_with_linux():
    linux = host.peak_rss_bytes()
    take_off = macos_surface.apply()
    try:
        mac = host.peak_rss_bytes()
    finally:
        take_off()
    assert 0.5 * linux <= mac <= 2 * linux     # VmHWM against ru_maxrss: the same high-water mark, read twice


@pytest.mark.macos
def test_the_cold_page_cache_says_how_it_was_dropped_or_that_it_was_not(tmp_path, surface):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    how = wio.drop_page_cache(path)
    assert how == (host.NOT_EVICTED if surface == "macos" else "posix_fadvise(DONTNEED)")


def test_pread_per_buffer_stops_at_the_end_of_the_file(tmp_path, monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, 10000, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    monkeypatch.delattr(os, "preadv")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        bufs = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
        assert host.preadv(fd, bufs, 100) == 9900
        np.testing.assert_array_equal(np.concatenate(bufs)[:9900], data[100:])
        assert host.preadv(fd, [np.zeros(16, np.uint8)], 20000) == 0
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        host.preadv(fd, [np.zeros(16, np.uint8)], 0)      # closed: EBADF, as os.preadv raises


@pytest.fixture(scope="module")
def q4_pack(tiny_models, tmp_path_factory):
    from workbench.store.pack import convert
    return convert(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("mac") / "tiny.pack")


def test_apple_silicon_with_mlx_defaults_to_the_mlx_engine_and_engine_still_chooses(q4_pack, monkeypatch):
    import platform

    from engines import available, default_engine
    from runtime.session import open_session
    from workbench.store.pack import Pack
    pytest.importorskip("mlx.core")
    pack = Pack(q4_pack)
    assert default_engine(pack) == "packed"
    monkeypatch.setattr(host, "SYSTEM", "darwin")
    assert default_engine(pack) == "packed"             # an Intel Mac: no MLX default
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert "mlx" in available() and default_engine(pack) == "mlx" and default_engine() == "mlx"
    with open_session(str(q4_pack), "on_demand", budget="0.5") as s:
        assert s.engine.name == "mlx" and s.config()["engine"] == "mlx"
    with open_session(str(q4_pack), "on_demand", budget="0.5", engine="packed") as s:
        assert s.engine.name == "packed"


def test_the_llamacpp_peer_offloads_every_layer_only_on_a_gpu_build_on_apple_silicon(monkeypatch):
    import platform

    from engines import llamacpp_engine as le
    lc = pytest.importorskip("llama_cpp")
    assert le.gpu_layers_here() == (0 if not host.apple_silicon() or not lc.llama_supports_gpu_offload() else 999)
    monkeypatch.setattr(host, "SYSTEM", "darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(lc, "llama_supports_gpu_offload", lambda: False)
    assert le.gpu_layers_here() == 0                   # a CPU-only build
    monkeypatch.setattr(lc, "llama_supports_gpu_offload", lambda: True)
    assert le.gpu_layers_here() == le.ALL_LAYERS       # the Metal build
