"""What a configuration needs in memory, from the spec and the non-expert tensors' shapes alone (nothing is
loaded), and the guard that refuses one that cannot fit before anything is loaded, instead of the OOM killer
mid-run. `python -m workbench info --model DIR --budget B` prints the same numbers the guard refuses with.

- resident: the non-expert weights (attention, norms, routers, shared experts, embeddings, head), always in
  memory: as the engine holds them (the packed engine: its encoded matrices), in f32 and in bf16;
- experts: every routed expert, on disk, in each precision a pack can store them in;
- cache: the expert cache at the budget: the slots it buys (Budget.slots) of what one expert costs in the engine's
  cache (engines.slot_bytes: the packed engine's slot of packed bytes, numpy's f32 expert), as the Session sizes it;
- context: KV cache bytes per token (full-attention layers), and the fixed recurrent state of the
  linear-attention layers (Gated DeltaNet: conv and delta-rule state, whatever the context length);
- needed: resident (as held) + the cache, at most every expert; available: what the system says this process can
  still take (workbench/host.py: Linux's MemAvailable capped by the cgroup, macOS's free and inactive pages);
- expected, before any run (labelled so): the bytes a decoded token reads at the budget, from a real model's LRU
  hit curve (workbench/real_routing.py), the smallest budget that runs (a layer's top-k slots in each pool) and
  the verdict in one line.

`tensor_shapes` gives the non-expert tensors' shapes from the spec alone, so a config.json sizes all of this
before the checkpoint is downloaded (`info --model config.json`).
"""
from __future__ import annotations

import math
import re

from workbench.errors import WorkbenchError
from workbench.host import available_memory_bytes as available_bytes
from workbench.real_routing import SOURCE, lru_hit_rate
from workbench.spec_hybrid import linear_state_bytes
from workbench.store import quant
from workbench.store.pack import expert_kind

PRECISIONS = ("bf16", "q8", "q4", "q3", "q2")
MiB = 2 ** 20


def tensor_shapes(spec) -> dict[str, tuple]:
    """Every non-expert tensor a checkpoint of `spec` holds, {canonical name: shape}, from the spec alone: what
    `info` sizes a config.json by before the checkpoint is downloaded (tests/test_config_info.py checks it against
    the checkpoints of every family)."""
    s = spec
    d, h, kv, hd, V = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size
    out = {"embed": (V, d), "norm": (d,)}
    if not s.tie_word_embeddings:
        out["lm_head"] = (V, d)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        t = {"attn_norm": (d,), "mlp_norm": (d,)}
        if s.is_linear(i):
            L = s.linear
            nk, nv, dk, dv = L["num_key_heads"], L["num_value_heads"], L["key_head_dim"], L["value_head_dim"]
            qkv = 2 * nk * dk + nv * dv
            if s.family == "qwen3_next":
                t.update(lin_qkvz=(qkv + nv * dv, d), lin_ba=(2 * nv, d))
            else:
                t.update(lin_qkv=(qkv, d), lin_z=(nv * dv, d), lin_b=(nv, d), lin_a=(nv, d))
            t.update(lin_conv=(qkv, 1, L["conv_kernel"]), lin_A_log=(nv,), lin_dt_bias=(nv,), lin_norm=(dv,),
                     lin_out=(d, nv * dv))
        elif s.attention == "mla":
            if s.q_lora_rank:
                t.update(q_a=(s.q_lora_rank, d), q_a_norm=(s.q_lora_rank,), q_b=(h * hd, s.q_lora_rank))
            else:
                t["q"] = (h * hd, d)
            t.update(kv_a=(s.kv_lora_rank + s.qk_rope_head_dim, d), kv_a_norm=(s.kv_lora_rank,),
                     kv_b=(h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank), o=(d, h * s.v_head_dim))
        else:
            t.update(q=((2 if s.attn_output_gate else 1) * h * hd, d), k=(kv * hd, d), v=(kv * hd, d), o=(d, h * hd))
            if s.attention_bias:
                t.update(q_bias=(h * hd,), k_bias=(kv * hd,), v_bias=(kv * hd,))
            if s.qk_norm != "none":
                t.update(q_norm=(hd,) if s.qk_norm == "head" else (h * hd,),
                         k_norm=(hd,) if s.qk_norm == "head" else (kv * hd,))
        if i in s.dense_layers:
            f = s.dense_intermediate_size
            t.update({"dense.gate": (f, d), "dense.up": (f, d), "dense.down": (d, f)})
        else:
            t["router"] = (s.num_experts, d)
            if s.router == "sigmoid_group":
                t["router_bias"] = (s.num_experts,)
            if f := s.shared_expert_size:
                t.update({"shared.gate": (f, d), "shared.up": (f, d), "shared.down": (d, f)})
            if s.shared_expert_gate:
                t["shared_gate"] = (1, d)
        out.update({p + k: v for k, v in t.items()})
    return out


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


def memory_needs(spec, tensor_shapes: dict, budget, slot_bytes: int, resident_bytes: int | None = None,
                 engine: str = "", context: int = 4096, runtime_bytes: int = 0, speculative: int = 0,
                 adapter_bytes: int = 0, scope: str = "global", draft_bytes: int = 0) -> dict:
    """slot_bytes: what one expert costs in the engine's cache (engines.slot_bytes, a Session's slot_bytes);
    resident_bytes: what the non-expert weights take as the engine holds them (Engine.resident_bytes; f32 by
    default); engine: its name, for the description. run_bytes: what a run of `context` tokens holds at its peak:
    needed_bytes, the linear-attention checkpoints, the KV cache and `runtime_bytes` (the interpreter and its
    libraries: `info` counts its own, having loaded what a run loads). adapter_bytes: what the preset serves beside
    the model (Edge0's heads and LoRA: workbench.edge0.artifacts.served_bytes), held with the weights; draft_bytes:
    a draft model's (its own run's needed_bytes: all-resident beside the target), held likewise. scope: the
    preset's cache scope (per_layer: each layer's pool needs its top-k slots)."""
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    elements = sum(math.prod(s) for s in tensor_shapes.values())
    n_experts = len(spec.moe_layers) * spec.num_experts
    per_expert = {k: sum(quant.encoded_nbytes(shape, expert_kind(shape, k)) for shape in ((ff, d), (ff, d), (d, ff)))
                  for k in PRECISIONS}
    item = slot_bytes
    full = [i for i in range(spec.num_layers) if not spec.is_linear(i)]
    kv_heads, kv_dim = (1, spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.attention == "mla" else \
        (spec.num_kv_heads, 2 * spec.head_dim)
    kv_per_token = 4 * len(full) * kv_heads * kv_dim
    linear_state = linear_state_bytes(spec)
    # held (engines/hybrid.py): a decode step's start, a prompt's end, and each position of a step verifying
    # `speculative` drafts, the last of them the state being made
    states = linear_state * (3 + speculative)
    resident = (4 * elements if resident_bytes is None else resident_bytes) + adapter_bytes + draft_bytes
    all_experts = item * n_experts
    cache = budget.nbytes(item, n_experts)
    available = available_bytes()
    slots = budget.slots(item, n_experts)
    smallest = spec.top_k * (len(spec.moe_layers) if scope == "per_layer" else 1)
    held = min(1.0, slots / n_experts) if n_experts else 1.0
    read = (1 - lru_hit_rate(held)) * spec.top_k * len(spec.moe_layers) * item
    return {
        "resident_bytes": resident, "adapter_bytes": adapter_bytes, "draft_bytes": draft_bytes, "resident_f32_bytes": 4 * elements, "resident_bf16_bytes": 2 * elements,
        "shared_expert_bytes_f32": 4 * 3 * d * spec.shared_expert_size * len(spec.moe_layers),
        "experts": n_experts, "experts_bytes_by_precision": {k: v * n_experts for k, v in per_expert.items()},
        "cache_bytes": cache, "cache_budget": budget.text, "cache_slots": budget.slots(item, n_experts),
        "cache_slot_bytes": item, "cache_engine": engine, "all_experts_cache_bytes": all_experts,
        "kv_bytes_per_token": kv_per_token,
        "linear_state_bytes": linear_state, "linear_checkpoint_bytes": states, "context": context,
        "needed_bytes": resident + min(cache, all_experts), "available_bytes": available,
        "runtime_bytes": runtime_bytes,
        "run_bytes": resident + min(cache, all_experts) + states + kv_per_token * context + runtime_bytes,
        "largest_budget": largest_budget(resident, all_experts, available),
        "fits_resident": available is None or resident + all_experts <= available,
        "smallest_budget_slots": smallest, "smallest_budget_bytes": smallest * item,
        "smallest_budget": f"{math.ceil(100 * smallest / n_experts) / 100:.2f}" if n_experts else "all",
        "expected_hit_rate": lru_hit_rate(held), "expected_read_bytes_per_token": read,
    }


def check_fits(m: dict, where: str):
    """Refuse a configuration (memory_needs) that cannot fit, naming what it needs and what is available."""
    if m["available_bytes"] is not None and m["needed_bytes"] > m["available_bytes"]:
        cache = m["needed_bytes"] - m["resident_bytes"]
        raise WorkbenchError(f"{where}: needs {m['needed_bytes'] / MiB:.0f} MiB of memory "
                             f"({m['resident_bytes'] / MiB:.0f} MiB of weights + {cache / MiB:.0f} MiB of expert "
                             f"cache), {m['available_bytes'] / MiB:.0f} MiB available: choose a smaller --budget "
                             f"(largest that fits: {m['largest_budget']})")


def verdict(m: dict) -> str:
    """What this machine can do with the model, in one line."""
    def gib(n):
        return f"{n / 2**30:.2f} GiB"
    avail = "unknown memory" if m["available_bytes"] is None else f"{gib(m['available_bytes'])} available"
    if m["fits_resident"]:
        return f"verdict: runs resident, every expert in memory ({gib(m['resident_bytes'] + m['all_experts_cache_bytes'])}, {avail})"
    floor = m["resident_bytes"] + m["smallest_budget_bytes"]
    if m["available_bytes"] is not None and floor > m["available_bytes"]:
        return f"verdict: does not run here: the weights and the smallest cache need {gib(floor)}, {avail}"
    fits = m["available_bytes"] is None or m["needed_bytes"] <= m["available_bytes"]
    return (f"verdict: streams: at --budget {m['cache_budget']} it needs {gib(m['needed_bytes'])} ({avail}"
            f"{'' if fits else ': too much, choose a smaller budget'}) and reads about "
            f"{m['expected_read_bytes_per_token'] / MiB:.1f} MiB a token (expected); smallest budget that runs "
            f"{m['smallest_budget']}, largest that fits {m['largest_budget']}")


def describe(m: dict) -> str:
    def gib(n):
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    ex = ", ".join(f"{k} {gib(v)}" for k, v in m["experts_bytes_by_precision"].items())
    avail = "unknown" if m["available_bytes"] is None else gib(m["available_bytes"])
    adapters = f", Edge0's heads and LoRA {gib(m['adapter_bytes'])} included" if m.get("adapter_bytes") else ""
    adapters += f", the draft model's {gib(m['draft_bytes'])} included" if m.get("draft_bytes") else ""
    return (f"memory: resident non-expert weights {gib(m['resident_bytes'])} as the engine holds them{adapters} "
            f"({gib(m['resident_f32_bytes'])} f32, {gib(m['resident_bf16_bytes'])} bf16, shared experts included); {m['experts']} experts on disk: {ex}; expert cache at budget "
            f"{m['cache_budget']}: {gib(m['cache_bytes'])} ({m['cache_slots']} slots of {m['cache_slot_bytes']} bytes, "
            f"one expert in the {m['cache_engine'] or 'engine'} engine's cache); KV cache {m['kv_bytes_per_token']} bytes per token "
            f"of context; linear-attention state {gib(m['linear_state_bytes'])} a position "
            f"({gib(m['linear_checkpoint_bytes'])} with the checkpoints kept)\n"
            f"needs {gib(m['needed_bytes'])} (weights and cache), {avail} available; largest --budget that fits: "
            f"{m['largest_budget']}\n"
            f"a run of {m['context']} tokens holds about {gib(m['run_bytes'])} at its peak (the checkpoints, the KV "
            f"cache and {gib(m['runtime_bytes'])} of runtime added)\n"
            f"expected at budget {m['cache_budget']}: {m['expected_hit_rate']:.2f} of routed experts hit, "
            f"{gib(m['expected_read_bytes_per_token'])} read a decoded token (from {SOURCE}); the smallest budget "
            f"that runs: {m['smallest_budget']} ({m['smallest_budget_slots']} slots, {gib(m['smallest_budget_bytes'])})\n"
            f"{verdict(m)}")


_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def planned_mlx(cfg: dict, spec) -> tuple[dict, int, set]:
    """({canonical name: {"shape", "kind", "nbytes"}}, one expert's slot bytes, the experts' kinds) of a checkpoint in MLX's layout of this
    config.json, before it is downloaded (`info` on a config alone): as mlx-lm quantizes, every matrix whose columns
    split into the group, at the config's bits or its module's override; the rest in the model's dtype. An expert's
    runs (codes, scales, biases of each part) each take whole pages in its slot, from the page their bytes start in."""
    from workbench.models.hf import _RULES
    from workbench.models.mlx_layout import _SWITCH
    from workbench.store.pack import ALIGN, PARTS, _nbytes, expert_shapes
    q = cfg.get("quantization") or {}
    dtype = _DTYPE_NAMES.get(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", "bf16")
    own, experts = {}, {}          # canonical name / (layer, part) -> the module's override
    for key, v in q.items():
        if not isinstance(v, dict):
            continue
        key = key.removeprefix("language_model.")      # mlx-lm's name for Qwen3.5's text model
        if m := _SWITCH.fullmatch(key):
            experts[(int(m[1]), m[2])] = v
        for pattern, t in _RULES:
            if mm := re.fullmatch(pattern, f"{key}.weight"):
                own[t.format(*mm.groups())] = v

    def kind(shape, over) -> str:
        if len(shape) != 2 or over is False:
            return dtype
        a = over if isinstance(over, dict) else q
        ok = q and shape[-1] % a["group_size"] == 0 and (shape[-1] * a["bits"]) % 32 == 0
        return quant.mlx_kind(a["bits"], a["group_size"], dtype) if ok else dtype
    tensors = {}
    for name, shape in tensor_shapes(spec).items():
        k = kind(shape, q.get(name, own.get(name)))
        tensors[name] = {"shape": list(shape), "kind": k, "nbytes": _nbytes(tuple(shape), k)}
    shapes, slot, kinds = expert_shapes(spec.hidden_size, spec.moe_intermediate_size), 0, set()
    for L in spec.moe_layers:
        total = 0
        for p in PARTS:
            k = kind(shapes[p], experts.get((L, p)))
            kinds.add(k)
            a, numel = quant.affine(k), shapes[p][0] * shapes[p][1]
            runs = [numel * a[0] // 8] + [_nbytes(shapes[p], k) - numel * a[0] // 8 >> 1] * 2 if a \
                else [_nbytes(shapes[p], k)]
            total += sum(-(-(n + ALIGN - 1) // ALIGN) * ALIGN for n in runs)
        slot = max(slot, total)
    return tensors, slot, kinds
