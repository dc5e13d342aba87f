"""The expert cache: a byte budget that is never exceeded, counted in slots of one expert each
(the budget in bytes: workbench.presets.Budget.nbytes).

A slot is taken when a read is issued (in-flight reads count: their buffers exist), and
freed on eviction. Policies: LRU or LFU; scope: one global pool, or one pool per MoE layer
(the smolmaxxing pager). Pinned experts (a warm set) are never evicted, and neither is
anything in the caller's `protect` set (the experts the current layer still needs).
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from workbench.errors import WorkbenchError


def _in_flight(v) -> bool:
    """A slot whose read has not landed yet: its buffer exists, so it stays counted and is not evicted."""
    return v is None or (hasattr(v, "done") and not v.done())


class ExpertCache:
    def __init__(self, budget_bytes: int, item_bytes: int, layers: list[int], policy: str = "lru",
                 scope: str = "global", min_slots_per_layer: int = 1):
        if policy not in ("lru", "lfu"):
            raise WorkbenchError(f"cache policy {policy!r}: choose lru or lfu")
        self.item_bytes = item_bytes
        self.budget_bytes = budget_bytes
        self.policy, self.scope = policy, scope
        slots = budget_bytes // item_bytes
        if scope == "per_layer":
            self.pools = {L: OrderedDict() for L in layers}
            self.capacity = {L: slots // len(layers) for L in layers}
        elif scope == "global":
            pool = OrderedDict()
            self.pools = {L: pool for L in layers}
            self.capacity = {L: slots for L in layers}
        else:
            raise WorkbenchError(f"cache scope {scope!r}: choose global or per_layer")
        self._distinct = list({id(p): p for p in self.pools.values()}.values())   # one global pool, or one per layer
        per_layer = min(self.capacity.values()) if layers else slots
        if per_layer < min_slots_per_layer:
            raise WorkbenchError(
                f"--budget {budget_bytes} bytes is below one layer's top-k: need at least {min_slots_per_layer} expert slots "
                f"of {item_bytes} bytes{' per layer' if scope == 'per_layer' else ''}, the budget gives {per_layer}")
        self.pinned: set = set()
        self.slots_used = 0                 # experts held, all pools (kept as they change: reserve runs per read)
        self.uses: Counter = Counter()
        self.peak_bytes = 0
        self.evictions = 0
        self.last_evicted: list = []        # the keys the latest reserve() evicted (their memory is free again)

    def _pool(self, key) -> OrderedDict:
        return self.pools[key[0]]

    @property
    def bytes(self) -> int:
        return self.slots_used * self.item_bytes

    def __contains__(self, key) -> bool:
        return key in self._pool(key)

    def get(self, key):
        """The entry (a value or an in-flight future) and a touch, or None."""
        pool = self._pool(key)
        if key not in pool:
            return None
        pool.move_to_end(key)
        self.uses[key] += 1
        return pool[key]

    def peek(self, key):
        return self._pool(key).get(key)

    def _victim(self, pool: OrderedDict, protect):
        pinned = self.pinned
        if self.policy == "lru":                        # the pool is kept in recency order: the first that may go
            for k, v in pool.items():
                if k not in protect and k not in pinned and not _in_flight(v):
                    return k
            return None
        candidates = (k for k, v in pool.items() if k not in protect and k not in pinned and not _in_flight(v))
        order = {k: i for i, k in enumerate(pool)}
        return min(candidates, key=lambda k: (self.uses[k], order[k]), default=None)

    def reserve(self, key, value, protect=frozenset()) -> bool:
        """Insert key (evicting as needed); False if every slot is protected or pinned."""
        pool = self.pools[key[0]]
        self.last_evicted = []
        if key in pool:
            pool[key] = value
            return True
        cap = self.capacity[key[0]]
        while len(pool) >= cap:
            v = self._victim(pool, protect)
            if v is None:
                return False
            del pool[v]
            self.slots_used -= 1
            self.evictions += 1
            self.last_evicted.append(v)
        pool[key] = value
        self.slots_used += 1
        if self.slots_used * self.item_bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            assert self.peak_bytes <= self.budget_bytes, "expert cache exceeded its budget"
        return True

    def set(self, key, value):
        pool = self._pool(key)
        if key in pool:
            pool[key] = value

    def drop(self, key):
        pool = self._pool(key)
        if key in pool:
            del pool[key]
            self.slots_used -= 1

    def pin(self, key, value) -> bool:
        if self.reserve(key, value):
            self.pinned.add(key)
            return True
        return False

    def keys(self, layer: int | None = None):
        if layer is None:
            return [k for p in self._distinct for k in p]
        return [k for k in self.pools[layer] if k[0] == layer]


def warm_set(cache: ExpertCache, usage: dict) -> list[tuple[int, int]]:
    """The warm start: each MoE layer's most-used experts (usage: {layer: counts per expert}), as many as its pool
    holds (per-layer scope) or an even share of the global pool."""
    import numpy as np
    layers = list(cache.pools)
    per = min(cache.capacity.values()) if cache.scope == "per_layer" else cache.capacity[layers[0]] // len(layers)
    return [(L, int(e)) for L in layers for e in np.argsort(-np.asarray(usage[L]), kind="stable")[:per]]


def reserve_ahead(cache: ExpertCache, keys, value, protect=()) -> list:
    """Reserve the keys not yet in the cache, in order, until one finds no slot (a prefetch never evicts what
    `protect` holds); returns those reserved."""
    out = []
    for k in keys:
        if k in cache:
            continue
        if not cache.reserve(k, value, protect):
            break
        out.append(k)
    return out
