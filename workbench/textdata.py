"""The corpora shipped in data/corpora: which files train the demo model, which are held out (TinyStories
validation, WikiText-2 test: the text the workbench evaluates on)."""
from __future__ import annotations

from pathlib import Path

from workbench.errors import WorkbenchError

CORPORA = Path(__file__).resolve().parents[1] / "data" / "corpora"
TRAIN = {
    "tinystories": CORPORA / "tinystories" / "tinystories_train_sample_2MiB.txt",
    "shakespeare": CORPORA / "tinyshakespeare" / "input.txt",
    "wikitext": CORPORA / "wikitext-2-raw" / "wiki.valid.raw",
}
HELDOUT = {
    "tinystories": CORPORA / "tinystories" / "tinystories_val_head.txt",
    "wikitext": CORPORA / "wikitext-2-raw" / "wiki.test.raw",
}


def text_of(name_or_path: str) -> str:
    path = HELDOUT.get(name_or_path.replace("wikitext2", "wikitext"), Path(name_or_path))
    if not Path(path).exists():
        raise WorkbenchError(f"{path}: no such data file (use tinystories, wikitext2, or a text file)")
    return Path(path).read_text(encoding="utf-8")


def heldout_ids(tokenizer, name: str, n_tokens: int) -> list[int]:
    """The first n_tokens of a held-out corpus (whole paragraphs are encoded, then cut)."""
    text = text_of(name)
    ids = tokenizer.encode(text[: n_tokens * 8]).ids
    return ids[:n_tokens]
