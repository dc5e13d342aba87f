"""The expert cache: a number of slots of one expert each that is never exceeded (what a budget buys:
workbench.presets.Budget.slots, at what one expert costs in the engine's cache: engines.slot_bytes).

A slot is taken when a read is issued (in-flight reads count: their buffers exist), and
freed on eviction. Which expert goes is the policy's (workbench.designs.Policy, by name: lru, lfu, s3fifo, ...; one
per pool); scope: one global pool, or one pool per MoE layer (the smolmaxxing pager). Pinned experts (a hot store)
are never evicted, and neither is anything in the caller's `protect` set (the experts the current layer still
needs) nor a read in flight. Each pool is kept in recency order, which the policy's `Evictable` iterates.

A guess's prefetch (`reserve(..., spare=n)`) may be told not to evict an expert used within the last n layer steps;
`GuessAdmission` says when (a prefetch that is not made is a read on demand if the expert is asked for).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from workbench.designs import Evictable, Policy, policy_class
from workbench.errors import WorkbenchError


def _in_flight(v) -> bool:
    """A slot whose read has not landed yet: its buffer exists, so it stays counted and is not evicted."""
    return v is None or (hasattr(v, "done") and not v.done())


class ExpertCache:
    def __init__(self, slots: int, item_bytes: int, layers: list[int], policy: str = "lru",
                 scope: str = "global", min_slots_per_layer: int = 1, params: dict | None = None):
        """slots: experts the cache holds at most (per_layer: shared evenly between the layers); item_bytes: what
        one costs, for the cache's byte counts; policy: a Policy by name or reference, params: its parameters."""
        cls = policy_class(policy)
        self.slots, self.item_bytes = slots, item_bytes
        self.policy, self.scope = policy, scope
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
        self.min_slots_per_layer = min_slots_per_layer
        per_layer = min(self.capacity.values()) if layers else slots
        if per_layer < min_slots_per_layer:
            raise WorkbenchError(
                f"--budget of {slots} expert slots of {item_bytes} bytes is below one layer's top-k: need at least "
                f"{min_slots_per_layer} slots{' per layer' if scope == 'per_layer' else ''}, the budget gives {per_layer}")
        self._cls, self._own = cls, {k: v for k, v in (params or {}).items() if k in cls.params}
        self._policy_capacity = dict(self.capacity)      # what each policy is told (before a hot store's share)
        self._new_policies()
        # a policy's hooks are called only where it has them (LRU's recency is the pools' own order)
        self._hits = cls.hit is not Policy.hit
        self._check = hasattr(cls, "ref")       # a design's own: its victim is checked (the built-ins are tested)
        self._tracks = any(getattr(cls, m) is not getattr(Policy, m) for m in ("inserted", "removed", "demoted"))
        self.pinned: set = set()
        self.slots_used = 0                 # experts held, all pools (kept as they change: reserve runs per read)
        self.peak_bytes = 0
        self.evictions = 0
        self.last_evicted: list = []        # the keys the latest reserve() evicted (their memory is free again)
        self.steps = 0                      # layer steps so far (step()); used[key]: the step it was last used at
        self.used: dict = {}

    def _new_policies(self):
        one = {id(p): self._cls(self._policy_capacity[next(L for L in self.pools if self.pools[L] is p)],
                                len(self.pools), **self._own) for p in self._distinct}     # a policy per pool
        self._policy = {L: one[id(self.pools[L])] for L in self.pools}

    def clear(self) -> list:
        """A cold start: every expert but the pinned ones leaves and each pool's policy starts anew (what it counted
        before, an LFU's uses, an S3-FIFO's ghosts, is not the next run's). Returns the keys that left."""
        keys = [k for k in self.keys() if k not in self.pinned]
        for k in keys:
            self.drop(k)
        self._new_policies()
        if self._tracks:
            for k in self.keys():
                self._policy[k[0]].inserted(k, self.steps)
        return keys

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
        if self._hits:
            self._policy[key[0]].hit(key, self.steps)
        self.used[key] = self.steps
        return pool[key]

    def step(self):
        """A layer step begins (the clock a prefetch's `spare` counts in)."""
        self.steps += 1

    def peek(self, key):
        return self._pool(key).get(key)

    def _victim(self, pool: OrderedDict, layer: int, protect, spare: int = 0):
        evictable = Evictable(pool, protect, self.pinned, _in_flight)
        victim = self._policy[layer].victim(evictable, self.steps)
        if self._check and victim is not None and victim not in evictable:
            raise WorkbenchError(f"cache policy {self.policy}: its victim {victim} is not an expert that may leave "
                                 f"the pool now")
        if spare and victim is not None and self.used.get(victim, -spare) > self.steps - spare:
            return None                                 # used too recently for a guess to evict it
        return victim

    def reserve(self, key, value, protect=frozenset(), spare: int = 0) -> bool:
        """Insert key (evicting as needed); False if every slot is protected or pinned (spare: or the expert that
        would go was used within the last `spare` steps: a guess's prefetch)."""
        pool = self.pools[key[0]]
        self.last_evicted = []
        if key in pool:
            pool[key] = value
            return True
        cap = self.capacity[key[0]]
        while len(pool) >= cap:
            v = self._victim(pool, key[0], protect, spare)
            if v is None:
                return False
            del pool[v]
            self.used.pop(v, None)
            self.slots_used -= 1
            self.evictions += 1
            self.last_evicted.append(v)
            if self._tracks:
                self._policy[key[0]].removed(v)
        pool[key] = value
        if self._tracks:
            self._policy[key[0]].inserted(key, self.steps)
        if not spare:
            self.used[key] = self.steps         # a demand read or a certain prefetch: in use now
        self.slots_used += 1
        if self.slots_used * self.item_bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            assert self.slots_used <= self.slots, "expert cache exceeded its budget"
        return True

    def set(self, key, value):
        pool = self._pool(key)
        if key in pool:
            pool[key] = value

    def demote(self, key):
        """A prefetch its layer did not ask for: the first to go, not the most recently used. A wrong guess then
        costs its read and the one expert it replaced, not a slot held for a whole turn of the cache (which evicts
        what on_demand's cache keeps)."""
        pool = self._pool(key)
        if key in pool:
            pool.move_to_end(key, last=False)
            if self._tracks:
                self._policy[key[0]].demoted(key)

    def drop(self, key):
        pool = self._pool(key)
        if key in pool:
            del pool[key]
            self.used.pop(key, None)
            self.slots_used -= 1
            if self._tracks:
                self._policy[key[0]].removed(key)

    def pin(self, key, value) -> bool:
        if self.reserve(key, value):
            self.pinned.add(key)
            return True
        return False

    def hold(self, keys: list):
        """Make room for a pinned hot store of `keys` beside the pools: per layer, each pool keeps an equal share of
        what the hot store leaves of the budget, plus its own pinned experts (colibri's hot store and per-layer LRU
        share one budget). A global pool holds them among its slots."""
        if self.scope != "per_layer" or not keys:
            return
        rest = (self.slots - len(keys)) // len(self.pools)
        if rest < self.min_slots_per_layer:
            raise WorkbenchError(f"a hot store of {len(keys)} experts leaves {rest} slots per layer of the budget's "
                                 f"{self.slots}: below one layer's top-k ({self.min_slots_per_layer})")
        for L in self.pools:
            self.capacity[L] = rest + sum(k[0] == L for k in keys)

    def keys(self, layer: int | None = None):
        if layer is None:
            return [k for p in self._distinct for k in p]
        return [k for k in self.pools[layer] if k[0] == layer]


@dataclass(frozen=True)
class CachePlan:
    """A run's expert cache, decided once for every clock (the Session's, the simulator's, replay's, Belady's bound):
    the slots a budget buys at what one expert costs, the policy and scope, and what it starts with (start_set)."""
    slots: int
    slot_bytes: int
    budget_bytes: int
    layers: tuple
    top_k: int
    policy: str = "lru"
    scope: str = "global"
    params: tuple = ()
    warm: bool = False
    hot: float = 0.0

    @classmethod
    def of(cls, preset, spec, budget, slot_bytes: int) -> "CachePlan":
        """preset: a workbench.presets.Preset (its cache knobs); budget: its text (0.25, 96MiB, all)."""
        from workbench.presets import Budget
        n = spec.num_experts * len(spec.moe_layers)
        b, c = Budget(str(budget)), preset.cache
        return cls(b.slots(slot_bytes, n), slot_bytes, b.nbytes(slot_bytes, n), tuple(spec.moe_layers), spec.top_k,
                   c.policy, c.scope.value, tuple(preset.params), c.warm, c.hot)

    @property
    def per_pool(self) -> int:
        """The slots of one pool: a layer's (per_layer scope) or the global pool's (Belady's bound sizes it so)."""
        return self.slots // len(self.layers) if self.scope == "per_layer" else self.slots

    def cache(self) -> ExpertCache:
        return ExpertCache(self.slots, self.slot_bytes, list(self.layers), policy=self.policy, scope=self.scope,
                           min_slots_per_layer=self.top_k, params=dict(self.params))

    def start(self, cache: ExpertCache, usage: dict) -> tuple[list, list] | None:
        """(pinned, warm) the run starts with (start_set), or None: nothing."""
        return start_set(cache, usage, self.warm, self.hot) if (self.warm or self.hot) else None


def warm_set(cache: ExpertCache, usage: dict) -> list[tuple[int, int]]:
    """The warm start: each MoE layer's most-used experts (usage: {layer: counts per expert}), as many as its pool
    holds (per-layer scope) or an even share of the global pool."""
    import numpy as np
    layers = list(cache.pools)
    per = min(cache.capacity.values()) if cache.scope == "per_layer" else cache.capacity[layers[0]] // len(layers)
    return [(L, int(e)) for L in layers for e in np.argsort(-np.asarray(usage[L]), kind="stable")[:per]]


def start_set(cache: ExpertCache, usage: dict, warm: bool, hot: float) -> tuple[list, list]:
    """What a run starts with, before the prompt: (pinned, warm). pinned: the hot store, the `hot` fraction of the
    budget's slots given to the most-used experts of any layer (usage: {layer: counts per expert} on held-out text);
    warm: each layer's most-used experts that are not pinned, filling its share (warm_set). Calls cache.hold."""
    import numpy as np
    pinned = []
    if hot:
        layers = list(cache.pools)
        counts = np.array([np.asarray(usage[L], np.float64) for L in layers])
        order = np.argsort(-counts.reshape(-1), kind="stable")[:int(hot * cache.slots)]
        pinned = [(layers[i // counts.shape[1]], int(i % counts.shape[1])) for i in order]
        cache.hold(pinned)
    held = set(pinned)
    return pinned, [k for k in warm_set(cache, usage) if k not in held] if warm else []


class GuessAdmission:
    """What a predictor's guesses may do, from what they and the cache have shown so far (counts Laplace-smoothed):
    - `admit()`: guess at all only while more of the experts it names are used than not (its precision at least
      1/2): a wrong guess is a read nobody asked for, and a right one only moves a demand read earlier;
    - `spare()`: let a guess take the slot of an expert the last token used (0 layer steps spared) only while its
      precision is above the rate at which the experts the cache kept are asked for again. Where the cache keeps
      what the next token needs, a wrong guess would evict it; where the cache thrashes, the slot was about to go.
    - `admitted(named)`: of a prediction's experts (best first), those whose place in the order has been right
      often enough to pay (`bar`). A wrong guess is one read nobody asked for, plus a read of the expert it evicted
      if that one is asked for again (at about the rate q the cache's experts are); a right one saves a miss's
      wait. A place whose precision p is over (1 + q) / (2 + q) gains more than it costs: 1/2 where the cache
      thrashes (q = 0), 2/3 where it keeps all (q = 1). The lookahead's last places are right about half the time
      (the demo: 0.96, 0.89, 0.75, 0.55 by place at a half of the experts), the first almost always.
    Precision counts every expert named, prefetched or not, so a predictor refused for a while is still judged."""

    def __init__(self, window: int):
        self.window = window                # layer steps in one token
        self.named = self.right = self.asked = self.found = 0
        self.by_place: list[list[int]] = []   # [named, right] by place in a prediction's order

    def precision(self) -> float:
        return (self.right + 1) / (self.named + 2)

    def admit(self) -> bool:
        return self.precision() >= 0.5

    def spare(self) -> int:
        return 0 if self.precision() > (self.found + 1) / (self.asked + 2) else self.window

    def bar(self) -> float:
        q = (self.found + 1) / (self.asked + 2)
        return (1 + q) / (2 + q)

    def admitted(self, named: list) -> list:
        bar, places = self.bar(), self.by_place
        return [e for i, e in enumerate(named)
                if i >= len(places) or (places[i][1] + 1) / (places[i][0] + 2) > bar]

    def scored(self, named, routed):
        """The experts a predictor named for a layer and token (best first), against those the routing then asked
        for."""
        routed = set(routed)
        self.named += len(named)
        self.right += len(routed.intersection(named))
        while len(self.by_place) < len(named):
            self.by_place.append([0, 0])
        for place, e in zip(self.by_place, named):
            place[0] += 1
            place[1] += e in routed

    def asked_for(self, in_memory: bool, guessed: bool):
        """An expert a layer's routing asks for: a guess prefetched for it, or else found in memory or not."""
        if not guessed:
            self.asked += 1
            self.found += in_memory
