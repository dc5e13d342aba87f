"""A checkpoint's multi-token-prediction block (`mtp.*`: Qwen3-Next's, Qwen3.5/3.6's), read for drafting
(engines.mtp.MTPHead, runtime.speculative.MTPDraft): f32 arrays by their names after `mtp.` (transformers' and
vLLM's), experts one tensor each, from one of three sources.

A Hugging Face checkpoint: `mtp/mtp.safetensors` beside the model (the demo's, training/mtp.py: in a folder of its
own, so the checkpoint's fingerprint, and its packs, stay as they were) or the checkpoint's own shards, in float, in
either expert layout (one tensor per expert, or transformers 5's fused `experts.gate_up_proj` and
`experts.down_proj`). The hybrid family's norms are stored as w and used as 1 + w, as its layers' are
(workbench.models.hf): the 1 is added here.

An MLX directory (workbench.models.mlx_layout). mlx-lm's convert drops `mtp.*` (its qwen3_next and qwen3_5
sanitize), so a block there is one given back afterwards, as vllm-mlx's scripts do (scripts/add_mtp_weights.py for
Qwen3-Next, scripts/add_mtp_weights_qwen35.py for Qwen3.5/3.6): the Hugging Face checkpoint's `mtp.*` tensors, the
block's experts stacked into `mtp.layers.0.mlp.switch_mlp.{gate,up,down}_proj.weight` (E, rows, cols), 1 added to
its zero-centred norms (as mlx-lm's sanitize adds it to the model's own), then kept bf16 (--no-quantize) or
quantized with mx.quantize at config.json's `quantization` bits and group (`.weight` affine codes with `.scales` and
`.biases`; `fc`, the norms and the shared expert's gate kept in float). Looked for in `mtp/weights.safetensors` (the
Qwen3.5 script's, beside the model: left out of the index), else among the directory's safetensors (the Qwen3-Next
script's `model-mtp.safetensors`, named in the index or not); `mtp/mtp.safetensors` first, as above. Each module is
read by the directory's own rules (mlx_layout.module_kind: float as it lies, or affine at the bits and group of
config.json's override for the module or its top level, its codes checked against them) and decoded to f32; the
stacked experts are split one tensor each (a fused `experts.gate_up_proj`, bare, with `.gate_up_proj.scales` beside
it where quantized, as the Qwen3.5 script leaves a fused source's, is split as the Hugging Face one is); the norms are
read as they lie, 1 + w already.

A GGUF: its first nextn block (llama.cpp's name for it), read by its tensors' names (workbench.models.gguf_model),
dequantized.

Refused in one line: a checkpoint or MLX directory without MTP tensors (an MLX conversion as mlx-lm's convert
leaves it); a quantized module of an MLX directory's block whose codes are not config.json's bits and group for it
(the file and the module named); a quantized block outside an MLX directory; a pack.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.models.gguf_model import GGUFModel
from workbench.models.hf import Shard, read_config
from workbench.models.mlx_layout import decode, is_mlx_layout, logical_shape, module_kind, module_runs, quantization

PREFIX = "mtp."
FILE = "mtp/mtp.safetensors"
MLX_FILE = "mtp/weights.safetensors"        # vllm-mlx's add_mtp_weights_qwen35.py's (Qwen3-Next's: model-mtp.safetensors)
EXPERTS = "layers.0.mlp.experts."
SWITCH = "layers.0.mlp.switch_mlp."


def _in_block(name: str) -> bool:
    """mtp.* outside its layers, and its first layer's (one block drafts)."""
    return name.startswith(PREFIX) and (not name.startswith(PREFIX + "layers.") or name.startswith(PREFIX + "layers.0."))


def _tensors(path: Path, mlx: bool) -> list:
    """[(shard, name)] of the block's tensors (codes, scales and biases too in an MLX directory); none where it has
    no block."""
    if not path.is_dir():
        raise WorkbenchError(f"{path}: MTP drafts read the mtp.* tensors of a Hugging Face checkpoint (or "
                             f"mtp.safetensors beside it) or of an MLX directory, or a GGUF's nextn block; a pack's "
                             f"are not read")
    own = next((path / f for f in ((FILE, MLX_FILE) if mlx else (FILE,)) if (path / f).exists()), None)
    out = []
    for f in [own] if own else sorted(path.glob("*.safetensors")):
        shard = Shard(f)
        for name in shard.header:
            if _in_block(name):
                if name.endswith(".scales") and not mlx:
                    raise WorkbenchError(f"{f}: {name}: the MTP block is quantized (MLX's affine groups) in a directory "
                                         f"not in MLX's layout (no quantization in its config.json gives the bits): "
                                         f"draft=mtp reads a Hugging Face checkpoint's block in float (bf16, f16 or f32)")
                out.append((shard, name))
    return out


def has_mtp(path: Path) -> bool:
    """Whether a Hugging Face checkpoint or an MLX directory holds an MTP block (mtp.fc.weight)."""
    path = Path(path)
    return any(name == PREFIX + "fc.weight" for _, name in _tensors(path, is_mlx_layout(path)))


def _block(path: Path, mlx: bool) -> list:
    """_tensors, or one line where there is no block."""
    out = _tensors(path, mlx)
    if not any(name == PREFIX + "fc.weight" for _, name in out):
        where = (f"in {FILE}, {MLX_FILE} or its safetensors (an MLX conversion: mlx-lm's convert drops a checkpoint's "
                 f"mtp.* tensors; vllm-mlx's add_mtp_weights scripts give them back)") if mlx else \
            f"in its safetensors, no {FILE} beside it"
        raise WorkbenchError(f"{path}: no MTP layers (no mtp.fc.weight {where}): draft=mtp needs a checkpoint with a "
                             f"multi-token-prediction block")
    return out


def _mlx_modules(path: Path, tensors: list) -> list:
    """[(name after `mtp.`, logical shape, kind, runs)] of an MLX directory's block, from its headers and config.json.
    A module's codes (or float tensor) are its `.weight`, or the bare tensor where it has no such name (fused experts)."""
    parts: dict[str, dict] = {}
    for shard, name in tensors:
        module, _, what = name.rpartition(".")
        if what not in ("weight", "scales", "biases"):
            module, what = name, "weight"
        parts.setdefault(module, {})[what] = (shard, name)
    cfg = path / "config.json"
    q = quantization(read_config(cfg), cfg)
    out = []
    for module, p in parts.items():
        kind = module_kind(module, p, q, cfg)
        shard, name = p["weight"]
        out.append((name[len(PREFIX):], logical_shape(shard.header[name]["shape"], kind), kind, module_runs(p)))
    return out


def mtp_bytes(path: Path) -> int:
    """What the block holds in memory to draft (float32, as load_mtp gives it), from the file's headers alone."""
    path = Path(path)
    if path.suffix == ".gguf":
        g = GGUFModel(path)
        return sum(4 * int(np.prod(g.raw[n].shape)) for n, m in g.mtp_tensors_of_block().items() if m is not None)
    if mlx := is_mlx_layout(path):
        return sum(4 * int(np.prod(shape)) for _, shape, _, _ in _mlx_modules(path, _block(path, mlx)))
    return sum(4 * int(np.prod(shard.header[name]["shape"])) for shard, name in _block(path, mlx))


def load_mtp(path: Path, zero_centred: bool = False) -> dict[str, np.ndarray]:
    """The block's tensors by their names after `mtp.`, f32, with only its first layer (one block drafts), experts
    one tensor each. zero_centred: a Hugging Face checkpoint's norms are stored as w and used as 1 + w
    (spec.layer_types: the hybrid family), so the 1 is added; a GGUF holds them as used already, and so does an MLX
    directory (vllm-mlx's scripts add the 1, as mlx-lm's sanitize does to the model's own norms): not added there."""
    path = Path(path)
    if path.suffix == ".gguf":
        return GGUFModel(path).mtp_block()
    mlx = is_mlx_layout(path)
    if mlx:
        out = {name: decode(runs, shape, kind, PREFIX + name)
               for name, shape, kind, runs in _mlx_modules(path, _block(path, mlx))}
        for part in ("gate", "up", "down"):
            if (stacked := out.pop(f"{SWITCH}{part}_proj.weight", None)) is not None:
                for e in range(stacked.shape[0]):
                    out[f"{EXPERTS}{e}.{part}_proj.weight"] = stacked[e]
    else:
        out = {name[len(PREFIX):]: shard.array(name) for shard, name in _block(path, mlx)}
    if (fused := out.pop(EXPERTS + "gate_up_proj", None)) is not None:
        ff = fused.shape[1] // 2
        down = out.pop(EXPERTS + "down_proj")
        for e in range(fused.shape[0]):
            out[f"{EXPERTS}{e}.gate_proj.weight"], out[f"{EXPERTS}{e}.up_proj.weight"] = fused[e, :ff], fused[e, ff:]
            out[f"{EXPERTS}{e}.down_proj.weight"] = down[e]
    if zero_centred and not mlx:
        out = {k: v + np.float32(1) if "norm" in k else v for k, v in out.items()}
    return out
