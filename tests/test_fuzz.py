"""Parsers of untrusted files, fuzzed with hypothesis: pack headers, GGUF headers and tensor tables, safetensors
headers, config.json. A mutated or truncated file ends in a WorkbenchError (the CLI's one-line error, exit code 2)
or a correct load; never another exception, a hang (each case is cut off after HANG_S), or an allocation sized by a
header field (each case's Python/numpy allocations are traced and must stay under ALLOC_LIMIT).

Each property runs EXAMPLES cases (derandomized, so CI runs the same cases every time);
WORKBENCH_FUZZ_EXAMPLES=N runs N per property.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import struct
import tracemalloc
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from workbench.models.hf import HFModel                     # noqa: E402
from workbench.registry import tokenizer_for                 # noqa: E402
from workbench.errors import WorkbenchError                  # noqa: E402
from workbench.store.pack import MAGIC, Pack, convert        # noqa: E402

EXAMPLES = int(os.environ.get("WORKBENCH_FUZZ_EXAMPLES", 100))
HANG_S = 10
ALLOC_LIMIT = 256 << 20
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64) | st.sampled_from([10**12, -1, 0]) |
                    st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=8)


@contextmanager
def bounded():
    """Fails the case on a hang (SIGALRM after HANG_S) or on an allocation above ALLOC_LIMIT."""
    def hang(*_):
        raise TimeoutError(f"still parsing after {HANG_S} s")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert peak < ALLOC_LIMIT, f"a parse allocated {peak} bytes"


def outcome(load, path):
    """load(path) -> ("ok", value) or ("error", one-line message); anything else propagates (and fails)."""
    try:
        with bounded():
            return "ok", load(path)
    except WorkbenchError as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg, msg
        return "error", msg


def mutate(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for i, v in edits:
        b[i % len(b)] = v
    return bytes(b)


def edits(limit: int):
    return st.lists(st.tuples(st.integers(0, limit - 1), st.integers(0, 255)), min_size=1, max_size=6)


# ---------------------------------------------------------------- packs

@pytest.fixture(scope="module")
def pack(tiny_models, tmp_path_factory):
    return convert(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("fuzz") / "tiny.pack")


def open_pack(path):
    """What every verb does first with a pack: the header, the tokenizer it carries, a tensor and an expert."""
    p = Pack(path)
    tokenizer_for(p)
    p.tensor(next(iter(p.tensors)))
    with open(path, "rb") as f:
        chunks = []
        for off, n in p.expert_reads(p.spec.moe_layers[0], 0):
            f.seek(off)
            chunks.append(np.frombuffer(f.read(n), np.uint8))
    p.decode_expert(p.spec.moe_layers[0], 0, chunks)
    return p


def header_end(path) -> int:
    with open(path, "rb") as f:
        return 24 + struct.unpack("<Q", f.read(20)[12:20])[0]


def write_header(path, header: dict, like: Path):
    """A pack whose header is `header` with a valid checksum, and like's data."""
    data = like.read_bytes()
    start = -(-header_end(like) // 4096) * 4096          # where like's data begins
    hb = json.dumps(header, separators=(",", ":")).encode()
    assert 24 + len(hb) <= start
    path.write_bytes((MAGIC + struct.pack("<IQI", 2, len(hb), zlib.crc32(hb)) + hb).ljust(start, b"\0") + data[start:])


def test_pack_header_byte_flips(pack, tmp_path):
    """Any bytes changed in the prefix or the JSON header (its tokenizer included) are refused by the checksum;
    only changes in the padding after the header leave a pack that loads, and then it loads as before."""
    original, data, end = Pack(pack).header, pack.read_bytes(), header_end(pack)
    bad = tmp_path / "bad.pack"

    @FUZZ
    @given(edits(-(-end // 4096) * 4096))
    def case(ed):
        bad.write_bytes(mutate(data, ed))
        kind, got = outcome(open_pack, bad)
        changed = [i for i, v in ed if data[i] != v]
        if any(i < end for i in changed):
            assert kind == "error"
        else:
            assert kind == "ok" and got.header == original
    case()


def test_pack_truncated_anywhere(pack, tmp_path):
    data, bad = pack.read_bytes(), tmp_path / "cut.pack"

    @FUZZ
    @given(st.integers(0, len(data) - 1))
    def case(n):
        bad.write_bytes(data[:n])
        assert outcome(Pack, bad)[0] == "error"
    case()


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


def test_pack_header_fields_with_a_valid_checksum(pack, tmp_path):
    """A header the checksum accepts (as a buggy or hostile writer could make) with one field replaced or deleted:
    every range is checked against the file and every shape against its bytes before anything is read."""
    header = Pack(pack).header
    header.pop("tokenizer")                  # keeps the fuzzed headers short; the tokenizer has its own test
    paths = [p for p in _paths(header) if p]
    bad = tmp_path / "forged.pack"

    @FUZZ
    @given(st.sampled_from(paths), st.one_of(st.just("delete"), JSON))
    def case(path, value):
        h = copy.deepcopy(header)
        parent = h
        for k in path[:-1]:
            parent = parent[k]
        if value == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        write_header(bad, h, pack)
        outcome(open_pack, bad)
    case()


def test_pack_header_claiming_1e12_elements(pack, tmp_path):
    h = Pack(pack).header
    h.pop("tokenizer")
    name = next(iter(h["tensors"]))
    h["tensors"][name].update(shape=[10**6, 10**6], nbytes=4 * 10**12)
    write_header(tmp_path / "huge.pack", h, pack)
    kind, msg = outcome(open_pack, tmp_path / "huge.pack")
    assert kind == "error" and f"tensor {name}" in msg


def test_a_damaged_tokenizer_is_one_line(pack, tmp_path):
    """The case found by hand: a tokenizer whose merges name a token the vocabulary lacks (checksum valid)."""
    h = Pack(pack).header
    tok = json.loads(h["tokenizer"])
    tok["model"]["vocab"].pop(next(iter(tok["model"]["merges"][0] if isinstance(tok["model"]["merges"][0], list)
                                        else tok["model"]["merges"][0].split())))
    h["tokenizer"] = json.dumps(tok)
    write_header(tmp_path / "tok.pack", h, pack)
    kind, msg = outcome(open_pack, tmp_path / "tok.pack")
    assert kind == "error" and "tokenizer" in msg


# ---------------------------------------------------------------- safetensors and config.json

@pytest.fixture(scope="module")
def checkpoint(tiny_models):
    return tiny_models["qwen3_moe"]


def test_safetensors_header_byte_flips_and_cuts(checkpoint, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint, src)
    st_path = src / "model.safetensors"
    data = st_path.read_bytes()
    end = 8 + struct.unpack("<Q", data[:8])[0]
    want = HFModel(checkpoint).spec

    @FUZZ
    @given(edits(end), st.booleans(), st.integers(0, len(data)))
    def case(ed, cut, n):
        st_path.write_bytes(data[:n] if cut else mutate(data, ed))
        kind, m = outcome(HFModel, src)
        if kind == "ok":
            assert m.spec == want
    case()


def test_safetensors_header_claiming_1e12_elements(checkpoint, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint, src)
    data = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    h = json.loads(data[8:8 + n])
    name = next(k for k in h if k != "__metadata__")
    h[name].update(shape=[10**6, 10**6], data_offsets=[0, 4 * 10**12], dtype="F32")
    hb = json.dumps(h).encode()
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])
    kind, msg = outcome(HFModel, src)
    assert kind == "error" and name in msg
    (src / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + data[8:])     # a header length past the file
    kind, msg = outcome(HFModel, src)
    assert kind == "error" and "truncated" in msg


def test_config_json_fields(checkpoint, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint, src)
    cfg = json.loads((checkpoint / "config.json").read_text())

    @FUZZ
    @given(st.sampled_from(sorted(cfg)), st.one_of(st.just("delete"), JSON), edits(len(json.dumps(cfg))),
           st.booleans())
    def case(key, value, ed, raw):
        c = dict(cfg)
        if value == "delete":
            c.pop(key)
        else:
            c[key] = value
        text = json.dumps(c)
        (src / "config.json").write_bytes(mutate(text.encode(), ed) if raw else text.encode())
        outcome(HFModel, src)
    case()


# ---------------------------------------------------------------- GGUF

@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[llamacpp]')")
    from engines.gguf_export import export_gguf
    return export_gguf(HFModel(checkpoint), tmp_path_factory.mktemp("fuzz-gguf") / "tiny.gguf", "f16")


def load_gguf(path):
    from workbench.models.gguf_model import GGUFModel
    g = GGUFModel(path)
    for name in g.names()[:4]:
        assert g.tensor(name).shape == tuple(g.tensor_shape(name))
    g.expert(g.spec.moe_layers[0], 0)
    return g


def test_gguf_header_and_tensor_table(gguf_file, tmp_path):
    """Bytes changed in the metadata and the tensor table (everything before the tensor data), or the file cut."""
    from workbench.models.gguf_model import GGUFModel
    data = gguf_file.read_bytes()
    end = GGUFModel(gguf_file).reader.data_offset
    bad = tmp_path / "bad.gguf"

    @FUZZ
    @given(edits(end), st.booleans(), st.integers(0, len(data) - 1))
    def case(ed, cut, n):
        bad.write_bytes(data[:n] if cut else mutate(data, ed))
        outcome(load_gguf, bad)
    case()
