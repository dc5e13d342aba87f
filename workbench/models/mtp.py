"""A checkpoint's multi-token-prediction block (`mtp.*`: Qwen3-Next's, Qwen3.5/3.6's in Hugging Face files), read
for drafting (engines.mtp.MTPHead, runtime.speculative.MTPDraft): from `mtp/mtp.safetensors` beside the model (the
demo's, training/mtp.py: in a folder of its own, so the checkpoint's fingerprint, and its packs, stay as they were)
or from the checkpoint's own shards, in either expert layout (one tensor per expert, or transformers 5's fused
`experts.gate_up_proj` and `experts.down_proj`). The hybrid family's norms are stored as w and used as 1 + w, as
its layers' are (workbench.models.hf): the 1 is added here.

Refused in one line: a checkpoint without MTP tensors; an MLX directory (mlx-lm's convert drops `mtp.*`, in its
qwen3_next and qwen3_5 sanitize, so an MLX conversion holds none; one that was given them back holds them
quantized, which is not read); a pack. A GGUF's first nextn block (llama.cpp's name for it) is read by its
tensors' names (workbench.models.gguf_model), dequantized.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.models.gguf_model import GGUFModel
from workbench.models.hf import Shard
from workbench.models.mlx_layout import is_mlx_layout

PREFIX = "mtp."
FILE = "mtp/mtp.safetensors"


def _tensors(path: Path) -> list:
    """[(shard, name)] of the block's tensors in a Hugging Face checkpoint: mtp.* outside its layers, and its first
    layer's (one block drafts); none where it has no block."""
    if not path.is_dir():
        raise WorkbenchError(f"{path}: MTP drafts read a Hugging Face checkpoint's mtp.* tensors (or mtp.safetensors "
                             f"beside it) or a GGUF's nextn block; a pack's are not read")
    files = [path / FILE] if (path / FILE).exists() else sorted(path.glob("*.safetensors"))
    out = []
    for f in files:
        shard = Shard(f)
        for name in shard.header:
            if name.startswith(PREFIX) and not name.startswith(PREFIX + "layers.") or \
                    name.startswith(PREFIX + "layers.0."):
                if name.endswith(".scales"):
                    raise WorkbenchError(f"{f}: {name}: the MTP block is quantized (MLX's affine groups); draft=mtp "
                                         f"reads it in float (bf16, f16 or f32), as the Hugging Face checkpoint holds it")
                out.append((shard, name))
    return out


def has_mtp(path: Path) -> bool:
    """Whether a Hugging Face checkpoint holds an MTP block (mtp.fc.weight in its shards, or mtp.safetensors)."""
    return any(name == PREFIX + "fc.weight" for _, name in _tensors(Path(path)))


def _block(path: Path) -> list:
    """_tensors, or one line where there is no block."""
    out = _tensors(path)
    if not any(name == PREFIX + "fc.weight" for _, name in out):
        why = (" (an MLX conversion: mlx-lm's convert drops a checkpoint's mtp.* tensors)" if is_mlx_layout(path)
               else "")
        raise WorkbenchError(f"{path}: no MTP layers (no mtp.fc.weight in its safetensors, no {FILE} beside it{why}): "
                             f"draft=mtp needs a checkpoint with a multi-token-prediction block")
    return out


def mtp_bytes(path: Path) -> int:
    """What the block holds in memory to draft (float32, as load_mtp gives it), from the file's headers alone."""
    path = Path(path)
    if path.suffix == ".gguf":
        g = GGUFModel(path)
        return sum(4 * int(np.prod(g.raw[n].shape)) for n, m in g.mtp_tensors_of_block().items() if m is not None)
    return sum(4 * int(np.prod(shard.header[name]["shape"])) for shard, name in _block(path))


def load_mtp(path: Path, zero_centred: bool = False) -> dict[str, np.ndarray]:
    """The block's tensors by their names after `mtp.`, f32, with only its first layer (one block drafts), experts
    one tensor each. zero_centred: a Hugging Face checkpoint's norms are used as 1 + w (spec.layer_types: the hybrid
    family); a GGUF holds them so already."""
    path = Path(path)
    if path.suffix == ".gguf":
        return GGUFModel(path).mtp_block()
    out = {name[len(PREFIX):]: shard.array(name) for shard, name in _block(path)}
    experts = "layers.0.mlp.experts."
    if (fused := out.pop(experts + "gate_up_proj", None)) is not None:
        ff = fused.shape[1] // 2
        down = out.pop(experts + "down_proj")
        for e in range(fused.shape[0]):
            out[f"{experts}{e}.gate_proj.weight"], out[f"{experts}{e}.up_proj.weight"] = fused[e, :ff], fused[e, ff:]
            out[f"{experts}{e}.down_proj.weight"] = down[e]
    if zero_centred:
        out = {k: v + np.float32(1) if "norm" in k else v for k, v in out.items()}
    return out
