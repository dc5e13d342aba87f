"""Shared fixtures: tiny random checkpoints made with transformers' own classes and save_pretrained.

Weights are rounded to bf16 before saving, so a bf16 pack holds them exactly and our engine
can be compared with transformers (fp32) element-wise.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def tiny_tokenizer(path: Path) -> Path:
    """A byte-level BPE of 320 tokens trained on a little TinyStories text (the tiny models' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (REPO / "data/corpora/tinystories/tinystories_train_sample_2MiB.txt").read_text()[:100_000]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(str(path))
    return path

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _configs():
    import transformers as tf
    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                           norm_topk_prob=True)),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                           shared_expert_intermediate_size=128, norm_topk_prob=False)),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=False)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                    dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)),
        "dots1": (tf.Dots1Config, tf.Dots1ForCausalLM,
                  dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                       n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                       routed_scaling_factor=2.5, num_hidden_layers=3)),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, dict(MLA, q_lora_rank=32,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, num_hidden_layers=3)),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(MLA, q_lora_rank=None,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                        n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        first_k_dense_replace=1, routed_scaling_factor=1.5, num_hidden_layers=3)),
    }


# latent attention: every query head has its own keys, decompressed from one cached latent
MLA = dict(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

YARN = {  # DeepSeek-V3's and V2-Lite's rope settings with a context the tiny models reach
    "deepseek_v3": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=8,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    "deepseek_v2": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=8,
                        beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    "qwen3_moe": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8),
}

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "dots1", "deepseek_v3", "deepseek_v2"]


def make_checkpoint(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    cfg_cls, model_cls, extra = _configs()[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0.0))
                    .to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:   # make the selection-only bias matter
                b.copy_((torch.randn_like(b) * 0.05).to(torch.bfloat16).float())
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{family: checkpoint dir}, made once per test session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {f: make_checkpoint(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    """{family: checkpoint dir} of the hybrid linear-attention family (hybrid_fixtures.py), made once per session."""
    from hybrid_fixtures import HYBRID, make_hybrid
    root = tmp_path_factory.mktemp("hybrid-models")
    return {f: make_hybrid(f, root / f) for f in HYBRID}


def pytest_generate_tests(metafunc):
    """A test marked `macos` runs twice, its `surface` "linux" and "macos": as it is, and on the macOS surface
    (tests/macos_surface.py), put on before the test's other function-scoped fixtures (_macos_surface)."""
    if metafunc.definition.get_closest_marker("macos"):
        if "surface" not in metafunc.fixturenames:
            metafunc.fixturenames.append("surface")
        metafunc.parametrize("surface", ["linux", "macos"])


@pytest.fixture(autouse=True)
def _macos_surface(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("surface") != "macos":
        yield
        return
    import macos_surface
    take_off = macos_surface.apply()
    try:
        yield
    finally:
        take_off()


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Packs, probes and run records of the tests go to a temporary place, not the user's."""
    root = tmp_path_factory.mktemp("wb-cache")
    old = {k: os.environ.get(k) for k in ("WORKBENCH_CACHE", "WORKBENCH_RUNS")}
    os.environ["WORKBENCH_CACHE"] = str(root / "cache")
    os.environ["WORKBENCH_RUNS"] = str(root / "runs")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture()
def fast_probe(monkeypatch):
    """A disk probe of a few points, so tests that compute the floor don't spend seconds probing."""
    import workbench.disk_probe as disk_probe
    real = disk_probe.probe_disk
    monkeypatch.setattr(disk_probe, "probe_disk", lambda path, seconds_per_point=0.3, **kw:
                        real(path, sizes=(65536, 262144), depths=(1,), seconds_per_point=0.05))


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def greedy_ids(logits: np.ndarray) -> list[int]:
    return np.argmax(logits, -1).tolist()
