"""Tiny random checkpoints of the hybrid linear-attention MoE family, made with transformers' own classes and
save_pretrained: Qwen3-Next, Qwen3.5-MoE (text) and MiniCPM-V 4.7 (its language model a Qwen3.5-MoE text model,
its vision tower tiny too). Four layers: Gated DeltaNet, DeltaNet, DeltaNet, gated full attention (the real
models' full_attention_interval of 4), a shared expert with its sigmoid gate, partial RoPE (a quarter of the head).

As in conftest.make_checkpoint, weights are rounded to bf16 so a bf16 pack holds them exactly. Norm weights are
drawn around 0 here: these models' RMSNorm multiplies by (1 + weight).
"""
from __future__ import annotations

from pathlib import Path

from conftest import tiny_tokenizer

HYBRID = ["qwen3_next", "qwen3_5_moe", "minicpmv4_7"]

TEXT = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, full_attention_interval=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def _model(family: str, **overrides):
    import transformers as tf
    text = {**TEXT, **overrides}
    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text, intermediate_size=96, decoder_sparse_step=1,
                                                          mlp_only_layers=[], norm_topk_prob=True))
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                  image_size=28)
    cfg = tf.MiniCPMV4_7Config(text_config=dict(text, model_type="qwen3_5_moe_text"), vision_config=vision,
                               insert_layer_id=0)
    return tf.MiniCPMV4_7ForConditionalGeneration(cfg)


def make_hybrid(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    import torch
    torch.manual_seed(seed)
    model = _model(family, **overrides).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):          # decays exp(-A * softplus(.)) of a useful size
                p.copy_(torch.empty_like(p).uniform_(0.5, 4).log())
            elif "norm" in name or name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(path / "tokenizer.json")
    return path


def llama_greedy_and_logits(path, prompt, tokens, ids):
    """In llama.cpp, in tests/child.py's child process (this module imports no torch): greedy tokens after `prompt`,
    and the logits of `ids`."""
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=256) as llm:
        theirs = llm.generate(prompt, tokens)["tokens"]
        llm.reset()
        return theirs, llm.forward(ids)
