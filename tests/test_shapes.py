"""make-model: a random-weight checkpoint with a real model's expert shape, labelled random wherever it goes."""
from __future__ import annotations

import json

import pytest

from cli import main
from workbench.models.hf import HFModel
from workbench.shapes import SHAPES, make_model
from workbench.errors import WorkbenchError


def test_every_shape_cites_its_source_and_keeps_the_published_expert_size():
    assert set(SHAPES) == {"qwen3-30b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b", "minicpm-v-4.7"}
    assert (SHAPES["qwen3-30b-a3b"]["hidden_size"], SHAPES["qwen3-30b-a3b"]["moe_intermediate_size"]) == (2048, 768)
    assert SHAPES["qwen3-next-80b-a3b"]["num_experts"] == 512 and SHAPES["qwen3-next-80b-a3b"]["num_experts_per_tok"] == 10
    for s in SHAPES.values():
        assert "transformers" in s["source"] or "CookBook" in s["source"]


def test_make_model_writes_a_checkpoint_the_workbench_reads_at_the_real_expert_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    out = make_model("qwen3-30b-a3b", layers=1, out=tmp_path / "m", experts=16)
    m = HFModel(out)
    assert (m.spec.hidden_size, m.spec.moe_intermediate_size, m.spec.top_k, m.spec.num_experts) == (2048, 768, 8, 16)
    assert m.expert(0, 15)["down"].shape == (2048, 768)
    card = json.loads((out / "random_weights.json").read_text())
    assert card["random_weights"] and "RANDOM" in card["label"] and "16 of 128 experts" in " ".join(card["notes"])
    from runtime.session import open_session
    with open_session(str(out), "on_demand", budget="0.5") as s:
        s.generate([1, 2, 3], tokens=2)
        assert "RANDOM" in s.summary()["random_weights"] and "RANDOM" in s.config()["random_weights"]


def test_hybrid_shapes_say_what_is_not_the_real_model(tmp_path):
    out = make_model("qwen3-next-80b-a3b", layers=1, out=tmp_path / "n", experts=10)
    notes = " ".join(json.loads((out / "random_weights.json").read_text())["notes"])
    assert "Gated DeltaNet" in notes and "no shared expert" in notes
    assert "RANDOM" in (out / "MODEL_CARD.md").read_text()


def test_bad_requests_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(WorkbenchError, match="--layers 99"):
        make_model("qwen3-30b-a3b", layers=99, out=tmp_path / "x")
    assert main(["make-model", "--shape", "qwen3-30b-a3b", "--layers", "1", "--experts", "4",
                 "--out", str(tmp_path / "y")]) == 2
    assert "--experts 4" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_the_default_place_and_size_of_a_checkpoint(tmp_path, monkeypatch, capsys):
    from workbench.shapes import checkpoint_bytes, checkpoint_path
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    assert main(["make-model", "--shape", "qwen3-30b-a3b", "--layers", "1", "--experts", "8"]) == 0
    out = checkpoint_path("qwen3-30b-a3b", 1, 8)
    assert out == tmp_path / "cache" / "models" / "qwen3-30b-a3b-1L-8E-random" and str(out) in capsys.readouterr().out
    tensors = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert 0 <= tensors - checkpoint_bytes("qwen3-30b-a3b", 1, 8) < 2 ** 16, "safetensors headers only"


def test_no_room_on_disk_is_a_one_line_refusal_before_anything_is_written(tmp_path, monkeypatch):
    import workbench.shapes as shapes
    monkeypatch.setattr(shapes, "free_bytes", lambda path: 10 ** 6)
    with pytest.raises(WorkbenchError, match=r"needs 0\.\d+ GB, the disk has 0\.00 GB free"):
        make_model("qwen3-30b-a3b", layers=1, out=tmp_path / "z", experts=8)
    assert not list(tmp_path.iterdir())
