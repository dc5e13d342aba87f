"""OpenCompass's own ARC and PIQA datasets from the local copies in ../shared/data, laid out as its data release is
(`opencompass/utils/datasets_info.py`: `opencompass/ai2_arc-easy-dev` -> `./data/ARC/ARC-e/ARC-Easy-Dev.jsonl`, ...):

    python -m evals.opencompass.local_data OUT [--src ../shared/data]
    COMPASS_DATA_CACHE=OUT opencompass CONFIG    # CONFIG reads ARC_e_ppl, ARC_c_ppl, piqa_ppl with read_base()

OpenCompass's `get_data_path` looks under $COMPASS_DATA_CACHE before it would download. The ARC files are copied
byte for byte (AI2's jsonl, which OpenCompass's ARCDataset reads). PIQA is converted: OpenCompass's PIQADataset
reads `dev.jsonl` + `dev-labels.lst` and `train.jsonl` + `train-labels.lst`, and deletes an `id` field from each
row; the local copy is the validation split without `id`s and without the training rows. So `dev.jsonl` is
`valid.jsonl` with `"id": "valid-<line>"` added to each row, `dev-labels.lst` is `valid-labels.lst`, and the
training files are empty (the zero-shot `piqa_ppl` config never reads them). OUT/PROVENANCE.txt lists every file
with its source and both sha256s.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"

COPIES = {      # OpenCompass's path under OUT: the local copy under --src
    "data/ARC/ARC-e/ARC-Easy-Dev.jsonl": "arc/ARC-Easy/ARC-Easy-Dev.jsonl",
    "data/ARC/ARC-e/ARC-Easy-Test.jsonl": "arc/ARC-Easy/ARC-Easy-Test.jsonl",
    "data/ARC/ARC-c/ARC-Challenge-Dev.jsonl": "arc/ARC-Challenge/ARC-Challenge-Dev.jsonl",
    "data/ARC/ARC-c/ARC-Challenge-Test.jsonl": "arc/ARC-Challenge/ARC-Challenge-Test.jsonl",
    "data/piqa/dev-labels.lst": "piqa/valid-labels.lst",
}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _piqa_dev(valid: bytes) -> bytes:
    rows = [json.loads(line) for line in valid.decode().splitlines() if line.strip()]
    return "".join(json.dumps({**r, "id": f"valid-{i}"}, ensure_ascii=False) + "\n" for i, r in enumerate(rows)).encode()


def build(src: Path = SHARED) -> dict[str, bytes]:
    """{path under OUT: bytes}, every source read before anything is written."""
    def read(rel):
        p = Path(src) / rel
        if not p.is_file():
            raise WorkbenchError(f"{p}: not found (the local copy OpenCompass's {rel.split('/')[0]} is made from)")
        return p.read_bytes()
    files, notes = {}, []
    for dst, rel in COPIES.items():
        files[dst] = read(rel)
        notes.append(f"{dst}: copy of {rel} (sha256 {_sha(files[dst])})")
    valid = read("piqa/valid.jsonl")
    files["data/piqa/dev.jsonl"] = _piqa_dev(valid)
    notes.append(f"data/piqa/dev.jsonl: piqa/valid.jsonl (sha256 {_sha(valid)}) with \"id\": \"valid-<line>\" added "
                 f"to each row, which PIQADataset deletes (sha256 {_sha(files['data/piqa/dev.jsonl'])})")
    files["data/piqa/train.jsonl"] = files["data/piqa/train-labels.lst"] = b""
    notes.append("data/piqa/train.jsonl, data/piqa/train-labels.lst: empty (no PIQA training rows on this machine; "
                 "the zero-shot configs never read them)")
    files["PROVENANCE.txt"] = ("Made by `python -m evals.opencompass.local_data` (moe-workbench) from the local copies "
                               f"in {Path(src).resolve()} (each folder's SOURCE.txt says where they come from).\n\n"
                               + "\n".join(notes) + "\n").encode()
    return files


def write(out: Path, src: Path = SHARED) -> list[Path]:
    files = build(src)
    for rel, data in files.items():
        atomic_write(Path(out) / rel, data)
    return [Path(out) / rel for rel in files]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.opencompass.local_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder to set COMPASS_DATA_CACHE to")
    ap.add_argument("--src", default=str(SHARED), help="the local copies (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        write(Path(a.out), Path(a.src))
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(a.out) / "PROVENANCE.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
