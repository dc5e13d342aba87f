"""The hybrid linear-attention MoE family: Qwen3-Next, Qwen3.5-MoE and MiniCPM-V 4.7's language model.

Most layers are Gated DeltaNet linear attention (a recurrent state per value head and a short causal
convolution instead of a KV cache); every `full_attention_interval`-th layer is full attention whose q projection
also carries a sigmoid output gate, with RoPE on a part of each head; norms are zero-centred (the checkpoint
holds w, the model multiplies by 1 + w: the loader adds the 1); every MoE block has a shared expert with its own
sigmoid gate. Multi-token-prediction heads (`mtp.*`) are loaded by nobody: the workbench decodes one token a
step and its speculative path drafts by prompt lookup, so they are ignored. MiniCPM-V 4.7's vision tower and
merger are skipped: the workbench runs its language model on text.

Text-only positions are the same on each of Qwen3.5's three M-RoPE grids, so its interleaved M-RoPE is plain
RoPE here.
"""
from __future__ import annotations

import numpy as np

HYBRID = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "minicpmv4_7")

# qwen3_next fuses the projections per key-head group (q, k, v, z | b, a); Qwen3.5 keeps them apart
_LINEAR = {"qwen3_next": ("lin_qkvz", "lin_ba")}
_LINEAR_COMMON = ("lin_conv", "lin_A_log", "lin_dt_bias", "lin_norm", "lin_out")


CHECKPOINT_WINDOW = 32             # a decode call's positions whose linear-attention state is kept, at most


def linear_state_bytes(spec) -> int:
    """One position's linear-attention state over every DeltaNet layer: the conv's last inputs and the delta-rule
    matrices (f32)."""
    if not spec.linear:
        return 0
    L = spec.linear
    channels = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
    per_layer = 4 * ((L["conv_kernel"] - 1) * channels + L["num_value_heads"] * L["key_head_dim"] * L["value_head_dim"])
    return per_layer * sum(map(spec.is_linear, range(spec.num_layers)))


def linear_attention_names(family: str) -> tuple[str, ...]:
    return _LINEAR.get(family, ("lin_qkv", "lin_z", "lin_b", "lin_a")) + _LINEAR_COMMON


def language_config(cfg: dict) -> dict:
    """The text model's config: Qwen3.5-MoE's and MiniCPM-V 4.7's `text_config` (which must be a MoE one)."""
    if "text_config" not in cfg:
        return cfg
    text = cfg["text_config"]
    if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise ValueError(f"text_config model_type {text.get('model_type')!r} is not a MoE language model "
                         f"(qwen3_5_moe_text)")
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
                                       else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types {types!r}: want {n} of linear_attention / full_attention")
    return list(types)


def hybrid_spec(cfg: dict, common: dict, spec_cls):
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    step = cfg.get("decoder_sparse_step", 1)
    dense = [i for i in range(common["num_layers"]) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step != 0]
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias true is not supported for this family")
    return spec_cls(
        **common, num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", True) if common["family"] == "qwen3_next" else True,
        qk_norm="head", shared_expert_size=cfg["shared_expert_intermediate_size"], shared_expert_gate=True,
        dense_layers=dense, dense_intermediate_size=cfg.get("intermediate_size", 0),
        rotary_dim=int(common["head_dim"] * partial), attn_output_gate=True, layer_types=layer_types(cfg),
        linear=dict(num_key_heads=cfg["linear_num_key_heads"], num_value_heads=cfg["linear_num_value_heads"],
                    key_head_dim=cfg["linear_key_head_dim"], value_head_dim=cfg["linear_value_head_dim"],
                    conv_kernel=cfg["linear_conv_kernel_dim"]))


def split_fused_projections(spec, w: dict):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped per key head: q, k, v, z | b, a) in Qwen3.5's separate
    layout (all q heads, all k heads, all v heads | z | b | a), so that one layer serves both."""
    L = spec.linear
    hk, dk, dv, r = L["num_key_heads"], L["key_head_dim"], L["value_head_dim"], L["num_value_heads"] // L["num_key_heads"]
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        if p + "lin_qkvz" in w:         # Hugging Face's fusion; a qwen3next GGUF holds them apart
            g = np.asarray(w.pop(p + "lin_qkvz")).reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            w[p + "lin_qkv"] = np.concatenate([a.reshape(-1, a.shape[-1]) for a in (q, k, v)])
            w[p + "lin_z"] = z.reshape(-1, z.shape[-1])
        if p + "lin_ba" in w:
            b, a = np.split(np.asarray(w.pop(p + "lin_ba")).reshape(hk, 2 * r, -1), 2, axis=1)
            w[p + "lin_b"], w[p + "lin_a"] = b.reshape(-1, b.shape[-1]), a.reshape(-1, a.shape[-1])


def tile_value_heads(spec, a, axis: int, dim: int, back: bool = False):
    """Qwen3.5's value heads along `axis` (each `dim` wide) from Hugging Face's order, grouped by the key head
    they share (k0: v0 v1, k1: v0 v1), to llama.cpp's qwen35moe order, tiled over the key heads (v0: k0 k1,
    v1: k0 k1), which its broadcast over key heads needs; back=True is the inverse."""
    L = spec.linear
    hk, r = L["num_key_heads"], L["num_value_heads"] // L["num_key_heads"]
    a = np.moveaxis(a, axis, 0)
    groups = (r, hk) if back else (hk, r)
    out = a.reshape(*groups, dim, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(out, 0, axis)
