"""llama.cpp's `qwen3next` GGUF read back into the workbench's Qwen3-Next (the inverse of
engines/gguf_export_hybrid.py): `attn_qkv` + `attn_gate` regrouped per key head into in_proj_qkvz's layout,
A_log = log(-ssm_a), the conv kernel as (channels, 1, K); the post-attention norm is the MoE block's input norm.
Norms are stored as 1 + w, as the workbench holds them."""
from __future__ import annotations

import numpy as np

QWEN3NEXT_BLOCK = {  # GGUF block tensor -> canonical (None: read with another tensor)
    "post_attention_norm.weight": "mlp_norm", "attn_qkv.weight": "lin_qkvz", "attn_gate.weight": None,
    "ssm_ba.weight": "lin_ba", "ssm_conv1d.weight": "lin_conv", "ssm_a": "lin_A_log", "ssm_dt.bias": "lin_dt_bias",
    "ssm_norm.weight": "lin_norm", "ssm_out.weight": "lin_out",
}


def qwen3next_spec(common: dict, meta, shared_ff: int):
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
                               conv_kernel=int(meta("{arch}.ssm.conv_kernel"))))


def qwen3next_derived(g) -> dict:
    """{canonical name: () -> f32 array} for the tensors that are not one GGUF tensor as it is."""
    s, out = g.spec, {}
    L = s.linear
    hk, dk, r, dv = L["num_key_heads"], L["key_head_dim"], L["num_value_heads"] // L["num_key_heads"], L["value_head_dim"]

    def qkvz(i):
        qkv, z = g._dequantized(g.where[f"layers.{i}.lin_qkvz"]), g._dequantized(f"blk.{i}.attn_gate.weight")
        q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
        grouped = [a.reshape(hk, -1, a.shape[-1]) for a in (q, k, v, z)]
        return np.concatenate(grouped, 1).reshape(-1, qkv.shape[-1])

    for i in range(s.num_layers):
        if s.is_linear(i):
            p = f"layers.{i}."
            out[p + "lin_qkvz"] = lambda i=i: qkvz(i)
            out[p + "lin_conv"] = lambda p=p: g._dequantized(g.where[p + "lin_conv"])[:, None, :]
            out[p + "lin_A_log"] = lambda p=p: np.log(-g._dequantized(g.where[p + "lin_A_log"]))
    return out
