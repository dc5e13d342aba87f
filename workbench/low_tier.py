"""The low tier: a resident copy of some experts at a lower precision (HOBBIT's: a missed expert computed from its
int2 copy instead of waiting for its int4 one), read once when the run opens and never evicted.

A router that uses it (workbench.designs.lossy: low_on_miss, low_by_hotness) names the precision (`low`, q2 or q3)
and the experts the tier must hold; its route marks the routed choices computed from the tier, and the engine's
expert-compute object computes those from here while the layer's reads of the rest are in flight. The copy comes from
a pack of the same checkpoint at that precision (converted once, like any pack; a pack given as the model has no
checkpoint to convert, and is refused). Its bytes are memory beside the budget, stated in every run record
(`low_tier_bytes`).
"""
from __future__ import annotations

import shutil

import numpy as np

from workbench.arena import slot_layout
from workbench.errors import WorkbenchError
from workbench.io import aligned_empty
from workbench.host import available_memory_bytes
from workbench.registry import GGUF_STORAGE, experts_for, is_pack, model_dir, needs_writing, pack_path, resolve_pack
from workbench.store.pack import Pack, open_model, planned_size

LOW = ("q2", "q3")


class LowTier:
    def __init__(self, pack: Pack, keys):
        """pack: the checkpoint's experts at the low precision; keys: the (layer, expert)s to hold, read now."""
        self.pack, self.layouts = pack, {}
        by_layer: dict[int, list[int]] = {}
        for L, e in sorted(set(keys)):
            by_layer.setdefault(L, []).append(e)
        self.blocks: dict[int, np.ndarray] = {}       # layer -> its held experts' slots, end to end
        self.where: dict[int, np.ndarray] = {}        # layer -> per expert id, its slot's offset in the block, or -1
        for L, es in by_layer.items():
            regions, _ = self.layouts[L] = slot_layout(pack, L)
            slot = sum(n for _, n in regions)
            block = self.blocks[L] = aligned_empty(len(es) * slot)
            where = self.where[L] = np.full(pack.spec.num_experts, -1, np.int64)
            for i, e in enumerate(es):
                chunks = pack.expert_bytes(L, e)
                pack.check_expert(L, e, chunks)
                for (off, _), c in zip(regions, chunks):
                    block[i * slot + off:i * slot + off + c.size] = c
                where[e] = i * slot
        self.nbytes = sum(b.nbytes for b in self.blocks.values())

    def holds(self, layer: int, e: int) -> bool:
        w = self.where.get(layer)
        return w is not None and w[e] >= 0

    def offsets(self, layer: int, es) -> np.ndarray:
        return self.where[layer][np.asarray(es, np.int64)]

    def chunks(self, layer: int, e: int) -> list[np.ndarray]:
        """Expert e's bytes as its reads bring them (Pack.decode_expert takes them)."""
        base, regions = int(self.where[layer][e]), self.layouts[layer][0]
        sizes = [n for _, n in self.pack.expert_reads(layer, e)]
        return [self.blocks[layer][base + off:base + off + n] for (off, _), n in zip(regions, sizes)]

    def weights(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """Expert e's gate, up, down dequantized to f32 (the numpy engine's, and the reference's)."""
        return self.pack.decode_expert(layer, e, self.chunks(layer, e))


def low_pack(model: str, storage, low: str, engine: str | None) -> Pack:
    """The pack of `model`'s checkpoint at experts `low` (q2, q3: ggml's blocks at those bits for the packed engine),
    its layout and rest as the run's `storage` (a presets.Storage) has them, converted once where it is not in the
    cache. One line where it cannot be: `model` is a pack (no checkpoint to convert), or the disk has no room."""
    if low not in LOW:
        raise WorkbenchError(f"low={low}: choose one of {', '.join(LOW)} (the low tier's precision)")
    src = model_dir(model)
    if is_pack(src):
        raise WorkbenchError(f"{src}: a pack holds its experts at one precision, and a {low} copy needs the checkpoint "
                             f"it was converted from: run on that checkpoint (a directory or a .gguf)")
    layout, rest = storage.layout.value, storage.rest
    if (layout, storage.experts, rest) == GGUF_STORAGE:       # a checkpoint streamed where it lies
        layout, rest = "contiguous", "q8"
    experts = experts_for(low, engine)
    if needs_writing(model, layout, experts, rest):
        dst = pack_path(src, layout, experts, rest)
        dst.parent.mkdir(parents=True, exist_ok=True)
        need, free = planned_size(open_model(src), layout, experts, rest), shutil.disk_usage(dst.parent).free
        if need > free:
            raise WorkbenchError(f"{src}: no room for its {low} copy (the low tier's source): {need / 2**30:.2f} GiB "
                                 f"to write in {dst.parent}, {free / 2**30:.2f} GiB free")
    return Pack(resolve_pack(model, layout, experts, rest))


def fits(nbytes: int, where: str):
    """Refuse a low tier the machine's available memory cannot hold beside the run."""
    avail = available_memory_bytes()
    if avail is not None and nbytes > avail:
        raise WorkbenchError(f"{where}: its low tier needs {nbytes / 2**20:.0f} MiB of memory, {avail / 2**20:.0f} "
                             f"MiB available: choose fewer low experts or a smaller budget")
