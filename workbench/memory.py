"""What a configuration needs in memory, from the spec and the non-expert tensors' shapes alone (nothing is
loaded): `python -m workbench info --model DIR --budget B` prints it before a 35B-A3B is ever run.

- resident: the non-expert weights (attention, norms, routers, shared experts, embeddings, head), always in
  memory: as the numpy engine holds them (f32) and in bf16;
- experts: every routed expert, on disk, in each precision a pack can store them in;
- cache: the expert cache at the budget, in the numpy engine's unit (experts dequantized to f32);
- context: KV cache bytes per token (full-attention layers), and the fixed recurrent state of the
  linear-attention layers (Gated DeltaNet: conv and delta-rule state, whatever the context length).
"""
from __future__ import annotations

import math

from workbench.store import quant
from workbench.store.pack import expert_kind

PRECISIONS = ("bf16", "q8", "q4", "q3", "q2")


def memory_needs(spec, tensor_shapes: dict, budget) -> dict:
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    elements = sum(math.prod(s) for s in tensor_shapes.values())
    n_experts = len(spec.moe_layers) * spec.num_experts
    per_expert = {k: sum(quant.encoded_nbytes(shape, expert_kind(shape, k)) for shape in ((ff, d), (ff, d), (d, ff)))
                  for k in PRECISIONS}
    f32_expert = 4 * 3 * d * ff
    full = [i for i in range(spec.num_layers) if not spec.is_linear(i)]
    kv_heads, kv_dim = (1, spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.attention == "mla" else \
        (spec.num_kv_heads, 2 * spec.head_dim)
    linear_state = 0
    if spec.linear:
        L = spec.linear
        channels = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
        linear_state = 4 * (spec.num_layers - len(full)) * (
            (L["conv_kernel"] - 1) * channels + L["num_value_heads"] * L["key_head_dim"] * L["value_head_dim"])
    return {
        "resident_f32_bytes": 4 * elements, "resident_bf16_bytes": 2 * elements,
        "shared_expert_bytes_f32": 4 * 3 * d * spec.shared_expert_size * len(spec.moe_layers),
        "experts": n_experts, "expert_bytes": {k: v * n_experts for k, v in per_expert.items()},
        "cache_bytes": budget.nbytes(f32_expert, n_experts), "cache_budget": budget.text,
        "kv_bytes_per_token": 4 * len(full) * kv_heads * kv_dim,
        "linear_state_bytes": linear_state,
    }


def describe(m: dict) -> str:
    def gib(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    ex = ", ".join(f"{k} {gib(v)}" for k, v in m["expert_bytes"].items())
    return (f"memory: resident non-expert weights {gib(m['resident_f32_bytes'])} f32 ({gib(m['resident_bf16_bytes'])} bf16, "
            f"shared experts included); {m['experts']} experts on disk: {ex}; expert cache at budget "
            f"{m['cache_budget']}: {gib(m['cache_bytes'])} (f32); KV cache {m['kv_bytes_per_token']} bytes per token "
            f"of context; linear-attention state {gib(m['linear_state_bytes'])} (fixed)")
