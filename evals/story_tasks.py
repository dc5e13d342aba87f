"""Two tasks the demo model can do, built from TinyStories *validation* stories (never the training text):

- tinystories_ending: a story without its last sentence, and four endings: its own and the last sentences of
  three other stories of about the same length (in characters). Scored by log-likelihood, as lm-eval's own
  multiple-choice tasks (hellaswag, arc): acc and acc_norm.
- tinystories_cloze: LAMBADA's construction on TinyStories: the story up to its last word, which must be a
  content word that already occurred earlier in the story; acc is greedy exact match of the word's tokens.

    python -m evals.story_tasks [--src data/corpora/tinystories] [--dst data/benchmarks] [--seed 1234]

Deterministic: the same source and seed write the same bytes. Each task folder gets a SOURCE.txt.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

from workbench.atomic import atomic_write

REPO = Path(__file__).resolve().parents[1]

SRC = REPO / "data" / "corpora" / "tinystories"
HELDOUT, TRAIN = "tinystories_val_head.txt", "tinystories_train_sample_2MiB.txt"
# The file joins stories and their paragraphs alike with a blank line; a story starts with its opening formula.
STORY_START = re.compile(r"Once upon a time|Once there was|Once, there was")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"”])\s+")
STOPWORDS = frozenset("""a about after again all also am an and any are as at be because been before being both but by
can could did do does doing down during each even ever every few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just let me more most much my myself no nor not now of off on
once one only or other our ours out over own same she should so some such than that the their theirs them themselves then
there these they this those through to too under until up upon very was we were what when where which while who whom why
will with would yes yet you your yours""".split())
CHOICES = 4


def stories(text: str) -> list[str]:
    """The held-out file's stories: runs of paragraphs, a new one at each opening formula."""
    out: list[list[str]] = []
    for para in text.split("\n\n"):
        para = para.strip()
        if not para:
            continue
        if not out or STORY_START.match(para):
            out.append([para])
        else:
            out[-1].append(para)
    return ["\n\n".join(s) for s in out]


def content_words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text) if len(w) >= 3 and w.lower() not in STOPWORDS}


def split_ending(story: str) -> tuple[str, str] | None:
    """(context, ending): the ending is the second half of the story's last sentence (its words from the middle
    one on), the context everything before it, with the space between them."""
    start = 0
    for m in SENTENCE_END.finditer(story):
        start = m.end()
    words = story[start:].split(" ")
    if len(words) < 6:
        return None
    ending = " ".join(words[len(words) // 2:])
    return story[: len(story) - len(ending)], ending


def ending_items(texts: list[str], train: str, seed: int) -> list[dict]:
    cands = []
    for i, story in enumerate(texts):
        parts = split_ending(story)
        if parts is None:
            continue
        context, ending = parts
        if len(context.split()) < 40 or ending in train or context[:200] in train:
            continue                                          # short, or seen in training (TinyStories repeats itself)
        cands.append((i, context, ending))
    count: dict[str, int] = {}
    for _, _, e in cands:
        count[e] = count.get(e, 0) + 1
    cands = [c for c in cands if count[c[2]] == 1]            # an ending shared by two stories would be two answers
    words = [content_words(e) for _, _, e in cands]
    rng = random.Random(seed)
    rows = []
    for i, context, ending in cands:
        mine = content_words(context)
        others = sorted((abs(len(e) - len(ending)), j) for j, (_, _, e) in enumerate(cands)
                        if e != ending and not words[j] & mine)
        pool = [cands[j][2] for _, j in others[:12]]          # the 12 closest in length, 3 drawn from them
        wrong = rng.sample(pool, CHOICES - 1)
        label = rng.randrange(CHOICES)
        choices = wrong[:label] + [ending] + wrong[label:]
        rows.append({"id": f"val-{i}", "context": context, "choices": choices, "label": label})
    return rows


def cloze_items(texts: list[str], train: str) -> list[dict]:
    rows = []
    for i, story in enumerate(texts):
        m = re.search(r"([A-Za-z]+)\W*$", story)
        if not m:
            continue
        word, context = m.group(1), story[: m.start(1)]
        if len(word) < 3 or word.lower() in STOPWORDS or not context.endswith(" "):
            continue
        if not re.search(rf"\b{word}\b", context[:-1], re.IGNORECASE):   # the story must have named it before
            continue
        if context[:200] in train:
            continue
        rows.append({"id": f"val-{i}", "context": context.rstrip(" "), "target": word})
    return rows


def _mcq(rows: list[dict]) -> list[dict]:
    """The ending items as OpenCompass's multiple-choice rows: {"context", "A".."D", "answer": letter}."""
    return [{"id": r["id"], "context": r["context"], **dict(zip("ABCD", r["choices"])), "answer": "ABCD"[r["label"]]}
            for r in rows]


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


SOURCE = """Built by evals/story_tasks.py (seed {seed}) from data/corpora/tinystories/{heldout}
(sha256 {src_sha}): the first stories of the TinyStories *validation* split, held out from the demo model's
training (data/models/demo-moe/MODEL_CARD.md). Its provenance, as data/corpora/tinystories/SOURCE.txt says:
{provenance}
License     : TinyStories dataset CDLA-Sharing-1.0 (HF card); these derived files are shared under the same licence.

Stories     : the file joins stories and paragraphs alike with a blank line, so a story is a run of paragraphs
              from one opening formula ("Once upon a time", "Once there was") to the next ({n_stories} stories).
Training    : a story is dropped when its first 200 characters occur verbatim in data/corpora/tinystories/{train}
              (the TinyStories text the model was trained on), and an ending item also when its ending does.
{what}
File        : {name}: {n} rows; {size:,} B, sha256 {sha}
"""

ENDING = """Task        : tinystories_ending. The ending is the second half of the story's last sentence (its words from
              the middle one on; sentences of 6+ words); "context" is the story before it, up to and with the
              space. "choices": the true ending and the endings of three other stories that share no content
              word (3+ letters, not a stop word) with this story's context, drawn (seeded) from the 12 such whose
              length in characters is closest; "label" is the true one's index, drawn uniformly. Contexts of 40+
              words, and only endings that no other story shares."""
MCQ = """
Also        : ending_mcq.jsonl, the same {n} items as OpenCompass rows {{"id", "context", "A".."D", "answer": letter}}
              (evals/opencompass/eval_workbench.py); sha256 {sha}"""
CLOZE = """Task        : tinystories_cloze (LAMBADA's construction). The story up to its last word ("context"), and
              that word ("target"), which must be a content word (3+ letters, not a stop word) that already
              occurs earlier in the story; the story's closing punctuation is dropped."""


def build(src: Path = SRC, dst: Path = REPO / "data" / "benchmarks", seed: int = 1234) -> dict[str, int]:
    raw = (src / HELDOUT).read_bytes()
    texts = stories(raw.decode("utf-8"))
    train = (src / TRAIN).read_text(encoding="utf-8")
    provenance = (src / "SOURCE.txt").read_text(encoding="utf-8").split("2) ")[0].strip()
    out = {}
    ending = ending_items(texts, train, seed)
    for task, name, rows, what in (("tinystories_ending", "ending.jsonl", ending, ENDING + MCQ.format(
                                        n=len(ending), sha=hashlib.sha256(_jsonl(_mcq(ending))).hexdigest())),
                                   ("tinystories_cloze", "cloze.jsonl", cloze_items(texts, train), CLOZE)):
        data = _jsonl(rows)
        d = dst / task
        atomic_write(d / name, data)
        if task == "tinystories_ending":
            atomic_write(d / "ending_mcq.jsonl", _jsonl(_mcq(rows)))
        atomic_write(d / "SOURCE.txt", SOURCE.format(
            seed=seed, heldout=HELDOUT, src_sha=hashlib.sha256(raw).hexdigest(), provenance=provenance,
            n_stories=len(texts), train=TRAIN, what=what, name=name, n=len(rows), size=len(data),
            sha=hashlib.sha256(data).hexdigest()))
        out[task] = len(rows)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="build the TinyStories ending and cloze tasks into data/benchmarks")
    ap.add_argument("--src", default=str(SRC))
    ap.add_argument("--dst", default=str(REPO / "data" / "benchmarks"))
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    for task, n in build(Path(a.src), Path(a.dst), a.seed).items():
        print(f"{task}: {n} items")


if __name__ == "__main__":
    main()
