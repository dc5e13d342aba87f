"""The training corpora, tokenized. Which files train the demo model and which are held out is
workbench.textdata's TRAIN and HELDOUT; training never sees the held-out files.
"""
from pathlib import Path

import numpy as np

from workbench.textdata import TRAIN

EOS = "<|endoftext|>"


def read_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    # The TinyStories train sample separates stories with <|endoftext|>; keep it as the EOS token.
    return text


def encode_train(tokenizer) -> dict[str, np.ndarray]:
    """TRAIN, tokenized: each file's documents (split at EOS, or at blank-line runs) each followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    out = {}
    for name, path in TRAIN.items():
        text = read_text(path)
        parts = text.split(EOS) if EOS in text else text.split("\n\n\n")
        ids = []
        for enc in tokenizer.encode_batch([p.strip() for p in parts if p.strip()]):
            ids.extend(enc.ids)
            if eos is not None:
                ids.append(eos)
        out[name] = np.asarray(ids, dtype=np.int64)
    return out
