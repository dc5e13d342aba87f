"""Designs as presets: named settings of the shared knobs, and ladders that add one knob per rung.

Every knob is a real mechanism in the engine and shows up in telemetry:
  layout, experts, rest   storage: contiguous | native layout; expert / non-expert precision
  budget                  expert cache budget (fraction of all experts, a size, or "all")
  cache_policy, cache_scope   lru | lfu; global | per_layer (the smolmaxxing pager's pools)
  warm                    pre-load each layer's most-used experts (measured on held-out text)
  execution               ready_first (compute what is in memory while the rest arrive) | wait_all
  predictor               None | lookahead:DEPTH:WIDTH | history | oracle | shuffled | prerouter
  routing                 exact | cache_bias:BETA | prerouter
  speculative             draft tokens verified per target step (0 = plain decoding)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from workbench.errors import WorkbenchError


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    layout: str = "contiguous"
    experts: str = "q4"
    rest: str = "q4"
    budget: str = "0.25"
    cache_policy: str = "lru"
    cache_scope: str = "global"
    warm: bool = False
    execution: str = "wait_all"
    predictor: str | None = None
    routing: str = "exact"
    speculative: int = 0

    def with_(self, **kw) -> "Preset":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def exact(self) -> bool:
        return self.routing == "exact"


PRESETS = {p.name: p for p in [
    Preset("teacher", "full precision (bf16 weights, fp32 compute), exact routing, every expert resident: the reference",
           experts="bf16", rest="bf16", budget="all"),
    Preset("resident", "every expert in memory (the ceiling), int4", budget="all"),
    Preset("on_demand", "no prediction: each miss is read when the layer asks for it (the floor control)",
           layout="native"),
    Preset("oracle", "prefetch the true routing one layer ahead (the bound on prediction)",
           execution="ready_first", predictor="oracle"),
    Preset("shuffled", "control: prefetch experts drawn from each layer's marginal frequencies, no timing information",
           execution="ready_first", predictor="shuffled"),
    Preset("history", "prefetch the previous token's experts at each layer", execution="ready_first", predictor="history"),
    Preset("les", "LES: router lookahead 1 layer (top-k), ready-first, contiguous layout, experts q3 / rest q4",
           experts="q3", rest="q4", execution="ready_first", predictor="lookahead:1:k"),
    Preset("smol", "smolmaxxing pager: per-layer LRU pools warmed from each layer's most-used list, "
           "prefetch 2 layers ahead, parallel whole-expert reads, experts q2 / rest q4",
           experts="q2", rest="q4", cache_scope="per_layer", warm=True, execution="ready_first", predictor="lookahead:2:k"),
    Preset("smol_bias", "smolmaxxing pager with cache-aware routing bias 0.05 for experts in memory",
           experts="q2", rest="q4", cache_scope="per_layer", warm=True, execution="ready_first",
           predictor="lookahead:2:k", routing="cache_bias:0.05"),
    Preset("edge0", "Edge0: trained prerouter heads predict the next layer's routing a token ahead and that "
           "prediction is the routing (the first skip_layers MoE layers exact); unmerged recovery LoRA on attention; "
           "int4 experts and rest",
           experts="q4", rest="q4", execution="ready_first", predictor="prerouter", routing="prerouter"),
]}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise WorkbenchError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
