"""A bf16 Hugging Face directory streams as it lies where the run keeps its precision: nothing is written but an
index (workbench/store/safetensors_index.py), for the teacher (bf16 experts and rest) and for any design at
`experts=raw` (`--set experts=raw`: the checkpoint's own bytes). The checkpoints are the demo and a tiny Qwen3-MoE
saved in bf16 by transformers' own save_pretrained (experts fused, gate_up_proj, as transformers 5 writes them).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from workbench.models.hf import HFModel
from workbench.registry import MODELS

IDS = [5, 17, 200, 31, 64, 99, 150, 3, 250, 12, 77, 42]


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory) -> Path:
    import torch
    from conftest import TINY, _configs, tiny_tokenizer
    cfg_cls, model_cls, extra = _configs()["qwen3_moe"]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**TINY, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp("bf16") / "qwen3_moe"
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(path / "tokenizer.json")
    return path


def files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_on_demand_at_its_own_bf16_writes_nothing_but_an_index(which, bf16_tiny, tmp_path, monkeypatch):
    """The experts stream from the safetensors file (O_DIRECT, from the 4 KiB boundary before each part) and give
    the logits of the bf16 pack convert would write, bit for bit, on the packed and numpy engines."""
    from runtime.session import open_session
    model = str(MODELS["demo"] if which == "demo" else bf16_tiny)
    assert set(HFModel(model).expert_kinds(0).values()) == {"bf16"}
    ids = IDS if which == "tiny" else [3, 40, 900, 7, 1000, 22]
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    got = {}
    for engine in ("packed", "numpy"):
        with open_session(model, "on_demand", budget="0.25", engine=engine, experts="raw") as s:
            assert s.pack.data_paths == [(Path(model) / "model.safetensors").resolve()] and s.reader.mode == "o_direct"
            got[engine] = np.asarray(s.step(ids, "prefill"))
    made = files(tmp_path / "cache")
    assert [f for f in made if f.startswith("packs")] == [f for f in made if f.endswith(".index")] != [], made
    assert sum(made.values()) < 2**20, made
    for engine in ("packed", "numpy"):
        with open_session(model, "on_demand", budget="0.25", engine=engine, experts="bf16", rest="bf16") as s:
            assert s.pack.data_paths == [s.pack.path]                  # the pack: a copy, for comparison
            assert np.array_equal(np.asarray(s.step(ids, "prefill")), got[engine]), engine


def test_the_teacher_keeps_a_bf16_checkpoint_in_place_and_an_f32_one_in_a_pack(bf16_tiny, tiny_models, tmp_path,
                                                                               monkeypatch):
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    with open_session(str(bf16_tiny), "teacher") as s:
        assert s.pack.path.suffix == ".index" and s.preset.storage.experts == "raw"
    with open_session(str(tiny_models["qwen3_moe"]), "teacher") as s:        # saved f32: bf16 is another precision
        assert s.pack.path.suffix == ".pack" and s.preset.storage.experts == "bf16"


def test_transformers_shards_of_fused_experts_stream_with_the_one_files_logits(bf16_tiny, tmp_path, monkeypatch):
    """The tiny model saved again by save_pretrained in shards (gate_up_proj and down_proj of a layer in different
    ones): at experts=raw, the logits of the one file bit for bit, on the packed and numpy engines
    (tests/test_shards_in_place.py: the demo's nine shards)."""
    import torch
    import transformers as tf
    from runtime.session import open_session
    d = tmp_path / "sharded"
    tf.Qwen3MoeForCausalLM.from_pretrained(bf16_tiny, dtype=torch.bfloat16).save_pretrained(d, max_shard_size="100KB")
    shutil.copy(bf16_tiny / "tokenizer.json", d / "tokenizer.json")
    m = HFModel(d)
    assert len(m.shards) > 2 and any(m.experts[(L, 0, "gate")][0] is not m.experts[(L, 0, "down")][0]
                                     for L in m.spec.moe_layers)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for engine in ("packed", "numpy"):
        got = []
        for model in (bf16_tiny, d):
            with open_session(str(model), "on_demand", budget="0.25", engine=engine, experts="raw") as s:
                assert s.pack.path.suffix == ".index"
                got.append(np.asarray(s.step(IDS, "prefill")))
        assert np.array_equal(*got), engine


def test_a_teacher_bigger_than_memory_streams_from_its_file_with_the_same_numbers(tmp_path, monkeypatch):
    """eval teacher runs the teacher first and alone (its log-probs kept per window), at --teacher-budget: streamed
    from the bf16 safetensors through its index, its log-probs are the resident teacher's bit for bit, and so is
    the comparison."""
    from evals.teacher import run
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    kw = dict(data="tinystories", n_ctx=64, chunks=2, progress=False, record=False)
    resident = run("demo", "les", "0.25", **kw)
    streamed = run("demo", "les", "0.25", teacher_budget="0.1", **kw)
    for k in ("kl", "top1", "ppl", "ppl_teacher", "routing_agreement"):
        assert streamed[k] == resident[k], k
    assert list((tmp_path / "cache").rglob("demo-moe*.index"))                # the teacher's: an index, no pack
