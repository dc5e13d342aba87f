"""A run's plan: what a run of one model, preset, budget and engine needs, worked out before anything is allocated.

    p = plan("demo", "les", "0.25")
    p.slots, p.slot_bytes, p.memory["needed_bytes"]

The pack (a checkpoint is converted on first use; a GGUF's own blocks are indexed where they lie), the engine, what
one expert costs in that engine's cache (the budget's unit: engines.slot_bytes), the slots the budget buys and
the memory the run will hold, refused up front when it cannot fit. `info` prints a plan (convert=False: a
checkpoint not yet converted, or a config.json alone, is sized from its shapes), a Session
(runtime.session.open_session) wires one up.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from engines import default_engine, engine_class, slot_bytes
from workbench.edge0.artifacts import edge0_dir, edge0_dir_of, served_bytes
from workbench.cache import CachePlan
from workbench.host import peak_rss_bytes
from workbench.memory import check_fits, memory_needs, tensor_shapes
from workbench.presets import Budget, Preset, get_preset
from workbench.registry import model_dir, needs_writing, resolve_pack, storage_for
from workbench.spec import MoESpec
from workbench.store.pack import Pack


@dataclass(frozen=True)
class Plan:
    model: str
    preset: Preset              # its storage the pack's (a GGUF streams on its own blocks: registry.storage_for)
    pack: Pack | None           # None: sized from the checkpoint's shapes (plan(convert=False), nothing written)
    spec: MoESpec
    engine: str
    slot_bytes: int             # what one expert costs in the engine's cache: the budget's unit
    budget: str                 # as given (0.25, 96MiB, all)
    cache: CachePlan            # the expert cache every clock builds: slots, policy, scope, start
    memory: dict                # workbench.memory.memory_needs

    budget_bytes = property(lambda self: self.cache.budget_bytes)
    slots = property(lambda self: self.cache.slots)

    @property
    def experts(self) -> int:
        return self.spec.num_experts * len(self.spec.moe_layers)

    @property
    def all_resident(self) -> bool:
        return self.budget_bytes >= self.slot_bytes * self.experts


def plan(model: str, preset: str | Preset = "on_demand", budget: str | None = None, engine: str | None = None,
         progress: bool = False, *, convert: bool = True, check: bool = True, **knobs) -> Plan:
    """The plan of a run; knobs: the preset's, by their flat names (Preset.with_). A configuration that cannot fit
    in available memory is one clear error naming the largest budget that does (check=False: the memory is said,
    not checked). convert=False: a pack the run would write is not; the checkpoint is sized from its shapes."""
    p = preset if isinstance(preset, Preset) else get_preset(preset)
    if knobs:
        p = p.with_(**knobs)
    config = config_only(model_dir(model))
    layout, experts, rest = storage_for(model, p.storage, knobs, engine) if not config else \
        (p.storage.layout.value, p.storage.experts, p.storage.rest)
    if (layout, experts, rest) != (p.storage.layout.value, p.storage.experts, p.storage.rest):
        p = p.with_(layout=layout, experts=experts, rest=rest)   # a GGUF's own: what records say
    if config or (not convert and needs_writing(model, layout, experts, rest)):
        pack, (spec, shapes, engine, cost, resident, adapters) = None, _unconverted(model, config, p, engine)
    else:
        pack = Pack(resolve_pack(model, layout, experts, rest, progress=progress))
        engine = engine or default_engine(pack)
        spec, shapes = pack.spec, {n: t["shape"] for n, t in pack.tensors.items()}
        cost, resident = slot_bytes(engine, pack), engine_class(engine).resident_bytes(pack)
        adapters = served_bytes(edge0_dir(pack), p)
    text = str(budget if budget is not None else p.cache.budget)
    b = Budget(text)
    engine_class(engine)        # its module imported: this process's memory is a run's runtime
    memory = memory_needs(spec, shapes, b, cost, resident, engine, runtime_bytes=peak_rss_bytes(),
                          speculative=p.execution.speculative, adapter_bytes=adapters, scope=p.cache.scope.value,
                          draft_bytes=draft_bytes(p, engine, model))
    if check and resident is not None:      # llama.cpp's own GGUF: its weights are not the pack's to count
        check_fits(memory, f"{pack.path} at --budget {text}")
    return Plan(model, p, pack, spec, engine, cost, text, CachePlan.of(p, spec, text, cost), memory)


def draft_bytes(p: Preset, engine: str, model: str) -> int:
    """What the preset's draft holds beside the target: a draft model its own plan's, all-resident on the target's
    engine (runtime.speculative.DraftModel opens it so); the target's MTP block its float32 tensors
    (engines.mtp.MTPHead holds them so); 0 for lookup and modelled:A."""
    from runtime.speculative import draft_model
    from workbench.models.mtp import mtp_bytes
    if not p.execution.speculative:
        return 0
    if p.execution.draft == "mtp":
        return mtp_bytes(model_dir(model))
    d = draft_model(p.execution.draft)
    return plan(d, "resident", None, engine, convert=False, check=False).memory["needed_bytes"] if d else 0


def _unconverted(model: str, config: Path | None, p: Preset, engine: str | None):
    """(spec, tensor shapes, engine, slot bytes, resident bytes, adapter bytes) of a checkpoint not converted, as
    the pack the preset would write holds it: from its config.json alone (before the download) or its Hugging Face
    directory's headers."""
    from workbench.models.hf import HFModel, read_config
    from workbench.spec import from_hf_config
    from workbench.store.pack import planned_tensors
    named, engine = engine, engine or default_engine()
    cfg = read_config(config) if config else {}
    if config is None:
        m = HFModel(model_dir(model))
        spec, shapes, adapters = m.spec, {n: m.tensor_shape(n) for n in m.where}, served_bytes(edge0_dir_of(m.path), p)
    else:
        spec, adapters = from_hf_config(cfg, str(config)), 0
        shapes = tensor_shapes(spec)
    if "quantization" not in cfg:
        tensors, slot = planned_tensors(shapes, p.storage.rest), slot_bytes(engine, spec, p.storage)
    else:                                               # MLX's layout: it runs at its own bits, in place
        from engines.packed_kernels import affine_of
        from workbench.memory import planned_mlx
        tensors, slot, kinds = planned_mlx(cfg, spec)
        if not named and engine == "packed" and not all(map(affine_of, kinds)):
            engine = "numpy"                            # as default_engine picks for its index
        cls = engine_class(engine)
        slot = slot if cls.slot_arena else cls.slot_bytes(spec)
    return spec, shapes, engine, slot, engine_class(engine).resident_bytes(SimpleNamespace(spec=spec, tensors=tensors)), adapters


def config_only(p: Path) -> Path | None:
    """The config.json to size a model by when `p` is one, or a directory holding it and no weights; else None."""
    p = Path(p)
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "config.json").is_file() and not any(p.glob("*.safetensors")) \
            and not (p / "model.safetensors.index.json").exists():
        return p / "config.json"
    return None
