"""The engine interface: what a Session drives, written down.

An engine runs the decoder of one pack, its routed experts brought in by the ExpertStreamer. It owns its
position (`pos`, tokens in its KV cache) and its token index (`token_index`: 0 at a prefill, then the
index of each decoded token after it; predictors, prefetches and telemetry key on it). Its hooks are given
at construction and never set from outside:
  predictor    predictor.predict(layer, ctx) -> {target: experts} to read ahead (workbench.predict)
  router_hook  router_hook(layer, logits, ctx) -> (ids, weights[, low]), in place of the exact router
  deltas       {projection name: x -> delta} added to x @ W.T (an unmerged adapter: Edge0's LoRA)
  low          the router's low tier (workbench.low_tier.LowTier): the resident low-precision copies of the
               experts whose choices the router hook marks (its third array), computed in place of a read
An engine declares what it can do: `takes_hooks` (False: it is refused hooks, not handed ones it ignores),
`computes_low` (False: it is refused a low tier)
`raw_experts` (the streamer hands it each expert part's encoded bytes instead of f32 arrays),
`slot_arena` (the cache's memory is a slot arena, workbench/arena.py, that reads land in) and `resident_bytes`
(what its non-expert weights take in memory beside the expert cache, which the session's memory guard adds to
the cache's bytes; None where the engine holds weights of its own); and which non-expert weights the session
dequantizes for it (`needed_weights`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from workbench.errors import WorkbenchError
from workbench.spec_hybrid import split_fused_projections


@dataclass(frozen=True)
class Hooks:
    predictor: object = None
    router_hook: Callable | None = None
    deltas: dict = field(default_factory=dict)
    low: object = None

    def __bool__(self):
        return self.predictor is not None or self.router_hook is not None or bool(self.deltas) or self.low is not None


def split_kv_b(spec, kv_b):
    """kv_b (heads*(nope+v), latent) -> k_b (heads, nope, latent) and v_b (heads, v, latent)."""
    kv_b = kv_b.reshape(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
    return kv_b[:, :spec.qk_nope_head_dim], kv_b[:, spec.qk_nope_head_dim:]


def dense_weights(pack, load=None) -> dict[str, np.ndarray]:
    """The pack's non-expert weights as the decoder uses them (f32, or what `load(name)` makes of a tensor):
    lm_head tied to embed when the model ties them, and latent attention's kv_b in its two halves (the absorbed
    form uses them apart)."""
    w = {name: (load or pack.tensor)(name) for name in pack.tensors}
    if "lm_head" not in w:
        w["lm_head"] = w["embed"]
    if pack.spec.attention == "mla":
        for i in range(pack.spec.num_layers):
            w[f"layers.{i}.k_b"], w[f"layers.{i}.v_b"] = split_kv_b(pack.spec, w[f"layers.{i}.kv_b"])
    if pack.spec.family == "qwen3_next":
        split_fused_projections(pack.spec, w)
    return w


class Engine(ABC):
    name: str
    threads: int | None = None      # the cores its kernels share, where it chooses them
    takes_hooks = True
    computes_low = False
    raw_experts = False
    slot_arena = False

    def __init__(self, pack, streamer, telemetry, hooks: Hooks = Hooks()):
        if hooks and not self.takes_hooks:
            self.refuse_hooks()
        self.pack, self.spec, self.streamer, self.tel = pack, pack.spec, streamer, telemetry
        self.predictor, self.router_hook, self.deltas = hooks.predictor, hooks.router_hook, dict(hooks.deltas)
        if hooks.low is not None and not self.computes_low:
            raise WorkbenchError(f"--engine {self.name} computes no low tier (low_on_miss, low_by_hotness): run them "
                                 f"with --engine packed or numpy")
        self.low = hooks.low
        self.token_index = 0
        self.prompt_end = 0                     # pos after the last prefill
        self.dense_compute_s = 0.0              # attention, norms, dense MLPs, head: compute outside the MoE layers

    def prefill(self, ids) -> np.ndarray:
        """A prompt, or more of one, at the current position; logits (len(ids), vocab)."""
        self.token_index = 0
        logits = self.forward(ids, "prefill")
        self.prompt_end = self.pos
        return logits

    def decode(self, ids) -> np.ndarray:
        """The next token, and any draft tokens to verify after it, at the current position; logits (T, vocab)."""
        self.token_index = self.pos - self.prompt_end + 1
        return self.forward(ids, "decode")

    @abstractmethod
    def forward(self, ids, phase: str) -> np.ndarray:
        """Run `ids` at the current position, extending the KV cache; logits (len(ids), vocab)."""

    @abstractmethod
    def reset(self):
        """An empty KV cache (position 0)."""

    def truncate(self, pos: int):
        """Forget the KV cache past `pos` (rejected speculative tokens, a shared prefix reused)."""
        self.pos = pos

    @classmethod
    def refuse_hooks(cls):
        raise WorkbenchError(f"--engine {cls.name} takes no predictor, router hook or adapter: choose a preset "
                             f"without them (teacher, resident, on_demand) or another engine")

    @classmethod
    def needed_weights(cls, pack) -> dict[str, np.ndarray]:
        """The non-expert weights, in f32, that the session hands this engine and its predictors and router hooks:
        all of them (dense_weights)."""
        return dense_weights(pack)

    @classmethod
    def resident_bytes(cls, pack) -> int | None:
        """Bytes of the non-expert weights this engine holds (None: not the pack's, as llama.cpp's own GGUF)."""
        return None

    @classmethod
    def slot_bytes(cls, pack, storage=None) -> int:
        """What one expert costs in this engine's expert cache (the budget's unit; engines.slot_bytes): of `pack`,
        or of a spec whose pack would be written at `storage` (a presets.Storage). Here: gate, up and down in f32."""
        spec = getattr(pack, "spec", pack)
        return 4 * 3 * spec.hidden_size * spec.moe_intermediate_size

    def swap_router_hook(self, hook):
        """Route with `hook` from now on (an observer wrapping the one it gets back); returns the previous hook."""
        if not self.takes_hooks:
            raise WorkbenchError(f"--engine {self.name} takes no router hook")
        previous, self.router_hook = self.router_hook, hook
        return previous
