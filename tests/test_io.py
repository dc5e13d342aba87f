import errno
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from workbench import disk_probe, io as wio

SIZE = 3 * 1024 * 1024 + 1234  # not a multiple of 4096: the last block is partial


def o_direct_supported(path) -> bool:
    """Independent check: does this filesystem accept an aligned O_DIRECT read?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        os.preadv(fd, [wio.aligned_empty(4096)], 0)
        return True
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)


@pytest.fixture
def disk_dir():
    """A directory on the repository's disk (/tmp may be tmpfs, which can refuse O_DIRECT)."""
    root = Path(__file__).resolve().parents[1] / ".pytest_tmp"
    root.mkdir(exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=root))
    yield d
    shutil.rmtree(d)
    try:
        root.rmdir()
    except OSError:
        pass


@pytest.fixture(params=["tmp", "disk"])
def where(request, tmp_path):
    return tmp_path if request.param == "tmp" else request.getfixturevalue("disk_dir")


@pytest.fixture
def pack(where):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = where / "pack.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_aligned_empty():
    for n in (0, 1, 4096, 10_000):
        buf = wio.aligned_empty(n)
        assert buf.dtype == np.uint8 and buf.shape == (n,)
        assert n == 0 or buf.ctypes.data % 4096 == 0  # an empty view has no meaningful address
    assert wio.aligned_empty(100, align=512).ctypes.data % 512 == 0


@pytest.mark.macos
def test_modes_are_labelled(pack, surface):
    """Linux: O_DIRECT where the filesystem takes it; macOS: F_NOCACHE with read-ahead off on the file, and one
    pread per buffer where os has no preadv."""
    import macos_surface
    path, _ = pack
    if surface == "macos":
        uncached, reads = "f_nocache", "+pread"
    else:
        uncached, reads = ("o_direct" if o_direct_supported(path) else "page-cache"), ""
    with wio.Reader(path) as r:
        assert r.mode == uncached + reads
        assert (r.fd in macos_surface.nocache_fds and r.fd in macos_surface.rdahead_off_fds) == (surface == "macos")
    with wio.Reader(path, direct=False) as r:
        assert r.mode == "page-cache" + reads and r.fd not in macos_surface.nocache_fds


def test_f_nocache_reads_with_preadv_where_os_has_it(pack, monkeypatch):
    """macOS 11 and later: F_NOCACHE, and preadv scattering a read into several buffers."""
    import macos_surface
    path, data = pack
    preadv = os.preadv
    take_off = macos_surface.apply()
    try:
        monkeypatch.setattr(os, "preadv", preadv, raising=False)
        with wio.Reader(path) as r:
            assert r.mode == "f_nocache" and r.fd in macos_surface.nocache_fds
            bufs = [wio.aligned_empty(4096), wio.aligned_empty(8192)]
            r.submit_into([("k", [(4096, bufs[0]), (8192, bufs[1])])])["k"].result(timeout=10)
            assert r.stats()["reads"] == 1      # one scattered preadv
            np.testing.assert_array_equal(np.concatenate(bufs), data[4096:16384])
    finally:
        monkeypatch.undo()
        take_off()


def test_falls_back_only_on_einval(pack, monkeypatch):
    path, data = pack
    real_open = os.open

    def refusing_open(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", p)
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    with wio.Reader(path) as r:
        assert r.mode == "page-cache"
        np.testing.assert_array_equal(r.read(5, 7000), data[5:7005])
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError):
        wio.Reader(path.with_name("missing.bin"))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.macos
def test_read_unaligned_ranges(pack, direct):
    path, data = pack
    rnd = random.Random(1)
    ranges = [(0, 1), (1, 4095), (4095, 2), (4096, 4096), (0, SIZE), (SIZE - 1, 1), (SIZE - 5000, 5000), (17, 0)]
    ranges += [(o, rnd.randrange(0, min(300_000, SIZE - o) + 1)) for o in rnd.sample(range(SIZE), 30)]
    with wio.Reader(path, direct=direct) as r:
        for off, n in ranges:
            got = r.read(off, n)
            assert got.dtype == np.uint8 and got.shape == (n,)
            np.testing.assert_array_equal(got, data[off:off + n])


def test_aligned_read_is_a_view_of_an_aligned_buffer(pack):
    path, data = pack
    with wio.Reader(path) as r:
        got = r.read(8192, 65536)
        assert got.base is not None and got.ctypes.data % 4096 == 0
        np.testing.assert_array_equal(got, data[8192:8192 + 65536])
        assert r.stats()["bytes_read"] == 65536 and r.stats()["reads"] == 1


def test_bytes_read_counts_alignment_padding(pack):
    path, _ = pack
    with wio.Reader(path) as r:
        r.read(1, 10)
        r.read(4090, 10)  # straddles a block boundary: two blocks
        s = r.stats()
    assert s["bytes_read"] == 3 * 4096 and s["reads"] == 2 and s["merged"] == 0 and s["read_s"] > 0


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.macos
def test_submit_random_ranges_exact(pack, direct):
    path, data = pack
    rnd = random.Random(2)
    reqs = []
    for i in range(200):
        off = rnd.randrange(SIZE)
        reqs.append((("expert", i), off, rnd.randrange(0, min(100_000, SIZE - off) + 1)))
    with wio.Reader(path, direct=direct, workers=4) as r:
        futs = r.submit(reqs)
        assert set(futs) == {k for k, _, _ in reqs}
        for key, off, n in reqs:
            np.testing.assert_array_equal(futs[key].result(timeout=10), data[off:off + n])
        s = r.stats()
    assert s["reads"] + s["merged"] >= 1 and s["bytes_read"] > 0


def test_submit_merges_adjacent_ranges(pack):
    path, data = pack
    reqs = [(i, 1000 + i * 10_000, 10_000) for i in range(20)]  # contiguous, unaligned
    random.Random(3).shuffle(reqs)
    with wio.Reader(path) as r:
        futs = r.submit(reqs)
        for key, off, n in reqs:
            np.testing.assert_array_equal(futs[key].result(timeout=10), data[off:off + n])
        s = r.stats()
    assert s["merged"] == 19 and s["reads"] == 1 < len(reqs)
    start, end = 0, -(-(1000 + 20 * 10_000) // 4096) * 4096
    assert s["bytes_read"] == end - start


def test_submit_merge_gap(pack):
    path, _ = pack
    reqs = [(i, i * 3 * 4096, 4096) for i in range(10)]  # 8 KiB holes between them
    with wio.Reader(path) as r:
        [f.result() for f in r.submit(reqs).values()]
        assert r.stats()["merged"] == 0 and r.stats()["reads"] == 10
    with wio.Reader(path) as r:
        [f.result() for f in r.submit(reqs, merge_gap=8192).values()]
        s = r.stats()
        assert s["merged"] == 9 and s["reads"] == 1 and s["bytes_read"] == 28 * 4096


def test_submit_rejects_duplicate_keys(pack):
    path, _ = pack
    with wio.Reader(path) as r, pytest.raises(ValueError, match="duplicate"):
        r.submit([("a", 0, 10), ("a", 100, 10)])


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.macos
def test_read_past_eof_names_file_offset_length(pack, direct):
    path, _ = pack
    with wio.Reader(path, direct=direct) as r:
        with pytest.raises(EOFError) as e:
            r.read(SIZE - 10, 100)
        msg = str(e.value)
        assert str(path) in msg and str(SIZE - 10) in msg and "100" in msg
        fut = r.submit([("x", SIZE + 8192, 5), ("ok", 0, 5)])
        assert str(path) in str(fut["x"].exception(timeout=10))
        assert fut["ok"].result(timeout=10).shape == (5,)
        # merged into one read that comes up short: only the request past EOF fails
        fut = r.submit([("in", SIZE - 20, 10), ("out", SIZE - 10, 20)])
        assert r.stats()["merged"] == 1
        assert fut["in"].result(timeout=10).shape == (10,)
        assert "offset=%d length=20" % (SIZE - 10) in str(fut["out"].exception(timeout=10))


def test_truncated_file_raises(pack):
    path, data = pack
    with wio.Reader(path) as r:
        os.truncate(path, 100_000)
        np.testing.assert_array_equal(r.read(0, 100_000), data[:100_000])
        with pytest.raises(EOFError, match=str(path)):
            r.read(90_000, 20_000)


@pytest.mark.macos
def test_drop_cache_and_close(pack):
    path, data = pack
    r = wio.Reader(path, direct=False)
    r.read(0, 4096)
    r.drop_cache()
    np.testing.assert_array_equal(r.read(100, 50), data[100:150])
    r.close()
    r.close()  # idempotent
    assert r.fd == -1


@pytest.mark.macos
def test_probe_disk_scratch_file(where):
    before = set(os.listdir(where))
    probe = disk_probe.probe_disk(where, sizes=(4096, 65536), depths=(1, 2), seconds_per_point=0.01)
    assert set(os.listdir(where)) == before  # scratch file removed
    assert probe["path"] == str(where) and probe["mode"] in ("o_direct", "page-cache", "f_nocache+pread")
    assert [(p["size"], p["depth"]) for p in probe["points"]] == [(4096, 1), (4096, 2), (65536, 1), (65536, 2)]
    for p in probe["points"]:
        assert p["mb_s"] > 0 and p["reads"] >= p["depth"] and 0 < p["lat_ms_p50"] <= p["lat_ms_p99"]
    assert probe["best_mb_s"] == max(p["mb_s"] for p in probe["points"])


def test_probe_disk_reads_a_large_pack_in_place(disk_dir):
    path = disk_dir / "big.pack"
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse is enough: only the file's own reads matter
    probe = disk_probe.probe_disk(path, sizes=(65536,), depths=(1,), seconds_per_point=0.01)
    assert os.listdir(disk_dir) == ["big.pack"]
    assert len(probe["points"]) == 1 and probe["points"][0]["mb_s"] > 0


def test_bandwidth_at_takes_the_best_depth_interpolated_in_log_size():
    probe = {"points": [
        {"size": 4096, "depth": 1, "mb_s": 10.0}, {"size": 4096, "depth": 4, "mb_s": 30.0},
        {"size": 262144, "depth": 1, "mb_s": 200.0}, {"size": 262144, "depth": 4, "mb_s": 500.0},
    ]}
    assert disk_probe.bandwidth_at(probe, 4096) == pytest.approx(30e6)
    assert disk_probe.bandwidth_at(probe, 32768) == pytest.approx(265e6)       # half way in log size: 2**12 .. 2**15 .. 2**18
    assert disk_probe.bandwidth_at(probe, 262144) == pytest.approx(500e6)
    assert disk_probe.bandwidth_at(probe, 1024) == pytest.approx(30e6)         # outside the probed sizes: the nearest
    assert disk_probe.bandwidth_at(probe, 10 * 1024 * 1024) == pytest.approx(500e6)


def test_bandwidth_at_a_queue_depth_takes_the_best_depth_up_to_it():
    probe = {"points": [{"size": 4096, "depth": 1, "mb_s": 10.0}, {"size": 4096, "depth": 2, "mb_s": 20.0},
                        {"size": 4096, "depth": 4, "mb_s": 30.0}]}
    assert disk_probe.bandwidth_at(probe, 4096, depth=2) == pytest.approx(20e6)
    assert disk_probe.bandwidth_at(probe, 4096, depth=3) == pytest.approx(20e6)
    assert disk_probe.bandwidth_at(probe, 4096, depth=8) == pytest.approx(30e6)
    assert disk_probe.bandwidth_at({"points": probe["points"][1:]}, 4096, depth=1) == pytest.approx(20e6)  # the lowest


def test_split_sizes_give_each_reader_a_piece_of_a_large_read_and_leave_small_ones_whole():
    K = wio.KiB
    assert wio.split_sizes(200 * K, 4) == [200 * K]                     # under two pieces' worth: whole
    assert wio.split_sizes(1024 * K, 4) == [256 * K] * 4                # a piece a reader
    assert wio.split_sizes(1024 * K, 2) == [512 * K] * 2                # no more pieces than readers
    assert wio.split_sizes(700 * K, 4) == [352 * K, 348 * K]            # none under 256 KiB; 4 KiB-aligned cuts
    assert wio.split_sizes(1945 * K + 7, 1) == [1945 * K + 7]


class _PythonReads(wio.Reader):
    """Reads on Python threads (a subclass that changes how a read is made), not the GIL-free readers."""

    def _pread(self, bufs, offset, length):
        return super()._pread(bufs, offset, length)


@pytest.mark.parametrize("cls", [wio.Reader, _PythonReads])
@pytest.mark.macos
def test_a_large_read_into_buffers_lands_in_pieces_on_several_readers_and_is_checked_whole(pack, cls):
    """An expert of three parts (1.1 MiB) read by three readers: three pieces, cut inside the parts, each into its
    own view of the part's buffer; the key's crc over its runs (which the cuts split) is checked whole, and a wrong
    crc is still caught."""
    import zlib
    path, data = pack
    K = wio.KiB
    parts = [(4096, 400 * K), (4096 + 400 * K, 300 * K), (4096 + 700 * K, 424 * K)]
    runs = [(0, 0, 400 * K), (1, 0, 300 * K), (2, 0, 424 * K)]
    crc = zlib.crc32(data[4096:4096 + 1124 * K])
    with cls(path, workers=3) as r:
        bufs = [wio.aligned_empty(n) for _, n in parts]
        fut = r.submit_into([("e", [(off, b) for (off, _), b in zip(parts, bufs)])], checks={"e": (runs, crc)})["e"]
        assert [b.ctypes.data for b in fut.result(timeout=30)] == [b.ctypes.data for b in bufs]
        for (off, n), b in zip(parts, bufs):
            np.testing.assert_array_equal(b, data[off:off + n])
        assert r.stats()["reads"] == len(wio.split_sizes(1124 * K, 3)) == 3
        bad = r.submit_into([("x", [(off, wio.aligned_empty(n)) for off, n in parts])], checks={"x": (runs, crc ^ 1)})
        with pytest.raises(wio.ChecksumError):
            bad["x"].result(timeout=30)


@pytest.mark.macos
def test_adjacent_experts_merged_into_one_read_are_cut_across_keys_and_each_lands_checked(pack):
    """Two experts side by side in the file, 600 KiB each: one merged read of 1200 KiB, cut for four readers into
    pieces of 300 KiB, so each piece boundary falls inside a key's buffer or between keys."""
    import zlib
    path, data = pack
    K = wio.KiB
    spans = {"a": (8192, 600 * K), "b": (8192 + 600 * K, 600 * K)}
    with wio.Reader(path, workers=4) as r:
        bufs = {k: wio.aligned_empty(n) for k, (_, n) in spans.items()}
        futs = r.submit_into([(k, [(off, bufs[k])]) for k, (off, _) in spans.items()],
                             checks={k: ([(0, 0, n)], zlib.crc32(data[off:off + n])) for k, (off, n) in spans.items()})
        for k, (off, n) in spans.items():
            assert futs[k].exception(timeout=30) is None
            np.testing.assert_array_equal(bufs[k], data[off:off + n])
        assert r.stats()["reads"] == 4 and r.stats()["merged"] == 1


@pytest.mark.parametrize("python_path", [False, True])
def test_a_reader_of_several_files_reads_each_range_from_its_own(where, python_path):
    """A Reader of shards reads file i's byte o at at_shard(i, o): reads into 4 KiB-aligned buffers, checked by
    crc32, land each from its own file (on the GIL-free readers, and on the Python path a subclass takes), ranges
    at the same offset in two files never merge, and a read past one file's end names that file."""
    import zlib

    from workbench.store.pack import at_shard
    rng = np.random.default_rng(1)
    sizes = [SIZE, 5 * 4096 + 17, 300_000]
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    paths = [where / f"shard-{i}.safetensors" for i in range(3)]
    for p, d in zip(paths, data):
        p.write_bytes(d.tobytes())

    class PythonReads(wio.Reader):
        def _preadv(self, views, pos):
            return super()._preadv(views, pos)

    ranges = [(0, 0, 8192), (1, 0, 8192), (2, 0, 8192), (1, 4096, 4 * 4096), (0, SIZE // 4096 * 4096, 4096),
              (2, 290_816, 12_288), (0, 65536, 300 * 4096)]
    with (PythonReads if python_path else wio.Reader)(paths, workers=2) as r:
        assert r._reads_gil_free() != python_path and len(r.fds) == 3
        np.testing.assert_array_equal(r.read(at_shard(2, 5), 7000), data[2][5:7005])
        reqs, checks, want = [], {}, {}
        for k, (i, off, n) in enumerate(ranges):
            buf = wio.aligned_empty(n)
            reqs.append((k, [(at_shard(i, off), buf)]))
            want[k] = data[i][off:off + n]                  # past a file's end a buffer keeps what it held
            checks[k] = ([(0, 0, len(want[k]))], zlib.crc32(want[k]))
        futs = r.submit_into(reqs, checks=checks)
        for k, (_, [(_, buf)]) in enumerate(reqs):
            futs[k].result(timeout=10)
            np.testing.assert_array_equal(buf[:len(want[k])], want[k])
        with pytest.raises(EOFError, match=str(paths[1])):
            r.read(at_shard(1, sizes[1] - 10), 100)
