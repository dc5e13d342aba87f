"""`--model x.gguf` streams the GGUF as it lies: an index in the cache (workbench/store/gguf_index.py), no pack copy.

The GGUF here is the tiny Qwen3-MoE exported at q8_0: its experts' parts (4352 bytes) lie at 32-byte alignment, so
each read starts at the 4 KiB boundary before its part (Pack.expert_heads) and some reach past the end of the file.
The streamed experts are the GGUF's own bytes; the runs give the converted raw pack's logits bit for bit (the same
blocks through the same kernels).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[llamacpp]')")

from workbench.errors import WorkbenchError                   # noqa: E402
from workbench.models.gguf_model import GGUFModel, dequantize  # noqa: E402
from workbench.registry import resolve_pack                  # noqa: E402
from workbench.store.pack import PARTS, Pack, convert         # noqa: E402

IDS = [5, 17, 200, 31, 64, 99, 150, 3, 250, 12, 77, 42]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from conftest import make_checkpoint
    from engines.gguf_export import export_gguf
    from workbench.models.hf import HFModel
    root = tmp_path_factory.mktemp("gguf-stream")
    # tied embeddings: no output.weight after the experts, so the last expert reads reach past the end of the file
    src = make_checkpoint("qwen3_moe", root / "q3", tie_word_embeddings=True)
    return export_gguf(HFModel(src), root / "q3.gguf", "q8_0")


def cache_files(root: Path) -> dict:
    return {p.relative_to(root): p.stat() for p in root.rglob("*") if p.is_file()}


@pytest.mark.macos
def test_a_gguf_streams_through_a_small_index_made_once(gguf_file, tmp_path, monkeypatch):
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    with open_session(str(gguf_file), "les", budget="0.5") as s:
        assert s.pack.data_paths == [gguf_file.resolve()] and s.reader.path == str(gguf_file.resolve())
        assert s.preset.storage.experts == "raw" and s.preset.storage.layout.value == "native"
        s.generate(IDS, 4)
    files = cache_files(tmp_path / "cache")
    packs = [f for f in files if f.parts[0] == "packs"]
    assert [f.suffix for f in packs] == [".index"], files
    assert all(st.st_size < gguf_file.stat().st_size / 4 for st in files.values()), files   # no copy of the model
    with open_session(str(gguf_file), "on_demand", budget="0.25"):
        pass
    again = cache_files(tmp_path / "cache")
    made, reused = files[packs[0]], again[packs[0]]
    assert (reused.st_mtime_ns, reused.st_ino) == (made.st_mtime_ns, made.st_ino)
    # a storage knob the run names itself is taken, the others stay the GGUF's: a converted pack
    with open_session(str(gguf_file), "on_demand", experts="q4") as s:
        assert (s.pack.layout, s.pack.quant) == ("native", {"experts": "q4", "rest": "raw"})
        assert s.pack.data_paths == [s.pack.path]
    with open_session(str(gguf_file), "les", layout="contiguous") as s:
        assert (s.pack.layout, s.pack.quant) == ("contiguous", {"experts": "raw", "rest": "raw"})


@pytest.mark.macos
def test_streamed_experts_are_the_ggufs_bytes(gguf_file, surface):
    """Every expert read into the slot arena (O_DIRECT, from the 4 KiB boundary before each part) holds the GGUF's
    bytes at its parts' places, and dequantizes to GGUFModel.expert's matrices; each read was checked by its crc."""
    from workbench.arena import SlotArena, slot_bytes
    from workbench.cache import ExpertCache
    from workbench.io import Reader, slot_readers
    from workbench.streamer import ExpertStreamer
    from workbench.telemetry import Telemetry
    g, pack = GGUFModel(gguf_file), Pack(resolve_pack(str(gguf_file), "native", "raw", "raw"))
    s = pack.spec
    heads = {L: pack.expert_heads(L) for L in s.moe_layers}
    assert len({int(h) for L in heads for h in heads[L].ravel()}) > 1       # parts at many places past 4 KiB
    size = gguf_file.stat().st_size
    assert any(off - h + -(-(h + n) // 4096) * 4096 > size for L in s.moe_layers for e in range(s.num_experts)
               for h, (off, n) in zip(heads[L][e], pack.expert_reads(L, e)))    # a read reaches past the end
    keys = [(L, e) for L in s.moe_layers for e in range(s.num_experts)]
    item = slot_bytes(pack)
    cache = ExpertCache(len(keys), item, s.moe_layers)
    arena = SlotArena(pack, cache)
    reader = Reader(pack.data_paths, workers=slot_readers())
    try:
        assert reader.mode == ("f_nocache+pread" if surface == "macos" else "o_direct")
        ExpertStreamer(pack, cache, reader, Telemetry(s.num_layers), arena=arena).load_resident(keys)
    finally:
        reader.close()
    for L, e in keys:
        at = arena.where[(L, e)]
        raw, ref, kinds = g.expert_raw(L, e), g.expert(L, e), pack.kinds_of(L)
        for i, p in enumerate(PARTS):
            start = at + arena.layouts[L][1][p] + heads[L][e, i]
            got = arena.blocks[L][start:start + raw[p].nbytes]
            assert got.tobytes() == raw[p].tobytes(), (L, e, p)
            np.testing.assert_array_equal(dequantize(got, kinds[p][5:], pack.expert_shapes[p]), ref[p])


def logits_and_tokens(model, preset, budget, engine=None):
    from runtime.session import open_session
    with open_session(str(model), preset, budget=budget, engine=engine) as s:
        s.engine.reset()
        z = np.concatenate([s.step(IDS[:8], "prefill")] + [s.step([t], "decode") for t in IDS[8:]])
        return z, s.generate(IDS[:6], 8)["tokens"], s.engine.name


@pytest.mark.parametrize("engine", [None, "numpy"])
def test_a_run_on_the_gguf_is_the_run_on_its_converted_raw_pack(gguf_file, tmp_path, engine):
    """The same blocks through the same kernels: logits and greedy tokens bit for bit, at budgets that stream."""
    raw = convert(gguf_file, tmp_path / "raw.pack", experts="raw", rest="raw")
    for preset, budget in [("les", "0.25"), ("on_demand", "0.5")]:
        z, toks, name = logits_and_tokens(gguf_file, preset, budget, engine)
        z_raw, toks_raw, name_raw = logits_and_tokens(raw, preset, budget, engine)
        assert name == name_raw
        np.testing.assert_array_equal(z, z_raw, err_msg=f"{preset} at {budget} ({name})")
        assert toks == toks_raw


def test_a_changed_gguf_is_refused_in_one_line(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    g = tmp_path / "m.gguf"
    g.write_bytes(gguf_file.read_bytes())
    index = resolve_pack(str(g), "native", "raw", "raw")
    Pack(index)
    st = g.stat()
    data = bytearray(g.read_bytes())
    # a byte of an expert changed in place (size and time kept): the open passes, the read's crc does not
    off = Pack(index).expert_reads(1, 3)[1][0]
    data[off + 7] ^= 0xFF
    g.write_bytes(data)
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    from runtime.session import open_session
    with pytest.raises(WorkbenchError, match="checksum mismatch in expert 3 of layer 1"):
        with open_session(str(index), "on_demand", budget="all"):
            pass
    for change in ("touched", "truncated", "header"):
        g.write_bytes(gguf_file.read_bytes())
        if change == "truncated":
            with open(g, "r+b") as f:
                f.truncate(st.st_size - 4096)
        if change == "header":      # same size and time, another header (a metadata edit)
            head = bytearray(g.read_bytes())
            head[40] ^= 1
            g.write_bytes(head)
        os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns if change != "touched" else st.st_mtime_ns + 10**9))
        with pytest.raises(WorkbenchError) as e:
            Pack(index)
        msg = str(e.value)
        assert "\n" not in msg and str(g) in msg and str(index) in msg and "rebuild" in msg, msg
    with open(g, "r+b") as f:
        f.truncate(st.st_size - 4096)
    with pytest.raises(WorkbenchError, match="truncated|not a readable") as e:     # a fresh fingerprint: refused
        resolve_pack(str(g), "native", "raw", "raw")
    assert "\n" not in str(e.value)


class Wide:
    """The tiny Qwen3-MoE with many wide experts (constant matrices: an index reads bytes, not values)."""

    def __init__(self, src, experts: int, ff: int):
        from workbench.models.hf import HFModel
        self.m = HFModel(src)
        self.path, self.spec = src, replace(self.m.spec, num_experts=experts, moe_intermediate_size=ff)

    def names(self):
        return self.m.names()

    def tensor_shape(self, name):
        return self.tensor(name).shape

    def tensor(self, name):
        t = self.m.tensor(name)
        return np.resize(t, (self.spec.num_experts, t.shape[1])) if name.endswith("router") else t

    def expert(self, layer, e):
        d, ff = self.spec.hidden_size, self.spec.moe_intermediate_size
        v = np.float32(0.01 * (e + 1))
        return {"gate": np.full((ff, d), v), "up": np.full((ff, d), -v), "down": np.full((d, ff), v)}


def test_indexing_a_large_gguf_stays_within_a_memory_bound(tmp_path):
    """A GGUF several times the bound is indexed in pieces: the indexing process's peak RSS grows by less than the
    bound over what it had after opening the GGUF."""
    from conftest import make_checkpoint
    from engines.gguf_export import export_gguf
    big = export_gguf(Wide(make_checkpoint("qwen3_moe", tmp_path / "q3"), 128, 2048), tmp_path / "big.gguf", "f16")
    bound = 40 * 2**20
    assert big.stat().st_size > 3 * bound
    code = ("import resource, sys\n"
            "from workbench.models.gguf_model import GGUFModel\n"
            "from workbench.store.gguf_index import build_index\n"
            "GGUFModel(sys.argv[1])\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "build_index(sys.argv[1], sys.argv[2])\n"
            "print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code, str(big), str(tmp_path / "big.index")], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    before, after = map(int, out.stdout.split())
    assert (after - before) * 1024 < bound, (before, after)
    assert (tmp_path / "big.index").stat().st_size < 2**20
    pack = Pack(tmp_path / "big.index")
    assert pack.total_expert_bytes > 3 * bound


def test_the_verbs_that_take_a_model_take_the_gguf(gguf_file, tmp_path, monkeypatch, capsys):
    import json
    from cli import main
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))

    def run(*argv):
        assert main(list(argv) + ["--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    m = ["--model", str(gguf_file)]
    assert run("info", *m)["kind"] == "gguf"
    assert run("generate", *m, "--preset", "les", "--budget", "0.5", "--tokens", "4")["tokens"]
    b = run("bench", *m, "--preset", "les", "--budget", "0.5", "--tokens", "4", "--no-record")
    assert b["tokens"] == 4 and b["reader_mode"] == "o_direct"
    run("trace", "--engine", "numpy", *m, "--data", "tinystories", "--tokens", "16",
        "--out", str(tmp_path / "t.parquet"))
    assert run("replay", str(tmp_path / "t.parquet"), "--preset", "les", "--budget", "0.5")["presets"]
    assert [p.suffix for p in (tmp_path / "cache" / "packs").iterdir()] == [".index"]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_tensors_made_on_read_are_kept_in_the_index(family, tmp_path):
    """A hybrid GGUF's fused DeltaNet tensors are regrouped on read (GGUFModel.derived): the index keeps those,
    points at the GGUF for the rest, and runs as the converted raw pack does."""
    from engines.gguf_export import export_gguf
    from hybrid_fixtures import make_hybrid
    from workbench.models.hf import HFModel
    g = export_gguf(HFModel(make_hybrid(family, tmp_path / family)), tmp_path / "h.gguf", "q8_0")
    index = Pack(build := resolve_pack(str(g), "native", "raw", "raw"))
    here = {n for n, t in index.tensors.items() if t.get("in") != "data"}
    assert here and here <= set(GGUFModel(g).derived), here
    held = sum(index.tensors[n]["nbytes"] for n in here)        # f32: a tiny model's are a good part of it
    assert build.stat().st_size < held + 4096 * len(here) + 2**16
    raw = convert(g, tmp_path / "raw.pack", experts="raw", rest="raw")
    for engine in (None, "numpy"):
        z, toks, _ = logits_and_tokens(g, "les", "0.5", engine)
        z_raw, toks_raw, _ = logits_and_tokens(raw, "les", "0.5", engine)
        np.testing.assert_array_equal(z, z_raw)
        assert toks == toks_raw


def relabel(src, dst, blocks: int, nextn: int = 0) -> Path:
    """A copy of the GGUF at src with only blocks 0 .. blocks-1, block_count = blocks and nextn_predict_layers =
    nextn (absent if 0): every other key and tensor as it is."""
    import re

    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", f"{arch}.nextn_predict_layers"):
            continue
        w.add_key_value(f.name, blocks if f.name == f"{arch}.block_count" else f.contents(), f.types[0],
                        sub_type=f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    for t in r.tensors:
        if not ((m := re.match(r"blk\.(\d+)\.", t.name)) and int(m[1]) >= blocks):
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def _llama_logits(path):
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=64, threads=2) as llm:
        return llm.forward(IDS)


def test_an_mtp_block_is_accepted_never_read_and_the_run_is_the_file_without_it(tmp_path, monkeypatch, capsys):
    """A Qwen3.6-shaped GGUF with its MTP block (blk.4 after 4 main layers, nextn_predict_layers 1) opens as the
    4-layer model; the block is in no index and is never read (garbage there changes nothing); the streamed run
    gives the logits and tokens of the same file without the block, bit for bit, and so does llama.cpp."""
    import importlib.util
    import json

    from child import in_child
    from engines.gguf_random import make_gguf
    from cli import main
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    mtp = make_gguf("qwen3.6-35b-a3b", tmp_path / "mtp.gguf", layers=4, experts=16)
    plain = relabel(mtp, tmp_path / "plain.gguf", 4)
    g, p = GGUFModel(mtp), GGUFModel(plain)
    assert g.spec == p.spec and g.names() == p.names() and g.spec.num_layers == 4
    assert (g.mtp_layers, p.mtp_layers) == (1, 0) and "blk.4.nextn.eh_proj.weight" in g.mtp_tensors
    assert set(g.mtp_tensors) == set(g.raw) - set(p.raw) and len(g.mtp_tensors) == 20
    assert g.source_info()["mtp_layers"] == 1 and "mtp_layers" not in p.source_info()
    if importlib.util.find_spec("llama_cpp"):
        np.testing.assert_array_equal(in_child(_llama_logits, mtp), in_child(_llama_logits, plain))
    with open(mtp, "r+b") as f:
        for n in g.mtp_tensors:
            t = g.raw[n]
            f.seek(int(t.data_offset))
            f.write(b"\xff" * int(t.n_bytes))          # NaN scales: any read of them would show
    del g
    index = Pack(resolve_pack(str(mtp), "native", "raw", "raw"))
    assert set(index.tensors) == set(Pack(resolve_pack(str(plain), "native", "raw", "raw")).tensors)
    z, toks, _ = logits_and_tokens(mtp, "les", "0.5")
    z_plain, toks_plain, _ = logits_and_tokens(plain, "les", "0.5")
    assert np.isfinite(z).all()
    np.testing.assert_array_equal(z, z_plain)
    assert toks == toks_plain
    assert main(["info", "--model", str(mtp), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["mtp_layers"] == 1 and info["spec"]["num_layers"] == 4


def test_nextn_predict_layers_that_leave_no_main_layers_are_refused(tmp_path):
    from engines.gguf_random import make_gguf
    src = make_gguf("qwen3.6-35b-a3b", tmp_path / "m.gguf", layers=4, experts=8)
    with pytest.raises(WorkbenchError, match=r"bad\.gguf: qwen35moe\.nextn_predict_layers 5 leaves no main layers"):
        GGUFModel(relabel(src, tmp_path / "bad.gguf", 5, 5))
    with pytest.raises(WorkbenchError, match="nextn.eh_proj.weight has no place"):   # nextn tensors in a main block
        GGUFModel(relabel(src, tmp_path / "main.gguf", 5))


def test_a_streaming_run_holds_its_budget_and_never_the_model(tmp_path):
    """On a GGUF made for the test (the Qwen3-Next architecture, 4 layers of 512 experts, 2.8 GB), a streaming
    run's peak RSS (a fresh process each) grows with the budget by the budget, and stays far under the file: the
    experts are read into the cache, never mapped or copied whole (the 80B run in results/full_size.md is the
    same code)."""
    from engines.gguf_random import make_gguf
    g = make_gguf("qwen3-next-80b-a3b", tmp_path / "next.gguf", layers=4, experts=512)
    env = {**os.environ, "WORKBENCH_CACHE": str(tmp_path / "cache")}
    repo = Path(__file__).resolve().parents[1]

    def peak(budget):
        r = subprocess.run([sys.executable, "-m", "workbench", "bench", "--model", str(g), "--preset", "les",
                            "--budget", budget, "--tokens", "4", "--no-record", "--json"],
                           capture_output=True, text=True, env=env, cwd=repo)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    try:
        peak("64MiB")               # numba compiles (and caches) the kernels once: not inside a measured peak
        small, big = peak("64MiB"), peak("320MiB")
    finally:
        size = g.stat().st_size
        g.unlink()                  # 2.8 GB: not left in pytest's kept temporary folders
    grown, cache = big["peak_rss_bytes"] - small["peak_rss_bytes"], big["budget_bytes"] - small["budget_bytes"]
    assert cache > 200 * 2**20
    assert abs(grown - cache) < 0.1 * cache + 32 * 2**20, (grown / 2**20, cache / 2**20, small, big)
    assert big["peak_rss_bytes"] < size / 2, big["peak_rss_bytes"] / 2**20


def test_a_ladder_rung_that_changes_storage_runs_at_it_on_a_gguf_not_at_the_files_bits(gguf_file, tmp_path, monkeypatch):
    """LES's mixed-precision rung on a GGUF is converted to its precision and layout (a pack, said before it is
    written), as `bench --set experts=q3` would be; the rungs that keep the preset's storage stream in place."""
    from experiments.grid import Cell, run_bench
    from experiments.ladder import les_rungs
    from workbench.registry import experts_for
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    base, look, _, mixed, _ = les_rungs()
    runs = {}
    for rung in (look, mixed):
        cell = Cell.of("bench", str(gguf_file), rung, "on_demand", budget="0.5", tokens=3, rounds=1, prompt="Once")
        runs[rung.name] = (cell.named_storage, run_bench(cell))
    assert runs[look.name][0] == {}
    assert runs[mixed.name][0] == {"layout": "contiguous", "experts": experts_for("q3", "packed")}
    assert sorted(f.suffix for f in cache_files(tmp_path / "cache") if f.parts[0] == "packs") == [".index", ".pack"]
    look_read, mixed_read = (runs[n][1]["bytes_read_per_token"] for n in (look.name, mixed.name))
    assert mixed_read < look_read                   # q3 experts, not the file's q8_0
