"""Edge0 artifacts: small safetensors files beside the model (never merged into it), read with numpy.

    <model dir>/edge0/prerouter.safetensors   the trained prerouter heads (<model>.gguf.edge0/ beside a GGUF)
    <model dir>/edge0/lora.safetensors        the recovery LoRA (attention q, k, v, o)

Each file carries its provenance in the safetensors metadata: "kind", and "edge0" (JSON: the model's
identity, the data, steps, the command, the settings). The model identity is two hashes:
  model_config_sha256  sha256 of the source config.json (as the pack header records it)
  model_weights_id     sha256 over the crc32s of the tensors every pack stores in f32 (routers, norms):
                       the same for every precision of one checkpoint, different for another checkpoint
                       of the same architecture (a config hash alone cannot tell two checkpoints apart)
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from workbench.atomic import atomic_path
from workbench.errors import WorkbenchError
from workbench.presets import Predictor, Router
from workbench.spec_hybrid import split_fused_projections

FILES = {"prerouter": "prerouter.safetensors", "lora": "lora.safetensors"}


def model_dir_of(pack) -> Path:
    return Path(pack.header["source"]["path"])


def edge0_dir(pack) -> Path:
    return edge0_dir_of(model_dir_of(pack))


def edge0_dir_of(source) -> Path:
    """Where the Edge0 files of a model lie: <dir>/edge0 in a model directory, <file>.edge0 beside a single-file
    source (a GGUF), so that files sharing a folder keep their own heads."""
    src = Path(source)
    return src.with_name(src.name + ".edge0") if src.is_file() else src / "edge0"


def artifact_path(pack, kind: str) -> Path:
    return edge0_dir(pack) / FILES[kind]


def model_identity(pack) -> dict:
    """The tensors every pack stores in f32 (routers, norms) by their f32 bytes' crc32s; an index that keeps them
    as its checkpoint holds them (bf16 in place) gives the crc32 of their f32 decoding, so both agree."""
    from workbench.store.pack import _crc, _encode, tensor_kind
    f32 = sorted((n, t["crc32"] if t["kind"] == "f32" else _crc(_encode(pack.tensor(n), "f32")))
                 for n, t in pack.tensors.items() if tensor_kind(n, tuple(t["shape"]), "q4") == "f32")
    wid = hashlib.sha256("\n".join(f"{n}:{c}" for n, c in f32).encode()).hexdigest()[:16]
    return {"model_config_sha256": pack.header["source"].get("config_sha256", ""), "model_weights_id": wid}


# ---------------------------------------------------------------- safetensors (F32), numpy only

def save_safetensors(path, tensors: dict[str, np.ndarray], kind: str, meta: dict):
    """Write float32 tensors with metadata {"kind": kind, "edge0": json(meta)}, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    header["__metadata__"] = {"kind": kind, "edge0": json.dumps(meta, sort_keys=True, default=str)}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for b in blobs:
            f.write(b)
    return path


def load_safetensors(path, kind: str) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, meta) of an Edge0 file; WorkbenchError naming the file for anything unreadable."""
    path = Path(path)
    if not path.exists():
        raise WorkbenchError(f"{path}: missing (train it: python -m training.edge0_"
                             f"{'prerouter' if kind == 'prerouter' else 'lora'} --model ...)")
    try:
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        md = header.pop("__metadata__", {}) or {}
        meta = json.loads(md.get("edge0", "{}"))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkbenchError(f"{path}: not a readable safetensors file ({e})") from None
    if md.get("kind") != kind:
        raise WorkbenchError(f"{path}: holds {md.get('kind')!r}, expected Edge0 {kind!r}")
    base, out = 8 + n, {}
    for name, h in header.items():
        if h.get("dtype") != "F32":
            raise WorkbenchError(f"{path}: tensor {name} is {h.get('dtype')}, expected F32")
        s, e = h["data_offsets"]
        if base + e > len(raw) or e - s != 4 * int(np.prod(h["shape"])):
            raise WorkbenchError(f"{path}: truncated or inconsistent tensor {name}")
        out[name] = np.frombuffer(raw, dtype="<f4", count=(e - s) // 4, offset=base + s).reshape(h["shape"]).copy()
    return out, meta


def served_bytes(where: Path, preset) -> int:
    """What the preset's Edge0 files in `where` (edge0_dir) take in memory (f32, as the files hold them): the heads
    where its predictor is the prerouter, the LoRA where its routing serves one; 0 for files not there yet (serving
    names them)."""
    kinds = ["prerouter"] * (preset.prefetch.predictor is Predictor.PREROUTER) + \
        ["lora"] * (preset.routing.router is Router.PREROUTER and preset.routing.lora)
    return sum(p.stat().st_size for p in (Path(where) / FILES[k] for k in kinds) if p.exists())


def check_identity(path, meta: dict, pack):
    """The file was trained for this checkpoint, or a WorkbenchError that names it."""
    want = model_identity(pack)
    for k in ("model_weights_id", "model_config_sha256"):
        if meta.get(k) != want[k]:
            raise WorkbenchError(f"{path}: trained for another model ({k} {str(meta.get(k))[:16]}, this model has "
                                 f"{want[k][:16]}); re-train it for {model_dir_of(pack)} (see edge0/README.md)")


# ---------------------------------------------------------------- weights of a pack, all in memory (f32)

def pack_weights(pack) -> tuple[dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """(non-expert tensors, {layer: {"gate": (E, ff, d), "up": (E, ff, d), "down": (E, d, ff)}}), dequantized."""
    w = {name: pack.tensor(name) for name in pack.tensors}
    if "lm_head" not in w:
        w["lm_head"] = w["embed"]
    if pack.spec.family == "qwen3_next":
        split_fused_projections(pack.spec, w)
    experts = {}
    for L in pack.spec.moe_layers:
        parts = {p: [] for p in ("gate", "up", "down")}
        for e in range(pack.spec.num_experts):
            for p, a in pack.decode_expert(L, e, pack.expert_bytes(L, e)).items():
                parts[p].append(a)
        experts[L] = {p: np.stack(v) for p, v in parts.items()}
    return w, experts
