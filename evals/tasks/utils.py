"""Local datasets for the *_local lm-eval tasks: data/benchmarks/<name>/ (see each SOURCE.txt).

Loaded with `custom_dataset`, so nothing is fetched from a hub and the paths do not depend on the
working directory. Prompt functions copy lm-eval 0.4's own (winogrande's partial scoring).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "data" / "benchmarks"


def _rows(rel: str) -> list[dict]:
    p = BENCH / rel
    if not p.exists():
        raise FileNotFoundError(f"{p}: missing; run `python -m evals.prepare_benchmarks` or `python -m evals.story_tasks` "
                                "(see evals/README.md)")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


def _dataset(split: str, rel: str):
    import datasets
    return datasets.DatasetDict({split: datasets.Dataset.from_list(_rows(rel))})


def lambada_openai(**kw):
    return _dataset("test", "lambada_openai/lambada_test.jsonl")


def hellaswag(**kw):
    return _dataset("validation", "hellaswag/hellaswag_val.jsonl.gz")


def arc_easy(**kw):
    return _dataset("test", "arc_easy/test.jsonl")


def arc_challenge(**kw):
    return _dataset("test", "arc_challenge/test.jsonl")


def piqa(**kw):
    return _dataset("validation", "piqa/valid.jsonl")


def winogrande(**kw):
    return _dataset("validation", "winogrande/dev.jsonl")


def boolq(**kw):
    return _dataset("validation", "boolq/val.jsonl")


def tinystories_ending(**kw):
    return _dataset("test", "tinystories_ending/ending.jsonl")


def tinystories_cloze(**kw):
    return _dataset("test", "tinystories_cloze/cloze.jsonl")


# winogrande: the choices are the two contexts, the target the shared rest of the sentence (lm-eval's own).
def wg_doc_to_text(doc):
    return {"1": 0, "2": 1}[doc["answer"]]


def wg_doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def wg_doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]
