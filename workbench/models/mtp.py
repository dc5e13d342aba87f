"""A checkpoint's multi-token-prediction block (`mtp.*`: Qwen3-Next's, Qwen3.5/3.6's in Hugging Face files), read
for drafting (engines.mtp.MTPHead, runtime.speculative.MTPDraft): from `mtp/mtp.safetensors` beside the model (the
demo's, training/mtp.py: in a folder of its own, so the checkpoint's fingerprint, and its packs, stay as they were)
or from the checkpoint's own shards. A GGUF's MTP blocks (llama.cpp's nextn) and an MLX
directory's are not read as drafts: refused in one line, as is a checkpoint without MTP tensors.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.models.hf import Shard

PREFIX = "mtp."
FILE = "mtp/mtp.safetensors"


def load_mtp(path: Path) -> dict[str, np.ndarray]:
    """The block's tensors by their names after `mtp.`, f32, with only its first layer (one block drafts)."""
    path = Path(path)
    if path.suffix == ".gguf" or not path.is_dir():
        raise WorkbenchError(f"{path}: MTP drafts read a Hugging Face checkpoint's mtp.* tensors (or mtp.safetensors "
                             f"beside it); a GGUF's nextn blocks or a pack are not read as drafts")
    files = [path / FILE] if (path / FILE).exists() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        shard = Shard(f)
        for name in shard.header:
            if name.startswith(PREFIX) and not name.startswith(PREFIX + "layers.") or \
                    name.startswith(PREFIX + "layers.0."):
                out[name[len(PREFIX):]] = shard.array(name)
    if "fc.weight" not in out:
        raise WorkbenchError(f"{path}: no MTP layers (no mtp.fc.weight in its safetensors, no {FILE} beside it): "
                             f"draft=mtp needs a checkpoint with a multi-token-prediction block")
    return out
