"""The hybrid linear-attention family as llama.cpp's `qwen3next` GGUF (tensor names and layout as llama.cpp's
convert_hf_to_gguf.py writes Qwen3NextForCausalLM): DeltaNet's q, k, v rows as `attn_qkv` and its z as
`attn_gate`, the grouped b/a projection as `ssm_ba`, `ssm_a` = -exp(A_log), `ssm_dt.bias` = dt_bias, the conv
kernel squeezed to (channels, K); full attention's q projection keeps its gate rows; the shared expert as
`*_shexp` with its gate `ffn_gate_inp_shexp`; the post-attention norm as `post_attention_norm`. Norms arrive here
already as 1 + w (workbench/models/hf.py), as llama.cpp wants them; DeltaNet's own gated norm is plain.
"""
from __future__ import annotations

import numpy as np

from workbench.spec_hybrid import split_fused_projections


def hybrid_plan(model, add, add_array, mat_type):
    """Calls add(gguf name, canonical name, f32) and add_array(gguf name, shape, type, producer) in file order."""
    s = model.spec
    L = s.linear
    d, ff, E = s.hidden_size, s.moe_intermediate_size, s.num_experts
    add("token_embd.weight", "embed")
    for i in range(s.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "attn_norm", True)
        if s.is_linear(i):
            def split(i=i):
                w = {f"layers.{i}.lin_qkvz": model.tensor(f"layers.{i}.lin_qkvz"),
                     f"layers.{i}.lin_ba": model.tensor(f"layers.{i}.lin_ba")}
                split_fused_projections(s, w)
                return w
            C = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
            V = L["num_value_heads"] * L["value_head_dim"]
            add_array(b + "attn_qkv.weight", (C, d), mat_type((C, d)), lambda i=i, f=split: f(i)[f"layers.{i}.lin_qkv"])
            add_array(b + "attn_gate.weight", (V, d), mat_type((V, d)), lambda i=i, f=split: f(i)[f"layers.{i}.lin_z"])
            add(b + "ssm_ba.weight", p + "lin_ba", True)
            add_array(b + "ssm_conv1d.weight", (C, L["conv_kernel"]), "F32",
                      lambda p=p: model.tensor(p + "lin_conv").reshape(C, -1))
            add_array(b + "ssm_a", (L["num_value_heads"],), "F32", lambda p=p: -np.exp(model.tensor(p + "lin_A_log")))
            add(b + "ssm_dt.bias", p + "lin_dt_bias", True)
            add(b + "ssm_norm.weight", p + "lin_norm", True)
            add(b + "ssm_out.weight", p + "lin_out")
        else:
            for c, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                add(b + g + ".weight", p + c)
            add(b + "attn_q_norm.weight", p + "q_norm", True)
            add(b + "attn_k_norm.weight", p + "k_norm", True)
        add(b + "post_attention_norm.weight", p + "mlp_norm", True)
        add(b + "ffn_gate_inp.weight", p + "router", True)
        for part, shape in (("gate", (E, ff, d)), ("up", (E, ff, d)), ("down", (E, d, ff))):
            add_array(b + f"ffn_{part}_exps.weight", shape, mat_type(shape),
                      lambda i=i, part=part: np.stack([model.expert(i, e)[part] for e in range(E)]))
        for part in ("gate", "up", "down"):
            add(b + f"ffn_{part}_shexp.weight", p + f"shared.{part}")
        add(b + "ffn_gate_inp_shexp.weight", p + "shared_gate", True)
    add("output_norm.weight", "norm", True)


def hybrid_metadata(w, s):
    L = s.linear
    w.add_expert_shared_feed_forward_length(s.shared_expert_size)
    w.add_ssm_conv_kernel(L["conv_kernel"])
    w.add_ssm_state_size(L["key_head_dim"])
    w.add_ssm_group_count(L["num_key_heads"])
    w.add_ssm_time_step_rank(L["num_value_heads"])
    w.add_ssm_inner_size(L["value_head_dim"] * L["num_value_heads"])
    w.add_full_attention_interval(s.layer_types.index("full_attention") + 1)
    w.add_rope_dimension_count(s.rope_dim)
