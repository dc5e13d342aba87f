"""llama.cpp's `qwen3next` and `qwen35moe` GGUFs read back into the workbench's Qwen3-Next and Qwen3.5-MoE (the
inverse of engines/gguf_export_hybrid.py). qwen3next: `attn_qkv` and `attn_gate` are already the decoder's lin_qkv
and lin_z (the split that spec_hybrid.split_fused_projections makes of in_proj_qkvz), so they stay in their GGUF
blocks and ggml computes them; `ssm_ba` is in_proj_ba as it is. qwen35moe: q, k, v, z, b, a apart as Qwen3.5
keeps them, every value-head axis in llama.cpp's order, tiled over the key heads (spec.linear["value_heads"] =
"tiled": spec_hybrid.tile_value_heads). Both: A_log = log(-ssm_a), the conv kernel as (channels, 1, K); the
post-attention norm is the MoE block's input norm. Norms are stored as 1 + w, as the workbench holds them. A
qwen35moe GGUF imports as family qwen3_5_moe (MiniCPM-V 4.7's language model too)."""
from __future__ import annotations

import numpy as np


_COMMON = {"post_attention_norm.weight": "mlp_norm", "ssm_conv1d.weight": "lin_conv", "ssm_a": "lin_A_log",
           "ssm_dt.bias": "lin_dt_bias", "ssm_norm.weight": "lin_norm", "ssm_out.weight": "lin_out"}
BLOCKS = {  # GGUF block tensor -> canonical
    "qwen3next": {**_COMMON, "attn_qkv.weight": "lin_qkv", "attn_gate.weight": "lin_z", "ssm_ba.weight": "lin_ba"},
    "qwen35moe": {**_COMMON, "attn_qkv.weight": "lin_qkv", "attn_gate.weight": "lin_z", "ssm_beta.weight": "lin_b",
                  "ssm_alpha.weight": "lin_a"},
}


def hybrid_gguf_spec(common: dict, meta, shared_ff: int, tiled: bool = False):
    from workbench.spec import MoESpec
    n = common["num_layers"]
    interval = int(meta("{arch}.full_attention_interval", 4))
    value_heads = int(meta("{arch}.ssm.time_step_rank"))
    return MoESpec(**common, norm_topk_prob=True, qk_norm="head", shared_expert_size=shared_ff,
                   shared_expert_gate=True, attn_output_gate=True,
                   rotary_dim=int(meta("{arch}.rope.dimension_count", common["head_dim"])),
                   layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
                   linear=dict(num_key_heads=int(meta("{arch}.ssm.group_count")), num_value_heads=value_heads,
                               key_head_dim=int(meta("{arch}.ssm.state_size")),
                               value_head_dim=int(meta("{arch}.ssm.inner_size")) // value_heads,
                               conv_kernel=int(meta("{arch}.ssm.conv_kernel")),
                               **({"value_heads": "tiled"} if tiled else {})))


def hybrid_derived(g) -> dict:
    """{canonical name: () -> f32 array} for the tensors that are not one GGUF tensor as it is: the decay (A_log =
    log(-ssm_a)) and the conv kernel's shape. A qwen35moe file keeps its value heads tiled over the key heads
    (spec.linear["value_heads"] "tiled"): the decoder broadcasts q and k to match, so no matrix is regrouped."""
    s, out = g.spec, {}

    def read(name):
        return g._dequantized(g.where[name])

    for i in range(s.num_layers):
        if s.is_linear(i):
            p = f"layers.{i}."
            out[p + "lin_conv"] = lambda p=p: read(p + "lin_conv")[:, None, :]
            out[p + "lin_A_log"] = lambda p=p: np.log(-read(p + "lin_A_log"))
    return out
