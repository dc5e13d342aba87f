"""What a configuration needs in memory, from the spec and the non-expert tensors' shapes alone (nothing is
loaded), and the guard that refuses one that cannot fit before anything is loaded, instead of the OOM killer
mid-run. `python -m workbench info --model DIR --budget B` prints the same numbers the guard refuses with.

- resident: the non-expert weights (attention, norms, routers, shared experts, embeddings, head), always in
  memory: as the engine holds them (the packed engine: its encoded matrices), in f32 and in bf16;
- experts: every routed expert, on disk, in each precision a pack can store them in;
- cache: the expert cache at the budget: the slots it buys (Budget.slots) of what one expert costs in the engine's
  cache (engines.expert_bytes: the packed engine's slot of packed bytes, numpy's f32 expert), as the Session sizes it;
- context: KV cache bytes per token (full-attention layers), and the fixed recurrent state of the
  linear-attention layers (Gated DeltaNet: conv and delta-rule state, whatever the context length);
- needed: resident (as held) + the cache, at most every expert; available: what the system says this process can
  still take (workbench/host.py: Linux's MemAvailable capped by the cgroup, macOS's free and inactive pages).
"""
from __future__ import annotations

import math

from workbench.errors import WorkbenchError
from workbench.host import available_memory_bytes as available_bytes
from workbench.spec_hybrid import linear_state_bytes
from workbench.store import quant
from workbench.store.pack import expert_kind

PRECISIONS = ("bf16", "q8", "q4", "q3", "q2")
MiB = 2 ** 20


def largest_budget(resident: int, all_experts: int, available: int | None) -> str:
    """The largest expert budget (a fraction of all experts, or "all") that fits beside the resident weights."""
    if available is None:
        return "unknown"
    room = available - resident
    if room >= all_experts:
        return "all"
    if room <= 0:
        return "none (the weights alone do not fit)"
    return f"{math.floor(100 * room / all_experts) / 100:.2f}"


def memory_needs(spec, tensor_shapes: dict, budget, expert_bytes: int, resident_bytes: int | None = None,
                 engine: str = "", context: int = 4096, runtime_bytes: int = 0, speculative: int = 0,
                 adapter_bytes: int = 0) -> dict:
    """expert_bytes: what one expert costs in the engine's cache (engines.expert_bytes, the Session's item_bytes);
    resident_bytes: what the non-expert weights take as the engine holds them (Engine.resident_bytes; f32 by
    default); engine: its name, for the description. run_bytes: what a run of `context` tokens holds at its peak:
    needed_bytes, the linear-attention checkpoints, the KV cache and `runtime_bytes` (the interpreter and its
    libraries: `info` counts its own, having loaded what a run loads). adapter_bytes: what the preset serves beside
    the model (Edge0's heads and LoRA: workbench.edge0.artifacts.served_bytes), held with the weights."""
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    elements = sum(math.prod(s) for s in tensor_shapes.values())
    n_experts = len(spec.moe_layers) * spec.num_experts
    per_expert = {k: sum(quant.encoded_nbytes(shape, expert_kind(shape, k)) for shape in ((ff, d), (ff, d), (d, ff)))
                  for k in PRECISIONS}
    item = expert_bytes
    full = [i for i in range(spec.num_layers) if not spec.is_linear(i)]
    kv_heads, kv_dim = (1, spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.attention == "mla" else \
        (spec.num_kv_heads, 2 * spec.head_dim)
    kv_per_token = 4 * len(full) * kv_heads * kv_dim
    linear_state = linear_state_bytes(spec)
    # held (engines/hybrid.py): a decode step's start, a prompt's end, and each position of a step verifying
    # `speculative` drafts, the last of them the state being made
    states = linear_state * (3 + speculative)
    resident = (4 * elements if resident_bytes is None else resident_bytes) + adapter_bytes
    all_experts = item * n_experts
    cache = budget.nbytes(item, n_experts)
    available = available_bytes()
    return {
        "resident_bytes": resident, "adapter_bytes": adapter_bytes, "resident_f32_bytes": 4 * elements, "resident_bf16_bytes": 2 * elements,
        "shared_expert_bytes_f32": 4 * 3 * d * spec.shared_expert_size * len(spec.moe_layers),
        "experts": n_experts, "expert_bytes": {k: v * n_experts for k, v in per_expert.items()},
        "cache_bytes": cache, "cache_budget": budget.text, "cache_slots": budget.slots(item, n_experts),
        "cache_expert_bytes": item, "cache_engine": engine, "all_experts_cache_bytes": all_experts,
        "kv_bytes_per_token": kv_per_token,
        "linear_state_bytes": linear_state, "linear_checkpoint_bytes": states, "context": context,
        "needed_bytes": resident + min(cache, all_experts), "available_bytes": available,
        "runtime_bytes": runtime_bytes,
        "run_bytes": resident + min(cache, all_experts) + states + kv_per_token * context + runtime_bytes,
        "largest_budget": largest_budget(resident, all_experts, available),
    }


def check_fits(m: dict, where: str):
    """Refuse a configuration (memory_needs) that cannot fit, naming what it needs and what is available."""
    if m["available_bytes"] is not None and m["needed_bytes"] > m["available_bytes"]:
        cache = m["needed_bytes"] - m["resident_bytes"]
        raise WorkbenchError(f"{where}: needs {m['needed_bytes'] / MiB:.0f} MiB of memory "
                             f"({m['resident_bytes'] / MiB:.0f} MiB of weights + {cache / MiB:.0f} MiB of expert "
                             f"cache), {m['available_bytes'] / MiB:.0f} MiB available: choose a smaller --budget "
                             f"(largest that fits: {m['largest_budget']})")


def describe(m: dict) -> str:
    def gib(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    ex = ", ".join(f"{k} {gib(v)}" for k, v in m["expert_bytes"].items())
    avail = "unknown" if m["available_bytes"] is None else gib(m["available_bytes"])
    adapters = f", Edge0's heads and LoRA {gib(m['adapter_bytes'])} included" if m.get("adapter_bytes") else ""
    return (f"memory: resident non-expert weights {gib(m['resident_bytes'])} as the engine holds them{adapters} "
            f"({gib(m['resident_f32_bytes'])} f32, {gib(m['resident_bf16_bytes'])} bf16, shared experts included); {m['experts']} experts on disk: {ex}; expert cache at budget "
            f"{m['cache_budget']}: {gib(m['cache_bytes'])} ({m['cache_slots']} slots of {m['cache_expert_bytes']} bytes, "
            f"one expert in the {m['cache_engine'] or 'engine'} engine's cache); KV cache {m['kv_bytes_per_token']} bytes per token "
            f"of context; linear-attention state {gib(m['linear_state_bytes'])} a position "
            f"({gib(m['linear_checkpoint_bytes'])} with the checkpoints kept)\n"
            f"needs {gib(m['needed_bytes'])} (weights and cache), {avail} available; largest --budget that fits: "
            f"{m['largest_budget']}\n"
            f"a run of {m['context']} tokens holds about {gib(m['run_bytes'])} at its peak (the checkpoints, the KV "
            f"cache and {gib(m['runtime_bytes'])} of runtime added)")
