"""evals/opencompass/local_data.py: OpenCompass's ARC and PIQA data laid out from the local copies, the same bytes
each time, and read by OpenCompass's own loaders (in its environment, when there is one) as the rows they came from."""
import json
import os
import subprocess

import pytest

from pathlib import Path

from evals.opencompass.local_data import SHARED, build, write
from test_opencompass_model import OC_PYTHON

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """The local copies (../shared/data) where this checkout has them; else the same layout written from the
    repository's own ARC and PIQA rows (data/benchmarks), so the tests run on any clone."""
    if (SHARED / "arc").is_dir():
        return SHARED
    root = tmp_path_factory.mktemp("shared-data")
    for name, folder in (("Easy", "arc_easy"), ("Challenge", "arc_challenge")):
        rows = [json.loads(x) for x in (SHIPPED / folder / "test.jsonl").read_text().splitlines()[:20]]
        raw = [{"id": r["id"], "question": {"stem": r["question"], "choices": [
            {"text": t, "label": lab} for t, lab in zip(r["choices"]["text"], r["choices"]["label"])]},
            "answerKey": r["answerKey"]} for r in rows]
        for split in ("Dev", "Test"):
            out = root / "arc" / f"ARC-{name}" / f"ARC-{name}-{split}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in raw))
    piqa = [json.loads(x) for x in (SHIPPED / "piqa" / "valid.jsonl").read_text().splitlines()[:20]]
    (root / "piqa").mkdir()
    (root / "piqa" / "valid.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "label"}) + "\n" for r in piqa))
    (root / "piqa" / "valid-labels.lst").write_text("".join(f"{r['label']}\n" for r in piqa))
    return root


def test_the_layout_is_deterministic_and_keeps_the_rows(src):
    files = build(src)
    assert files == build(src)
    assert files["data/ARC/ARC-e/ARC-Easy-Dev.jsonl"] == (src / "arc/ARC-Easy/ARC-Easy-Dev.jsonl").read_bytes()
    dev = [json.loads(x) for x in files["data/piqa/dev.jsonl"].decode().splitlines()]
    valid = [json.loads(x) for x in (src / "piqa/valid.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "id"} for r in dev] == valid
    assert len({r["id"] for r in dev}) == len(dev)
    assert files["data/piqa/dev-labels.lst"].decode().split() == (src / "piqa/valid-labels.lst").read_text().split()
    assert b"valid.jsonl" in files["PROVENANCE.txt"]


def test_a_missing_copy_is_named_and_nothing_is_written(tmp_path):
    from workbench.errors import WorkbenchError
    with pytest.raises(WorkbenchError, match="arc/ARC-Easy/ARC-Easy-Dev.jsonl: not found"):
        write(tmp_path / "out", tmp_path)
    assert not (tmp_path / "out").exists()


LOAD = """
import json
from opencompass.datasets import ARCDataset, PIQADataset
arc = ARCDataset.load(path='opencompass/ai2_arc-easy-dev', name='ARC-Easy')
piqa = PIQADataset.load(path='opencompass/piqa')['validation']
print(json.dumps({"arc": [r['answerKey'] for r in arc], "piqa": [r['label'] for r in piqa], "goal": piqa[0]['goal']}))
"""


@pytest.mark.skipif(not OC_PYTHON.exists(), reason=f"no OpenCompass environment at {OC_PYTHON}")
def test_opencompass_reads_them_from_compass_data_cache(tmp_path, src):
    write(tmp_path, src)
    env = {**os.environ, "COMPASS_DATA_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([str(OC_PYTHON), "-c", LOAD], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    arc = [json.loads(x) for x in (src / "arc/ARC-Easy/ARC-Easy-Dev.jsonl").read_text().splitlines()]
    four = [r for r in arc if len(r["question"]["choices"]) == 4]       # OpenCompass keeps the 4-choice items
    assert got["arc"] == ["ABCD"[[c["label"] for c in r["question"]["choices"]].index(r["answerKey"])] for r in four]
    assert got["piqa"] == [int(x) for x in (src / "piqa/valid-labels.lst").read_text().split()]
    assert got["goal"] == json.loads((src / "piqa/valid.jsonl").read_text().splitlines()[0])["goal"]
