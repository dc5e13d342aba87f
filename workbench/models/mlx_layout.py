"""Read a checkpoint in MLX's layout (mlx-lm's `convert`: every mlx-community model) as it lies.

    m = MLXModel(DIR)        # config.json + safetensors shards (one file, or several with an index)
    m.spec, m.names(), m.tensor(name), m.tensor_shape(name), m.expert(layer, e), m.path   (as HFModel)
    m.tensor_kind(name), m.tensor_runs(name)          its kind as it lies, and where its bytes lie
    m.expert_kinds(layer), m.expert_runs(layer, e)    the same for one expert's gate, up, down
    quantization(config, path), module_kind(module, parts, q, path), logical_shape(shape, kind),
    module_runs(parts), decode(runs, shape, kind, what)   one module by the same rules, outside a model's own
                                                          (workbench/models/mtp.py: an MTP block given back to one)

The layout: each layer's experts stacked, `model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.weight`
(E, rows, ...); the rest named as in the Hugging Face checkpoint (mapped to canonical names by hf.py's rules).
A quantized module's `.weight` holds MLX's affine codes (uint32, an LSB-first bit stream per row) with its
`.scales` and `.biases` (the model's dtype) beside it; config.json's `quantization` gives {"group_size", "bits"}
and per-module overrides ("model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}: mlx-lm keeps routers at 8
bits) or false (left in float). Its kind is quant.mlx_kind(bits, group, scale dtype): the pack's affine format
(codes, then scales, then biases) at the file's own width, group and scale dtype, which the numpy engine decodes
and the packed and MLX engines compute from as it lies. Each tensor is one to three byte runs (codes, scales,
biases: `runs`), so an index of them (workbench/store/safetensors_index.py) streams the experts from the file.

The hybrid family (Qwen3-Next `qwen3_next`, Qwen3.5/3.6-MoE `qwen3_5_moe`) as mlx-lm's sanitize leaves it, each
change read as it lies, so nothing is stored in the index but the runs: the zero-centred norms hold 1 + w already
(bf16), the canonical norm itself (no 1 added on read, unlike hf.py's); each `linear_attn.conv1d.weight` is
(channels, K, 1), the same bytes as Hugging Face's (channels, 1, K), which `tensor_shape` says (a file still holding
(channels, 1, K) was not sanitized, its norms not shifted either: refused); `linear_attn.A_log` and `.dt_bias` are
bare float tensors (A_log kept f32 for Qwen3.5); Qwen3-Next's fused in_proj_qkvz / in_proj_ba keep Hugging Face's
per-key-head grouping; the shared expert's gate is quantized at 8 bits like the router; Qwen3.5's text model is
named `language_model.model.*` and `language_model.lm_head` (mlx-lm's module path), read as `model.*`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.models.hf import _KINDS, _LAYER, _RULES, HFModel, Shard
from workbench.store import quant

PARTS = ("gate", "up", "down")
_SWITCH = re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.switch_mlp\.(gate|up|down)_proj")
_PARAMETER = re.compile(_LAYER + r"linear_attn\.(?:A_log|dt_bias)")


def is_mlx_layout(path) -> bool:
    """A directory whose config.json says MLX quantized it, or whose shards hold stacked switch_mlp experts."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False        # HFModel says what is wrong with it
    if isinstance(cfg, dict) and isinstance(cfg.get("quantization"), dict):
        return True
    index = p / "model.safetensors.index.json"
    try:
        if index.exists():
            return any(".switch_mlp." in n for n in json.loads(index.read_text())["weight_map"])
        return any(".switch_mlp." in n for f in p.glob("*.safetensors") for n in Shard(f).header)
    except (OSError, ValueError, KeyError, TypeError, WorkbenchError):
        return False


def quantization(config: dict, config_path) -> dict | None:
    """config.json's `quantization` ({"group_size", "bits", per-module overrides}), None where it has none; a mode
    other than affine refused."""
    q = config.get("quantization") or None
    if isinstance(q, dict) and q.get("mode", "affine") != "affine":
        raise WorkbenchError(f"{config_path}: quantization mode {q.get('mode')!r} is not read (affine only)")
    return q


def module_kind(module: str, parts: dict, q: dict | None, config_path) -> str:
    """A module's kind as it lies, from its parts {weight|scales|biases: (shard, tensor name)}: float (bf16/f16/f32),
    or affine at the bits and group config.json's quantization `q` gives it (its own override, or the top level's),
    its codes, scales and biases checked against them."""
    where = f"{next(iter(parts.values()))[0].path}: {module}"
    if "weight" not in parts:
        raise WorkbenchError(f"{where}: has {', '.join(parts)} but no .weight")
    shard, name = parts["weight"]
    dtype = shard.dtype(name)
    if "scales" not in parts:
        if dtype not in _KINDS:
            raise WorkbenchError(f"{where}.weight is {dtype} without .scales: neither float nor MLX-quantized")
        return _KINDS[dtype]
    if "biases" not in parts:
        raise WorkbenchError(f"{where}: has .scales but no .biases (affine mode keeps both)")
    own = q.get(module, q) if isinstance(q, dict) else None
    if not isinstance(own, dict) or not isinstance(own.get("bits"), int) or not isinstance(own.get("group_size"), int):
        raise WorkbenchError(f"{config_path}: no quantization bits and group_size for {module}")
    bits, group = own["bits"], own["group_size"]
    sdt = parts["scales"][0].dtype(parts["scales"][1])
    w, sc = (p[0].header[p[1]]["shape"] for p in (parts["weight"], parts["scales"]))
    cols = w[-1] * 32 // bits if bits in range(1, 9) else 0
    if dtype != "U32" or sdt not in _KINDS or not cols or sc[-1] * group != cols or sc[:-1] != w[:-1] \
            or parts["biases"][0].header[parts["biases"][1]]["shape"] != sc \
            or parts["biases"][0].dtype(parts["biases"][1]) != sdt:
        raise WorkbenchError(f"{where}: .weight {dtype} {w}, .scales {sdt} {sc} are not {bits}-bit codes with "
                             f"scales per {group} (config.json's quantization)")
    return quant.mlx_kind(bits, group, _KINDS[sdt])


def logical_shape(shape, kind: str) -> list[int]:
    """A module's shape from its .weight's as it lies: a quantized one's columns are its codes' times 32 / bits."""
    shape, a = list(shape), quant.affine(kind)
    return shape[:-1] + [shape[-1] * 32 // a[0]] if a else shape


def module_runs(parts: dict, index: int | None = None, count: int = 1) -> list[tuple[Shard, int, int]]:
    """(shard, file offset, bytes) of a module's codes, scales and biases (a float one: its one tensor); of its slice
    `index` of `count` along the first axis, for stacked experts."""
    out = []
    for what in ("weight", "scales", "biases"):
        if what not in parts:
            continue
        shard, name = parts[what]
        start, end = shard.header[name]["data_offsets"]
        n, off = end - start, shard.base + start
        if index is not None:
            n //= count
            off += index * n
        out.append((shard, off, n))
    return out


def decode(runs, shape, kind: str, what: str) -> np.ndarray:
    """float32 (shape) of a module's runs at its kind, or one line naming the file where they do not hold it."""
    buf = np.concatenate([shard._read(off, n) for shard, off, n in runs])
    try:
        return quant.decode(buf, tuple(shape), kind)
    except ValueError as e:
        raise WorkbenchError(f"{runs[0][0].path}: {what} does not hold a {kind} {list(shape)} ({e})") from None


class MLXModel(HFModel):
    """A checkpoint directory in MLX's layout, read lazily tensor by tensor."""

    def __init__(self, path):
        self.modules: dict[str, dict[str, tuple[Shard, str]]] = {}     # module path -> {weight|scales|biases: ...}
        super().__init__(path)      # config, shards, spec; _index files each tensor under its module
        q = quantization(self.config, self.path / "config.json")
        self.kinds = {m: module_kind(m, t, q, self.path / "config.json") for m, t in self.modules.items()}
        self._check_experts()
        self._check_conv()

    # ------------------------------------------------------------ indexing

    def _index(self, shard: Shard, name: str):
        hf = name.removeprefix("language_model.")      # mlx-lm's name for Qwen3.5's text model: its own module
        if _PARAMETER.fullmatch(hf):    # linear attention's A_log, dt_bias: a bare float, filed as a module's .weight
            module, what, as_hf = name, "weight", hf
        else:
            module, _, what = name.rpartition(".")
            as_hf = hf.rpartition(".")[0] + ".weight"
        if what not in ("weight", "scales", "biases") or not module:
            return
        if m := _SWITCH.fullmatch(as_hf.removesuffix(".weight")):
            for e in range(self.spec.num_experts):
                self.experts[(int(m[1]), e, m[2])] = (shard, module, e)
        else:
            canonical = next((t.format(*mm.groups()) for pattern, t in _RULES
                              if (mm := re.fullmatch(pattern, as_hf))), None)
            if canonical is None:
                return      # an unknown or skipped module (a vision tower, mtp): not read
            self.where[canonical] = (shard, module)
        self.modules.setdefault(module, {})[what] = (shard, name)

    def _check_experts(self):
        for (layer, e, p), (_, module, _) in self.experts.items():
            shape = self._shape(module)
            want = {"gate": [self.spec.moe_intermediate_size, self.spec.hidden_size],
                    "up": [self.spec.moe_intermediate_size, self.spec.hidden_size],
                    "down": [self.spec.hidden_size, self.spec.moe_intermediate_size]}[p]
            if shape != [self.spec.num_experts, *want]:
                raise WorkbenchError(f"{self.path}: {module} holds {shape}, not the config's {[self.spec.num_experts, *want]}")

    def _check_conv(self):
        """mlx-lm's sanitize moves a Gated DeltaNet conv kernel's axis, (channels, 1, K) -> (channels, K, 1), when it
        adds the 1 to the zero-centred norms: a file that holds (channels, 1, K) was not sanitized, its norms not
        shifted, and is refused rather than read one or the other way."""
        K = (self.spec.linear or {}).get("conv_kernel")
        for name, (_, module) in self.where.items():
            if name.endswith(".lin_conv") and (shape := self._shape(module))[1:] != [K, 1]:
                raise WorkbenchError(f"{self.path}: {module} holds {shape}, not mlx-lm's (channels, {K}, 1)")

    def _shape(self, module: str) -> list[int]:
        """The module's logical shape (logical_shape)."""
        shard, name = self.modules[module]["weight"]
        return logical_shape(shard.header[name]["shape"], self.kinds[module])

    def _runs(self, module: str, index: int | None = None) -> list[tuple[Shard, int, int]]:
        """module_runs of the module, or of expert `index` of its stacked experts."""
        return module_runs(self.modules[module], index, self.spec.num_experts)

    # ------------------------------------------------------------ the reader's interface

    def tensor_kind(self, name: str) -> str:
        return self.kinds[self.where[name][1]]

    def tensor_shape(self, name: str) -> list[int]:
        shape = self._shape(self.where[name][1])
        if name.endswith(".lin_conv"):  # mlx-lm's (channels, K, 1): the bytes of Hugging Face's (channels, 1, K)
            return [shape[0], 1, shape[1]]
        return shape

    def tensor_runs(self, name: str) -> list[tuple[Shard, int, int]]:
        return self._runs(self.where[name][1])

    def tensor(self, name: str) -> np.ndarray:
        return decode(self.tensor_runs(name), self.tensor_shape(name), self.tensor_kind(name), name)

    def tensor_raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as they lie (codes, scales, biases joined: its kind's buffer), for a pack that keeps
        them (convert --rest raw)."""
        return np.concatenate([shard._read(off, n) for shard, off, n in self.tensor_runs(name)])

    def source_dtype(self, name: str) -> str:
        return self.tensor_kind(name)

    def expert_kinds(self, layer: int) -> dict[str, str]:
        return {p: self.kinds[self.experts[(layer, 0, p)][1]] for p in PARTS}

    def expert_runs(self, layer: int, e: int) -> dict[str, list[tuple[Shard, int, int]]]:
        return {p: self._runs(self.experts[(layer, e, p)][1], e) for p in PARTS}

    def expert_raw(self, layer: int, e: int) -> dict[str, np.ndarray]:
        return {p: np.concatenate([shard._read(off, n) for shard, off, n in rs])
                for p, rs in self.expert_runs(layer, e).items()}

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        kinds, runs = self.expert_kinds(layer), self.expert_runs(layer, e)
        return {p: decode(runs[p], self._shape(self.experts[(layer, e, p)][1])[1:], kinds[p],
                          f"expert {e} of layer {layer}") for p in PARTS}

    def names(self) -> list[str]:
        return list(self.where)

    def source_info(self) -> dict:
        return {**super().source_info(), "format": "mlx", "quantization": self.config.get("quantization")}

