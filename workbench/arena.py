"""The slot arena: the expert cache's memory, preallocated, one slot per cached expert (Edge0's staged slots,
BigMoeOnEdge's byte-budget slots).

A slot holds one expert as the pack stores it (its encoded bytes, never dequantized), laid out as its reads
land: the contiguous layout's one 4 KiB-aligned span, or the native layout's three parts, each in its own
4 KiB-aligned region (a GGUF index's parts a few bytes into theirs: each read starts at the 4 KiB boundary before
its part in the GGUF, Pack.expert_heads). Reads go straight into a slot (O_DIRECT preadv into the slot's memory): nothing is
allocated per read. One arena block per cache pool (one for a global cache, one per layer for a per-layer
cache), as many slots as the pool holds experts; the arena's bytes are the cache's bytes.

A slot is free when the cache no longer holds its expert: the cache decides what stays (its policy, pins,
protection and in-flight reads) and the streamer hands the arena each expert the cache evicted (`release`), so
finding the memory a newly reserved expert lands in is a pop from the pool's free list.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from workbench.io import ALIGN, aligned_empty
from workbench.slot_reads import CHECK, PART, address
from workbench.store.pack import PARTS, _nbytes, expert_kinds, expert_shapes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_layout(pack, layer: int) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """Where one expert of `layer` has its reads and parts in a slot: ([(region offset, region bytes)] per read,
    {part: byte offset of its encoded bytes}, or of an MLX index's (codes, scales, biases) regions). The same for every expert of a layer (a raw GGUF pack's layers
    may keep different block types, so their layouts differ), but that a GGUF index's parts start past their
    region's start by pack.expert_heads (each read starts at the 4 KiB boundary before its part: a region holds
    the largest such read of the layer)."""
    ent = pack.expert_layers[layer][0]
    heads, sizes = pack.expert_heads(layer), None
    for e in range(len(pack.expert_layers[layer])):
        need = [_aligned(heads[e, i] + n) for i, (_, n) in enumerate(pack.expert_reads(layer, e))]
        sizes = need if sizes is None else list(map(max, sizes, need))
    regions, off = [], 0
    for n in sizes:
        regions.append((off, n))
        off += n
    if "span" in ent:
        parts = {p: ent["parts"][p][0] - ent["span"][0] for p in PARTS}
    elif "runs" in ent:                 # an MLX index: a part's codes, scales, biases each in a region of their own
        it = iter(regions)
        parts = {p: tuple(next(it)[0] for _ in ent["runs"][p]) for p in PARTS}
    else:
        parts = {p: regions[i][0] for i, p in enumerate(PARTS)}
    return regions, parts


def slot_bytes(pack) -> int:
    """What one expert costs in the arena: the 4 KiB-aligned bytes of its reads (the largest layer's)."""
    return int(max(sum(n for _, n in slot_layout(pack, L)[0]) for L in pack.spec.moe_layers))


def planned_slot_bytes(spec, layout: str, experts: str) -> int:
    """slot_bytes of the pack that convert would write of `spec` at `layout` and `experts` precision, without one
    (the simulator, the trace replay, `info` on a checkpoint not yet converted)."""
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    shapes = expert_shapes(d, ff)
    kinds = expert_kinds(shapes, experts)
    sizes = [_nbytes(shapes[p], kinds[p]) for p in PARTS]
    return _aligned(sum(sizes)) if layout == "contiguous" else sum(map(_aligned, sizes))


class SlotArena:
    def __init__(self, pack, cache):
        layouts = {}                                # one object per distinct layout (layers share it)
        self.layouts = {L: layouts.setdefault(repr(lay := slot_layout(pack, L)), lay) for L in pack.spec.moe_layers}
        self.slot_bytes = slot_bytes(pack)
        self.blocks: dict[int, np.ndarray] = {}     # MoE layer -> its pool's block (n slots * slot_bytes)
        self._free: dict[int, list] = {}            # id(block) -> its free slots
        self.where: dict = {}                       # expert key -> byte offset of its slot in its layer's block
        by_pool = {}
        for L in pack.spec.moe_layers:
            pool = cache.pools[L]
            if id(pool) not in by_pool:
                layers = [M for M in pack.spec.moe_layers if cache.pools[M] is pool]
                n = min(cache.capacity[L], pack.spec.num_experts * len(layers))
                block = aligned_empty(n * self.slot_bytes)
                block[::ALIGN] = 0                  # touch every page now: the arena is resident from the start
                by_pool[id(pool)] = block
                self._free[id(block)] = list(range(n - 1, -1, -1))
            self.blocks[L] = by_pool[id(pool)]
        self.memory = tuple({id(b): b for b in self.blocks.values()}.values())   # what reads land in: every block
        self.nbytes = sum(b.nbytes for b in self.memory)
        self._addresses = {L: address(b) for L, b in self.blocks.items()}

    def address(self, key) -> int:
        """Where the slot of `key` (just reserved in the cache) starts in memory: its reads land at its layout's
        region offsets past this."""
        base = self.where.get(key)              # read again while the cache still holds it: the same slot
        if base is None:
            free = self._free[id(self.blocks[key[0]])]
            if not free:
                raise RuntimeError(f"expert {key}: every slot holds an expert the cache still has")
            base = self.where[key] = free.pop() * self.slot_bytes
        return self._addresses[key[0]] + base

    def close(self):
        """A closed session's arena: its blocks and every view of them let go, whoever still refers to the arena."""
        self.blocks, self.where, self._free, self.memory = {}, {}, {}, ()

    def release(self, keys):
        """The cache evicted these experts: their slots are free."""
        for key in keys:
            self._free[id(self.blocks[key[0]])].append(self.where.pop(key) // self.slot_bytes)


class ReadPlan:
    """What reading each expert into its slot takes, worked out for every expert when the run opens, an array per
    fact indexed by the expert's row (`row`): its reads' file offsets (a GGUF index's from the 4 KiB boundary before
    its part: pack.expert_heads), the bytes each brings (its slot region; a GGUF index's read, to the 4 KiB boundary
    after its part), the region of the slot each lands in, its crc runs (CHECK rows, past a GGUF part's head) and
    crc32, and the bytes it reads. `reads` turns experts and their slots' addresses into the reader's rows."""

    def __init__(self, pack, arena: SlotArena):
        layers = pack.spec.moe_layers
        n = max(len(pack.expert_layers[L]) for L in layers)
        self.first = {L: i * n for i, L in enumerate(layers)}
        width = max(len(pack.expert_reads(L, 0)) for L in layers)
        self.offset, self.length, self.region = (np.zeros((len(layers) * n, width), np.int64) for _ in range(3))
        self.crc, self.nbytes = np.full(len(layers) * n, -1, np.int64), np.zeros(len(layers) * n, np.int64)
        self.cstart, runs = np.zeros(len(layers) * n + 1, np.int64), []
        for L in layers:
            regions, heads = arena.layouts[L][0], pack.expert_heads(L)
            index = bool(heads.any())
            for e in range(len(pack.expert_layers[L])):
                g, reads = self.first[L] + e, pack.expert_reads(L, e)
                check, self.crc[g] = pack.expert_check(L, e)
                head = heads[e]                 # zero in a pack
                for i, (off, nb) in enumerate(reads):
                    self.offset[g, i], self.region[g, i] = off - head[i], regions[i][0]
                    self.length[g, i] = -(-(head[i] + nb) // ALIGN) * ALIGN if index else regions[i][1]
                self.nbytes[g] = sum(nb for _, nb in reads)
                runs += [(i, a + head[i], z + head[i]) for i, a, z in check]
                self.cstart[g + 1] = len(runs)
            self.cstart[self.first[L] + len(pack.expert_layers[L]) + 1:self.first[L] + n + 1] = len(runs)
        self.runs = np.array(runs, np.int64).reshape(-1, 3)

    def row(self, key) -> int:
        return self.first[key[0]] + key[1]

    def reads(self, rows: np.ndarray, addresses: np.ndarray) -> tuple:
        """The reader's PART and CHECK rows and crc32s (io.Reader.submit_parts) of the experts in `rows` into the
        slots at `addresses`, and the bytes they read."""
        return _reads(rows, addresses, self.offset, self.length, self.region, self.cstart, self.runs, self.crc,
                      self.nbytes)


@njit(cache=True)
def _reads(rows, addresses, offset, length, region, cstart, runs, crc, nbytes):
    parts = np.empty((rows.shape[0] * offset.shape[1], PART), np.int64)
    checks = np.empty((cstart[rows + 1].sum() - cstart[rows].sum(), CHECK), np.int64)
    p = c = 0
    for k in range(rows.shape[0]):
        g = rows[k]
        for i in range(offset.shape[1]):
            if length[g, i]:
                parts[p, 0], parts[p, 1], parts[p, 2] = offset[g, i], length[g, i], addresses[k] + region[g, i]
                parts[p, 3], parts[p, 4] = k, i
                p += 1
        for r in range(cstart[g], cstart[g + 1]):
            checks[c, 0], checks[c, 1], checks[c, 2], checks[c, 3] = k, runs[r, 0], runs[r, 1], runs[r, 2]
            c += 1
    return parts[:p], checks, crc[rows], nbytes[rows].sum()
