"""The hybrid linear-attention family as llama.cpp's GGUF: Qwen3-Next as `qwen3next`, Qwen3.5-MoE (and
MiniCPM-V 4.7's language model, a Qwen3.5-MoE) as `qwen35moe`; tensor names and layout as llama.cpp's
convert_hf_to_gguf.py writes Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM.

DeltaNet's q, k, v rows go in `attn_qkv` and its z in `attn_gate`, `ssm_a` = -exp(A_log), `ssm_dt.bias` =
dt_bias, the conv kernel squeezed to (channels, K). qwen3next keeps b and a in one `ssm_ba`, grouped per key
head as Qwen3-Next's checkpoint has them; qwen35moe has `ssm_beta` and `ssm_alpha`, and every value-head axis
(v rows, z, b, a, A, dt, the conv's v channels, out's columns) tiled over the key heads
(spec_hybrid.tile_value_heads). Full attention's q projection keeps its gate rows; the shared expert is
`*_shexp` with its gate `ffn_gate_inp_shexp`; the post-attention norm is `post_attention_norm`. A checkpoint's MTP
block (`mtp.*`) is one more block, with `nextn.*` beside its own (`nextn_predict_layers` 1). Norms arrive
here already as 1 + w (workbench/models/hf.py), as llama.cpp wants them; DeltaNet's own gated norm is plain.
Qwen3.5's interleaved M-RoPE sections split the rotary pairs in three (Qwen3.5's own [11, 11, 10] for 32 pairs):
on text every section sees the same position, so any split that covers every pair is plain RoPE, and llama.cpp
wants the split to fit the head.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from workbench.models.gguf_model import NEXTN
from workbench.models.mtp import has_mtp, load_mtp
from workbench.spec_hybrid import split_fused_projections, tile_value_heads

ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
        "minicpmv4_7": "qwen35moe"}
_F32 = ("ssm_ba.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight")


def linear_tensors(model, i: int) -> dict[str, np.ndarray]:
    """Layer i's DeltaNet tensors as the GGUF holds them, each fused projection split once."""
    s, p = model.spec, f"layers.{i}."
    L = s.linear
    conv = model.tensor(p + "lin_conv")
    out = {"ssm_conv1d.weight": conv.reshape(conv.shape[0], -1), "ssm_a": -np.exp(model.tensor(p + "lin_A_log")),
           "ssm_dt.bias": model.tensor(p + "lin_dt_bias"), "ssm_norm.weight": model.tensor(p + "lin_norm"),
           "ssm_out.weight": model.tensor(p + "lin_out")}
    if s.family == "qwen3_next":      # fused in a Hugging Face checkpoint, apart in a qwen3next GGUF
        fused = p + "lin_qkvz" in model.names()
        w = {p + n: model.tensor(p + n) for n in (("lin_qkvz",) if fused else ("lin_qkv", "lin_z")) + ("lin_ba",)}
        out["ssm_ba.weight"] = w[p + "lin_ba"]
        split_fused_projections(s, w)
        return {"attn_qkv.weight": w[p + "lin_qkv"], "attn_gate.weight": w[p + "lin_z"], **out}
    qk, dv = 2 * L["num_key_heads"] * L["key_head_dim"], L["value_head_dim"]
    qkv = model.tensor(p + "lin_qkv")
    if L.get("value_heads") == "tiled":          # read from a qwen35moe GGUF: in its order already
        return {"attn_qkv.weight": qkv, "attn_gate.weight": model.tensor(p + "lin_z"),
                "ssm_beta.weight": model.tensor(p + "lin_b"), "ssm_alpha.weight": model.tensor(p + "lin_a"), **out}
    return {"attn_qkv.weight": np.concatenate([qkv[:qk], tile_value_heads(s, qkv[qk:], 0, dv)]),
            "attn_gate.weight": tile_value_heads(s, model.tensor(p + "lin_z"), 0, dv),
            "ssm_beta.weight": tile_value_heads(s, model.tensor(p + "lin_b"), 0, 1),
            "ssm_alpha.weight": tile_value_heads(s, model.tensor(p + "lin_a"), 0, 1),
            "ssm_conv1d.weight": np.concatenate([out["ssm_conv1d.weight"][:qk],
                                                 tile_value_heads(s, out["ssm_conv1d.weight"][qk:], 0, dv)]),
            "ssm_a": tile_value_heads(s, out["ssm_a"], 0, 1),
            "ssm_dt.bias": tile_value_heads(s, out["ssm_dt.bias"], 0, 1),
            "ssm_norm.weight": out["ssm_norm.weight"],
            "ssm_out.weight": tile_value_heads(s, out["ssm_out.weight"], 1, dv)}


def hybrid_plan(model, add, add_array, mat_type):
    """Calls add(gguf name, canonical name, f32) and add_array(gguf name, shape, type, producer) in file order."""
    s = model.spec
    L = s.linear
    d, ff, E = s.hidden_size, s.moe_intermediate_size, s.num_experts
    C = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
    V, hv = L["num_value_heads"] * L["value_head_dim"], L["num_value_heads"]
    shapes = {"attn_qkv.weight": (C, d), "attn_gate.weight": (V, d),
              **({"ssm_ba.weight": (2 * hv, d)} if s.family == "qwen3_next" else
                 {"ssm_beta.weight": (hv, d), "ssm_alpha.weight": (hv, d)}),
              "ssm_conv1d.weight": (C, L["conv_kernel"]), "ssm_a": (hv,), "ssm_dt.bias": (hv,),
              "ssm_norm.weight": (L["value_head_dim"],), "ssm_out.weight": (d, V)}
    current = {}                # the layer being written: its tensors are built once, then dropped

    def layer(i):
        if i not in current:
            current.clear()
            current[i] = linear_tensors(model, i)
        return current[i]

    add("token_embd.weight", "embed")
    for i in range(s.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "attn_norm", True)
        if s.is_linear(i):
            for name, shape in shapes.items():
                t = "F32" if len(shape) == 1 or name in _F32 else mat_type(shape)
                add_array(b + name, shape, t, lambda i=i, name=name: layer(i)[name])
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
    if mtp := mtp_block(model):
        mtp_plan(s, mtp, add_array, mat_type)
    add("output_norm.weight", "norm", True)


def mtp_block(model) -> dict[str, np.ndarray] | None:
    """A Hugging Face checkpoint's MTP block (its norms as 1 + w), or None where it has none."""
    path = Path(getattr(model, "path", ""))
    return load_mtp(path, zero_centred=True) if path.is_dir() and has_mtp(path) else None


def mtp_plan(s, mtp: dict, add_array, mat_type):
    """The MTP block as llama.cpp's converter writes it: block num_layers, a full-attention block's tensors plus
    nextn's (workbench.models.gguf_model.NEXTN, read back by the same names); norms, the router and the shared
    expert's gate f32, as the main blocks'."""
    b = f"blk.{s.num_layers}."
    for gname, name in NEXTN.items():
        if name is None:
            continue
        if "{}" in name:
            shape = (s.num_experts, *mtp[name.format(0)].shape)
            add_array(b + gname, shape, mat_type(shape),
                      lambda name=name: np.stack([mtp[name.format(e)] for e in range(s.num_experts)]))
            continue
        a = mtp[name].reshape(-1) if name.endswith("shared_expert_gate.weight") else mtp[name]
        f32 = a.ndim == 1 or name.endswith("mlp.gate.weight")
        add_array(b + gname, a.shape, "F32" if f32 else mat_type(a.shape), lambda a=a: a)


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
    if ARCH[s.family] == "qwen35moe":
        n = s.rope_dim // 2
        w.add_rope_dimension_sections([-(-n // 3), -(-(n - 1) // 3), n - -(-n // 3) - -(-(n - 1) // 3), 0])
