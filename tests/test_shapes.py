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


def test_a_hugging_face_checkpoint_lays_out_the_routing_as_a_gguf_does(tmp_path):
    """workbench/made_routing.py's layout in the Qwen3-MoE tensors: the embedding carries the token dims and the
    constant 1; each router reads only the routing's dims; layer 0's attention head 0 (the first full-attention
    layer) queries and keys the constant in its window's rotary pairs alone and takes the token dims as values,
    which its output writes into the context dims; the experts' down projections write the next layer's private
    dims at PRIVATE_GAIN."""
    import numpy as np
    from workbench.made_routing import CONTEXT_DIMS, PRIVATE_GAIN, TOKEN_DIMS, Layout
    path = make_model("qwen3-30b-a3b", 2, tmp_path / "m", experts=8)
    m = HFModel(path)
    lay = Layout(m.spec)
    t = lambda n: np.asarray(m.tensor(n), np.float32)
    embed = t("embed")
    assert (embed[:, lay.one] == 1).all() and abs(embed[:, :TOKEN_DIMS].std() - 1) < 0.05
    for i in range(2):
        router = t(f"layers.{i}.router")
        assert (router[:, lay.end:] == 0).all() and (router[:, :TOKEN_DIMS] != 0).all()
        assert (router[:, lay.private(i)] != 0).all() and (router[:, lay.private(1 - i)] == 0).all()
    hd = m.spec.head_dim
    q, k, v, o = (t(f"layers.0.{n}") for n in "qkvo")
    for a in (q, k):
        assert set(np.flatnonzero(a[:hd].any(1))) == set(lay.band.tolist()) and (a[lay.band, lay.one] == 1).all()
    assert (v[:CONTEXT_DIMS, :CONTEXT_DIMS] == np.eye(CONTEXT_DIMS)).all() and not v[CONTEXT_DIMS:hd].any()
    context = slice(lay.context, lay.context + CONTEXT_DIMS)
    assert (o[context, :CONTEXT_DIMS] == np.eye(CONTEXT_DIMS)).all() and not o[lay.private0:, :hd].any()
    assert lay.writer == 0 and t("layers.1.q")[:hd].std() > 0.01         # only the first layer's head is laid out
    down = np.asarray(m.expert(0, 3)["down"], np.float32)
    ratio = down[lay.private(1)].std() / down[lay.end:].std()
    assert abs(ratio / PRIVATE_GAIN - 1) < 0.1
