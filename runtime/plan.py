"""A run's plan: what a run of one model, preset, budget and engine needs, worked out before anything is allocated.

    p = plan("demo", "les", "0.25")
    p.slots, p.slot_bytes, p.memory["needed_bytes"]

The pack (a checkpoint is converted on first use; a GGUF's own blocks are indexed where they lie), the engine, what
one expert costs in that engine's cache (the budget's unit: engines.slot_bytes), the slots the budget buys and
the memory the run will hold, refused up front when it cannot fit. `info` prints a plan, a Session
(runtime.session.open_session) wires one up.
"""
from __future__ import annotations

from dataclasses import dataclass

from engines import default_engine, engine_class, slot_bytes
from workbench.edge0.artifacts import edge0_dir, served_bytes
from workbench.memory import check_fits, memory_needs
from workbench.presets import Budget, Preset, get_preset
from workbench.registry import resolve_pack, storage_for
from workbench.store.pack import Pack


@dataclass(frozen=True)
class Plan:
    model: str
    preset: Preset              # its storage the pack's (a GGUF streams on its own blocks: registry.storage_for)
    pack: Pack
    engine: str
    slot_bytes: int             # what one expert costs in the engine's cache: the budget's unit
    budget: str                 # as given (0.25, 96MiB, all)
    budget_bytes: int
    slots: int
    memory: dict | None         # workbench.memory.memory_needs, where the engine says what its weights hold

    @property
    def experts(self) -> int:
        return self.pack.num_expert_total

    @property
    def all_resident(self) -> bool:
        return self.budget_bytes >= self.slot_bytes * self.experts


def plan(model: str, preset: str | Preset = "on_demand", budget: str | None = None, engine: str | None = None,
         progress: bool = False, **knobs) -> Plan:
    """The plan of a run; knobs: the preset's, by their flat names (Preset.with_). A configuration that cannot fit
    in available memory is one clear error naming the largest budget that does."""
    p = preset if isinstance(preset, Preset) else get_preset(preset)
    if knobs:
        p = p.with_(**knobs)
    layout, experts, rest = storage_for(model, p.storage, knobs, engine)
    if (layout, experts, rest) != (p.storage.layout.value, p.storage.experts, p.storage.rest):
        p = p.with_(layout=layout, experts=experts, rest=rest)   # a GGUF's own: what records say
    pack = Pack(resolve_pack(model, layout, experts, rest, progress=progress))
    engine = engine or default_engine(pack)
    cls = engine_class(engine)
    cost = slot_bytes(engine, pack)
    text = str(budget if budget is not None else p.cache.budget)
    b = Budget(text)
    memory = None
    if (resident := cls.resident_bytes(pack)) is not None:
        memory = memory_needs(pack.spec, {n: t["shape"] for n, t in pack.tensors.items()}, b, cost, resident,
                              engine, speculative=p.execution.speculative,
                              adapter_bytes=served_bytes(edge0_dir(pack), p))
        check_fits(memory, f"{pack.path} at --budget {text}")
    return Plan(model, p, pack, engine, cost, text, b.nbytes(cost, pack.num_expert_total),
                b.slots(cost, pack.num_expert_total), memory)
