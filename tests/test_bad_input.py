"""Bad input gets a one-line error naming the file and the problem (exit code 2), and leaves nothing behind."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.store.pack import Pack, convert

REPO = Path(__file__).resolve().parents[1]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}, timeout=120)


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def pack(tiny_models, tmp_path_factory):
    return convert(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("packs") / "tiny.pack")


def test_truncated_pack(pack, tmp_path):
    bad = tmp_path / "truncated.pack"
    bad.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])
    with pytest.raises(WorkbenchError, match="truncated"):
        Pack(bad)
    assert_one_line_error(cli("generate", "--model", str(bad), "--tokens", "2"), str(bad), "truncated")


def test_flipped_byte_in_an_expert(pack, tmp_path):
    bad = tmp_path / "flipped.pack"
    shutil.copy(pack, bad)
    p = Pack(bad)
    off, _ = p.expert_reads(1, 3)[0]
    with open(bad, "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    res = cli("generate", "--model", str(bad), "--preset", "resident", "--tokens", "2")
    assert_one_line_error(res, str(bad), "checksum mismatch", "expert 3 of layer 1")


@pytest.mark.parametrize("version,says", [(99, "format 99 is newer"),
                                          (1, "format 1 has no header checksum; re-convert")])
def test_header_of_another_format(pack, tmp_path, version, says):
    bad = tmp_path / f"format{version}.pack"
    data = bytearray(pack.read_bytes())
    data[8:12] = struct.pack("<I", version)
    bad.write_bytes(bytes(data))
    assert_one_line_error(cli("info", "--model", str(bad)), str(bad), says)


def test_missing_shard(tiny_models, tmp_path):
    src = tmp_path / "sharded"
    shutil.copytree(tiny_models["qwen3_moe"], src)
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    dst = tmp_path / "out.pack"
    res = cli("convert", str(src), str(dst))
    assert_one_line_error(res, "model.safetensors.index.json", "model-00001-of-00002.safetensors is missing")
    assert not dst.exists() and list(tmp_path.glob(".out.pack*")) == []


def test_unsupported_family(tiny_models, tmp_path):
    src = tmp_path / "llama"
    shutil.copytree(tiny_models["qwen3_moe"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(cli("info", "--model", str(src)), str(src / "config.json"), "'llama' is not a supported")


def test_budget_below_top_k(tiny_models):
    res = cli("bench", "--model", str(tiny_models["qwen3_moe"]), "--budget", "4KiB", "--tokens", "2")
    assert_one_line_error(res, "below one layer's top-k")


def test_conversion_that_fails_midway_leaves_no_partial_file(tiny_models, tmp_path):
    src = tmp_path / "cut"
    shutil.copytree(tiny_models["qwen3_moe"], src)
    st = src / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size - 1000])   # the last tensors are cut off
    dst = tmp_path / "cut.pack"
    res = cli("convert", str(src), str(dst))
    assert_one_line_error(res, str(st), "truncated")
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["cut"]


def test_existing_pack_survives_a_failed_conversion(tiny_models, pack, tmp_path):
    dst = tmp_path / "keep.pack"
    shutil.copy(pack, dst)
    before = dst.read_bytes()
    src = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen3_moe"], src)
    (src / "model.safetensors").write_bytes(b"\x00" * 16)
    assert cli("convert", str(src), str(dst)).returncode == 2
    assert dst.read_bytes() == before


def test_flipped_byte_in_the_header(pack, tmp_path):
    """Inside the tokenizer the header carries (where `tokenizers` once raised a traceback): the header's own
    checksum refuses it before anything in it is used."""
    bad = tmp_path / "header.pack"
    data = bytearray(pack.read_bytes())
    data[data.index(b"merges") + 40] ^= 0x01
    bad.write_bytes(bytes(data))
    assert_one_line_error(cli("generate", "--model", str(bad), "--tokens", "2"), str(bad),
                          "checksum mismatch in the pack header")


def test_serve_on_a_port_in_use(pack):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = cli("serve", "--model", str(pack), "--port", str(port))
    assert_one_line_error(res, f"cannot serve on 127.0.0.1:{port}", "Address already in use")
