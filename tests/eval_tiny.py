"""A tiny random Qwen3-MoE checkpoint for the eval tests (tests/test_eval_*.py), made once per process.

vocab 4096 with the demo model's byte-level BPE tokenizer (copied), hidden 64, 2 layers, 8 experts,
top-2, moe_intermediate_size 64, head_dim 16, context 256. Weights are drawn large enough for the
logits and the routing to be far from uniform, and rounded to bf16 (the teacher pack holds them exactly).
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CTX = 256


@lru_cache(maxsize=None)
def tiny_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="wb-eval-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@lru_cache(maxsize=None)
def tiny_model() -> Path:
    import torch
    import transformers as tf
    d = tiny_root() / "tiny-qwen3-moe"
    cfg = tf.Qwen3MoeConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=CTX,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_((torch.randn_like(p) * (0.2 if norm else 0.1) + (1.0 if norm else 0.0)).to(torch.bfloat16).float())
    model.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "data" / "models" / "demo-moe" / f, d / f)
    return d


def cache_dir() -> Path:
    d = tiny_root() / "cache"
    d.mkdir(exist_ok=True)
    return d


def use_tiny(monkeypatch, tmp_path) -> str:
    """Point the pack cache at the shared temporary cache and run records at tmp_path; returns the model dir."""
    model = tiny_model()
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache_dir()))
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    return str(model)


TEXT = (REPO / "data" / "corpora" / "tinystories" / "tinystories_val_head.txt")


def text_file(tmp_path, chars: int = 6000) -> str:
    p = tmp_path / "heldout.txt"
    p.write_text(TEXT.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return str(p)
