"""Copy the benchmark files the local lm-eval tasks read from shared/data into data/benchmarks/, converted to
the jsonl rows lm-eval's own task configs expect, each folder with its SOURCE.txt (provenance, licence) and
a note of the conversion.

    python -m evals.prepare_benchmarks [--src ../shared/data] [--dst data/benchmarks]

Deterministic: running it again rewrites the same bytes.
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import shutil
from pathlib import Path

from evals.common import REPO

NOTE = "\n\n--- Converted for moe-workbench by evals/prepare_benchmarks.py ---\n"


def _jsonl(path: Path, rows, compress=False):
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()
    if compress:
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return len(data), hashlib.sha256(data).hexdigest()


def _read_jsonl(path: Path):
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]


def _source(dst: Path, src_file: Path, note: str, extra: list[Path] = ()):
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "SOURCE.txt").write_text(src_file.read_text(encoding="utf-8").rstrip("\n") + NOTE + note.strip() + "\n",
                                    encoding="utf-8")
    for f in extra:
        shutil.copyfile(f, dst / f.name)


def _desc(name, n, size, sha, compress=False):
    what = "gzip of the jsonl" if compress else "jsonl"
    return f"File        : {name} ({what}): {n} rows; uncompressed {size:,} B, sha256 {sha}"


def lambada(src: Path, dst: Path):
    rows = _read_jsonl(src / "lambada/openai/lambada_test.jsonl")
    d = dst / "lambada_openai"
    _source(d, src / "lambada/SOURCE.txt", "")
    size, sha = _jsonl(d / "lambada_test.jsonl", rows)
    _source(d, src / "lambada/SOURCE.txt", f"""Only openai/lambada_test.jsonl is used (task lambada_openai_local), rows unchanged ({{"text"}}).
{_desc("lambada_test.jsonl", len(rows), size, sha)}""")


def hellaswag(src: Path, dst: Path):
    lines = bz2.decompress((src / "hellaswag/hellaswag_val_full.txt.bz2").read_bytes()).decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) % 6 == 0, len(lines)
    rows = []
    for i in range(0, len(lines), 6):
        ctx, gold, *endings = lines[i:i + 6]
        rows.append({"query": ctx, "choices": endings, "gold": int(gold)})
    d = dst / "hellaswag"
    _source(d, src / "hellaswag/SOURCE.txt", "", [src / "hellaswag/LICENSE.klosax", src / "hellaswag/README.klosax.md"])
    size, sha = _jsonl(d / "hellaswag_val.jsonl.gz", rows, compress=True)
    _source(d, src / "hellaswag/SOURCE.txt", f"""Each 6-line task becomes {{"query": line 1, "gold": int(line 2), "choices": lines 3-6}}, in file order
              (task hellaswag_local). Stored gzipped to keep data/benchmarks small. Unlike lm-eval's hellaswag, ctx_b
              is not capitalised (the text format has lost the ctx_a/ctx_b split), so scores can differ slightly.
{_desc("hellaswag_val.jsonl.gz", len(rows), size, sha, True)}""",
            [src / "hellaswag/LICENSE.klosax", src / "hellaswag/README.klosax.md"])


def arc(src: Path, dst: Path):
    for sub, name in (("ARC-Easy", "arc_easy"), ("ARC-Challenge", "arc_challenge")):
        rows = []
        for r in _read_jsonl(src / f"arc/{sub}/{sub}-Test.jsonl"):
            q = r["question"]
            rows.append({"id": r["id"], "question": q["stem"], "answerKey": r["answerKey"],
                         "choices": {"text": [c["text"] for c in q["choices"]], "label": [c["label"] for c in q["choices"]]}})
        d = dst / name
        d.mkdir(parents=True, exist_ok=True)
        size, sha = _jsonl(d / "test.jsonl", rows)
        note = f"""Test split of {sub} only (what lm-eval's {name} scores), reshaped to the HF allenai/ai2_arc rows
              {{"id", "question": stem, "choices": {{"text": [...], "label": [...]}}, "answerKey"}} (task {name}_local).
{_desc("test.jsonl", len(rows), size, sha)}"""
        if name == "arc_easy":
            mcq = [{"question": r["question"], **dict(zip("ABCD", r["choices"]["text"])),
                    "answer": "ABCD"[r["choices"]["label"].index(r["answerKey"])]}
                   for r in rows if len(r["choices"]["text"]) == 4 and r["answerKey"] in r["choices"]["label"]][:500]
            msize, msha = _jsonl(d / "arc_easy_mcq.jsonl", mcq)
            note += f"""
Also        : arc_easy_mcq.jsonl, the first {len(mcq)} four-choice test items as OpenCompass custom-MCQ rows
              {{"question", "A", "B", "C", "D", "answer": letter}} (used by evals/opencompass/); uncompressed
              {msize:,} B, sha256 {msha}"""
        _source(d, src / "arc/SOURCE.txt", note)


def piqa(src: Path, dst: Path):
    rows = _read_jsonl(src / "piqa/valid.jsonl")
    labels = [int(l) for l in (src / "piqa/valid-labels.lst").read_text().split()]
    assert len(rows) == len(labels), (len(rows), len(labels))
    rows = [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": lab} for r, lab in zip(rows, labels)]
    d = dst / "piqa"
    _source(d, src / "piqa/SOURCE.txt", "", [src / "piqa/README.md"])
    size, sha = _jsonl(d / "valid.jsonl", rows)
    _source(d, src / "piqa/SOURCE.txt", f"""valid.jsonl joined line by line with valid-labels.lst: {{"goal", "sol1", "sol2", "label": 0|1}}
              (task piqa_local). README.md (the licence statement) is copied beside it.
{_desc("valid.jsonl", len(rows), size, sha)}""", [src / "piqa/README.md"])


def winogrande(src: Path, dst: Path):
    rows = _read_jsonl(src / "winogrande/dev.jsonl")
    labels = (src / "winogrande/dev-labels.lst").read_text().split()
    assert len(rows) == len(labels) and all(r["answer"] == lab for r, lab in zip(rows, labels))
    rows = [{k: r[k] for k in ("qID", "sentence", "option1", "option2", "answer")} for r in rows]
    d = dst / "winogrande"
    _source(d, src / "winogrande/SOURCE.txt", "", [src / "winogrande/README.md"])
    size, sha = _jsonl(d / "dev.jsonl", rows)
    _source(d, src / "winogrande/SOURCE.txt", f"""dev.jsonl unchanged in content ({{"qID", "sentence", "option1", "option2", "answer": "1"|"2"}}); every
              answer checked against dev-labels.lst (task winogrande_local). README.md (licence) copied beside it.
{_desc("dev.jsonl", len(rows), size, sha)}""", [src / "winogrande/README.md"])


def boolq(src: Path, dst: Path):
    rows = _read_jsonl(src / "boolq/val.jsonl")
    rows = [{"question": r["question"], "passage": r["passage"], "idx": r["idx"],
             "label": {"true": 1, "false": 0}[str(r["label"]).lower()]} for r in rows]
    d = dst / "boolq"
    d.mkdir(parents=True, exist_ok=True)
    size, sha = _jsonl(d / "val.jsonl", rows)
    _source(d, src / "boolq/SOURCE.txt", f"""The string label becomes an int as in super_glue/boolq (false 0, true 1): {{"question", "passage",
              "idx", "label"}} (task boolq_local).
{_desc("val.jsonl", len(rows), size, sha)}""")


def main(argv=None):
    ap = argparse.ArgumentParser(description="convert shared/data benchmarks into data/benchmarks")
    ap.add_argument("--src", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--dst", default=str(REPO / "data" / "benchmarks"))
    a = ap.parse_args(argv)
    src, dst = Path(a.src), Path(a.dst)
    for fn in (lambada, hellaswag, arc, piqa, winogrande, boolq):
        fn(src, dst)
    total = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"wrote {dst} ({total / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
