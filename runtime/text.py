"""What a run decodes: the model's own greedy tokens (free), or a corpus's tokens fed one by one (forced text).

A made checkpoint (random weights, `make-model`) decodes forced text by default: its own argmax degenerates into a
token or two repeated ("hoped , , , Bat Bat ,"), and repeated tokens route to the same experts, so a free run
measures a routing no real model has. Forced, each step still computes the model's logits and routes as the model
does; only the token fed next is the corpus's (TinyStories validation unless a corpus or file is named). A trained
model decodes free by default. Every record says which (`text`).
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import WorkbenchError

FORCED_DEFAULT = "tinystories"      # the held-out text (workbench.textdata.HELDOUT) a made checkpoint decodes


@dataclass(frozen=True)
class Text:
    source: str                         # "free", or the corpus (a name in workbench.textdata, or a file)
    prompt: list | None = None          # forced: the corpus's first tokens, as many as the prompt had
    forced: list | None = None          # forced: the tokens fed after them, one per decode step

    @property
    def label(self) -> str:
        if self.forced is None:
            return "free: the model's own greedy tokens"
        return f"forced text: {self.source} ({len(self.prompt)} prompt + {len(self.forced)} tokens fed)"


def run_text(text: str | None, random_weights, tokenizer, prompt, tokens: int, path="the model") -> Text:
    """text: None (forced TinyStories on a made checkpoint, free otherwise), "free", or a corpus name or file."""
    source = text or (FORCED_DEFAULT if random_weights else "free")
    if source == "free":
        return Text("free")
    if tokenizer is None:
        raise WorkbenchError(f"{path}: no tokenizer, so no text to force: pass --free (or token ids)")
    from workbench.textdata import heldout_ids
    n = max(1, len(tokenizer.encode(prompt).ids) if isinstance(prompt, str) else len(prompt))
    ids = heldout_ids(tokenizer, source, n + tokens)
    if len(ids) < n + tokens:
        raise WorkbenchError(f"{source}: {len(ids)} tokens of text, the run needs {n + tokens} (prompt {n} + "
                             f"{tokens} tokens)")
    return Text(source, ids[:n], ids[n:n + tokens])
