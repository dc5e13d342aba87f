"""The demo model's corpora: which files train it, which are held out.

Training never sees the held-out files (TinyStories validation, WikiText-2 test).
"""
from pathlib import Path

CORPORA = Path(__file__).resolve().parents[2] / "data" / "corpora"

TRAIN = {
    "tinystories": CORPORA / "tinystories" / "tinystories_train_sample_2MiB.txt",
    "shakespeare": CORPORA / "tinyshakespeare" / "input.txt",
    "wikitext": CORPORA / "wikitext-2-raw" / "wiki.valid.raw",
}
HELDOUT = {
    "tinystories": CORPORA / "tinystories" / "tinystories_val_head.txt",
    "wikitext": CORPORA / "wikitext-2-raw" / "wiki.test.raw",
}
EOS = "<|endoftext|>"


def read_text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    # The TinyStories train sample separates stories with <|endoftext|>; keep it as the EOS token.
    return text
