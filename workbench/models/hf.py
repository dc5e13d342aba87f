"""Read a Hugging Face MoE checkpoint directory lazily: config.json + safetensors shards.

Tensors are memory-mapped and read one at a time, so converting a checkpoint never
holds it whole in RAM. Names are mapped to the workbench's canonical names:

    embed, norm, lm_head
    layers.{i}.attn_norm .q .k .v .o .q_bias .k_bias .v_bias .q_norm .k_norm .mlp_norm
    layers.{i}.q_a .q_a_norm .q_b .kv_a .kv_a_norm .kv_b      (latent attention: the HF projections as they are)
    layers.{i}.router .router_bias .shared.{gate,up,down} .shared_gate .dense.{gate,up,down}
    experts: (layer, expert) -> gate (ff, d), up (ff, d), down (d, ff)

(safetensors' numpy loader has no bfloat16, so the few lines of the file format are read here.)
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.spec import MoESpec, from_hf_config

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "U32": np.uint32}      # U32: MLX's packed codes

_KINDS = {"BF16": "bf16", "F16": "f16", "F32": "f32"}     # a float tensor's kind (workbench/store/pack.py) as it lies

_LM = r"model\.(?:language_model\.)?"      # a multimodal checkpoint's language model: the rest is skipped
_LAYER = _LM + r"layers\.(\d+)\."
_RULES = [  # (regex, canonical template)
    (_LM + r"embed_tokens\.weight", "embed"),
    (_LM + r"norm\.weight", "norm"),
    (r"lm_head\.weight", "lm_head"),
    (_LAYER + r"input_layernorm\.weight", "layers.{0}.attn_norm"),
    (_LAYER + r"post_attention_layernorm\.weight", "layers.{0}.mlp_norm"),
    (_LAYER + r"self_attn\.([qkvo])_proj\.weight", "layers.{0}.{1}"),
    (_LAYER + r"self_attn\.([qkv])_proj\.bias", "layers.{0}.{1}_bias"),
    (_LAYER + r"self_attn\.([qk])_norm\.weight", "layers.{0}.{1}_norm"),
    (_LAYER + r"self_attn\.(q_a|q_b)_proj\.weight", "layers.{0}.{1}"),           # latent attention (DeepSeek)
    (_LAYER + r"self_attn\.(q_a|kv_a)_layernorm\.weight", "layers.{0}.{1}_norm"),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight", "layers.{0}.kv_a"),
    (_LAYER + r"self_attn\.kv_b_proj\.weight", "layers.{0}.kv_b"),
    (_LAYER + r"(?:mlp|block_sparse_moe)\.gate\.weight", "layers.{0}.router"),
    (_LAYER + r"mlp\.gate\.e_score_correction_bias", "layers.{0}.router_bias"),
    (_LAYER + r"mlp\.shared_experts?\.(gate|up|down)_proj\.weight", "layers.{0}.shared.{1}"),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", "layers.{0}.shared_gate"),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.weight", "layers.{0}.dense.{1}"),
    (_LAYER + r"linear_attn\.in_proj_(qkvz|ba|qkv|z|b|a)\.weight", "layers.{0}.lin_{1}"),   # Gated DeltaNet
    (_LAYER + r"linear_attn\.(conv|norm|out)(?:1d|_proj)?\.weight", "layers.{0}.lin_{1}"),
    (_LAYER + r"linear_attn\.(A_log|dt_bias)", "layers.{0}.lin_{1}"),
]
_ZERO_CENTRED = re.compile(r"norm|layers\.\d+\.(attn_norm|mlp_norm|q_norm|k_norm)")  # stored as w, used as 1 + w
_EXPERT = re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_FUSED = re.compile(_LAYER + r"mlp\.experts\.(gate_up_proj|down_proj)")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


class Shard:
    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self.size = os.fstat(f.fileno()).st_size
                if 8 + n > self.size:               # checked before a read sized by the file's own field
                    raise WorkbenchError(f"{path}: truncated: header of {n} bytes, file has {self.size}")
                self.header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WorkbenchError(f"{path}: not a readable safetensors file ({e})") from None
        if not isinstance(self.header, dict):
            raise WorkbenchError(f"{path}: not a readable safetensors file (header is not a JSON object)")
        self.header.pop("__metadata__", None)
        self.base = 8 + n
        for name, h in self.header.items():
            self._check(name, h)

    def _check(self, name: str, h):
        """Every entry: a known dtype, a shape, and a byte range inside the file that holds exactly that shape."""
        try:
            shape, (start, end) = [int(x) for x in h["shape"]], h["data_offsets"]
            item = np.dtype(_DTYPES[h["dtype"]]).itemsize if h["dtype"] in _DTYPES else None
            ok = (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and min(shape, default=0) >= 0
                  and (item is None or end - start == item * math.prod(shape)))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise WorkbenchError(f"{self.path}: tensor {name!r} has a malformed header entry (dtype, shape, data_offsets)")
        if self.base + end > self.size:
            raise WorkbenchError(f"{self.path}: truncated: tensor {name} ends at byte {self.base + end}, file has {self.size}")

    def array(self, name: str, index: int | None = None) -> np.ndarray:
        h = self.header[name]
        start, end = h["data_offsets"]
        if self.base + end > self.size:
            raise WorkbenchError(f"{self.path}: truncated: tensor {name} ends at byte {self.base + end}, file has {self.size}")
        dt = _DTYPES.get(h["dtype"])
        if dt is None:
            raise WorkbenchError(f"{self.path}: tensor {name} has unsupported dtype {h['dtype']}")
        shape, offset, n = list(h["shape"]), self.base + start, end - start
        if index is not None:  # one slice of a fused (E, ...) tensor, read and converted alone
            n //= shape[0]
            offset, shape = offset + index * n, shape[1:]
        a = self._read(offset, n).view(dt).reshape(shape)
        return bf16_to_f32(a) if h["dtype"] == "BF16" else a.astype(np.float32)

    def _read(self, offset: int, n: int) -> np.ndarray:
        """n bytes at offset, read into memory of their own: a mapping of the shard would keep every page it touched
        in the process's resident set, the whole checkpoint by the end of a conversion."""
        buf = np.fromfile(self.path, dtype=np.uint8, count=n, offset=offset)
        if buf.size != n:
            raise WorkbenchError(f"{self.path}: truncated while reading ({buf.size} of {n} bytes at {offset})")
        return buf

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]


# config.json fields that size loops and arrays: each is at most the number of weights the checkpoint holds
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
          "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "kv_lora_rank",
          "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
          "first_k_dense_replace", "decoder_sparse_step")


def _check_sizes(cfg: dict, n_weights: int, where):
    for k in _SIZES:
        v = cfg.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= n_weights):
            raise WorkbenchError(f"{where}: {k} = {v!r} is not a size this checkpoint ({n_weights} weights) can have")


def read_config(cfg_path: Path) -> dict:
    """config.json as a dict, or a one-line error naming it."""
    if not cfg_path.exists():
        raise WorkbenchError(f"{cfg_path}: missing (not a Hugging Face model directory)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkbenchError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WorkbenchError(f"{cfg_path}: not a JSON object")
    return config


class HFModel:
    """A Hugging Face checkpoint directory, read lazily tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        self.config = read_config(cfg_path)
        self.shards = self._open_shards()
        _check_sizes(self.config, sum(math.prod(h["shape"]) for sh in self.shards for h in sh.header.values()), cfg_path)
        self.spec: MoESpec = from_hf_config(self.config, str(cfg_path))
        self.where: dict[str, tuple[Shard, str]] = {}       # canonical -> (shard, hf name)
        self.experts: dict[tuple[int, int, str], tuple[Shard, str, int | None]] = {}
        for shard in self.shards:
            for name in shard.header:
                self._index(shard, name)
        self._check_complete()

    def _open_shards(self) -> list[Shard]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise WorkbenchError(f"{index}: not a safetensors index (a weight_map of names to files): {e}") from None
            missing = [f for f in files if not (self.path / f).exists()]
            if missing:
                raise WorkbenchError(f"{index}: shard {missing[0]} is missing from {self.path}")
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise WorkbenchError(f"{self.path}: no .safetensors files")
        return [Shard(self.path / f) for f in files]

    def _index(self, shard: Shard, name: str):
        if m := _EXPERT.fullmatch(name):
            self.experts[(int(m[1]), int(m[2]), _PART[m[3]])] = (shard, name, None)
            return
        if m := _FUSED.fullmatch(name):
            layer, which = int(m[1]), m[2]
            for e in range(self.spec.num_experts):
                parts = ("gate", "up") if which == "gate_up_proj" else ("down",)
                for i, p in enumerate(parts):
                    self.experts[(layer, e, p)] = (shard, name, (e, i))
            return
        for pattern, template in _RULES:
            if m := re.fullmatch(pattern, name):
                self.where[template.format(*m.groups())] = (shard, name)
                return

    def _check_complete(self):
        s = self.spec
        need = ["embed", "norm"] + ([] if s.tie_word_embeddings else ["lm_head"])
        for i in range(s.num_layers):
            need += [f"layers.{i}.attn_norm", f"layers.{i}.mlp_norm"] + s.attention_names(i)
            need += [f"layers.{i}.router"] if i in s.moe_layers else [f"layers.{i}.dense.{p}" for p in ("gate", "up", "down")]
        missing = [n for n in need if n not in self.where]
        missing += [f"expert {k}" for i in s.moe_layers for e in range(s.num_experts)
                    for k in [(i, e, p) for p in ("gate", "up", "down")] if k not in self.experts]
        if missing:
            raise WorkbenchError(f"{self.path}: checkpoint lacks {len(missing)} tensors, first: {missing[0]}")

    def names(self) -> list[str]:
        return list(self.where)

    def tensor(self, name: str) -> np.ndarray:
        shard, hf = self.where[name]
        a = shard.array(hf)
        return a + np.float32(1) if self.spec.layer_types and _ZERO_CENTRED.fullmatch(name) else a

    def tensor_shape(self, name: str) -> list[int]:
        shard, hf = self.where[name]
        return shard.header[hf]["shape"]

    def source_dtype(self, name: str) -> str:
        shard, hf = self.where[name]
        return shard.dtype(hf)

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        out = {}
        ff = self.spec.moe_intermediate_size
        for p in ("gate", "up", "down"):
            shard, hf, fused = self.experts[(layer, e, p)]
            if fused is None:
                out[p] = shard.array(hf)
            else:
                # transformers v5 fuses experts: gate_up_proj (E, 2ff, d) with gate first; down_proj (E, d, ff)
                full = shard.array(hf, index=fused[0])
                out[p] = full[fused[1] * ff:(fused[1] + 1) * ff] if p != "down" else full
        return out

    def source_info(self) -> dict:
        """What a pack or index header records about its source."""
        import hashlib
        return {"path": str(self.path.resolve()),
                "config_sha256": hashlib.sha256((self.path / "config.json").read_bytes()).hexdigest()}

    # ------------------------------------------------------------ where the bytes lie (an index of the directory)

    def tensor_kind(self, name: str) -> str | None:
        """A float tensor's kind as it lies (bf16, f16, f32); None for another dtype."""
        return _KINDS.get(self.source_dtype(name))

    def tensor_runs(self, name: str) -> list[tuple[Shard, int, int]] | None:
        """[(shard, file offset, bytes)] of the tensor as it lies, or None where the model changes it on read (the
        hybrid family's zero-centred norms) or keeps it in another dtype."""
        shard, hf = self.where[name]
        if self.tensor_kind(name) is None or (self.spec.layer_types and _ZERO_CENTRED.fullmatch(name)):
            return None
        start, end = shard.header[hf]["data_offsets"]
        return [(shard, shard.base + start, end - start)]

    def expert_kinds(self, layer: int) -> dict[str, str | None]:
        return {p: _KINDS.get(self.experts[(layer, 0, p)][0].dtype(self.experts[(layer, 0, p)][1]))
                for p in ("gate", "up", "down")}

    def expert_runs(self, layer: int, e: int) -> dict[str, list[tuple[Shard, int, int]]]:
        """{part: [(shard, file offset, bytes)]}: one expert's gate, up, down where they lie (a row range of a fused
        tensor: transformers v5's gate_up_proj holds gate's rows, then up's)."""
        out = {}
        for p in ("gate", "up", "down"):
            shard, hf, fused = self.experts[(layer, e, p)]
            start, end = shard.header[hf]["data_offsets"]
            off, n = shard.base + start, end - start
            if fused is not None:
                n //= self.spec.num_experts
                off += fused[0] * n
                if p != "down":
                    n //= 2
                    off += fused[1] * n
            out[p] = [(shard, off, n)]
        return out
