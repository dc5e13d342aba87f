"""The schedule: for every preset, per token and MoE layer, which routed experts are served from memory, which wait
on a read in flight, which are read on demand, what a predictor's names prefetch and what the cache evicts.

It is written once and runs on three clocks (docs/layout.md draws them):

  the streamer     workbench/streamer.py       real reads on the reader pool, the engine's compute
  the simulator    experiments/simulate.py     a device profile's reads and a measured compute profile, virtual time
  replay           experiments/traces.py       every read lands at once: hit rates, no timing

A clock starts reads, says whether one has landed (or failed), takes a landed read in, blocks until reads land and
computes. Everything else is decided here: the cache's budget, policy and protection (workbench.cache), which guesses
are admitted (GuessAdmission), demand reads before the predictor's, ready_first or wait_all, and waves of reads when
a layer's experts do not all fit at once.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

from workbench.cache import ExpertCache, GuessAdmission
from workbench.errors import WorkbenchError
from workbench.telemetry import LayerEvent, Telemetry

DEMAND, PREFETCH = 0, 1         # a read's priority: the reader serves demand reads first


class Clock(Protocol):
    def now(self) -> float:
        """The clock's time (replay's stands still)."""

    def issue(self, keys: list, priority: int, step: "LayerStep") -> int:
        """Start reads of `keys` (slots reserved): each key's cache entry becomes its read in flight; bytes read."""

    def flying(self, entry) -> bool:
        """A cache entry whose read has not landed yet."""

    def failed(self, entry) -> bool:
        """A cache entry whose read landed in error (the expert is read again)."""

    def take(self, key, entry, step: "LayerStep") -> bool:
        """The compute thread takes a landed entry in; True if it was a read not taken in before."""

    def wait(self, step: "LayerStep", every: bool) -> list[int]:
        """Block until one of step.pending's reads lands (every: all); the experts landed, in the order taken."""

    def wait_for_slot(self, step: "LayerStep", flying: list) -> None:
        """Block until one of these reads in flight (keys) lands, so that its slot can be evicted."""

    def compute(self, step: "LayerStep", experts: list[int]) -> None:
        """Compute these experts of the layer (in memory together)."""

    def evicted(self, keys: list) -> None:
        """The cache evicted these experts: their memory is free."""


@dataclass
class LayerStep:
    """One MoE layer of one forward: the experts each row routed to and where each stands (ready in memory, a read
    pending, not issued yet), and the event it is recorded in."""
    layer: int
    routed: list                    # per row of the batch: the set of experts it routed to
    tokens: list                    # per row: its token index
    ev: LayerEvent
    work: object = None             # the streamer's compute callable for this layer
    uses: dict = field(default_factory=dict)      # expert -> rows routed to it (the compute's (token, expert) pairs)
    needed: list = field(default_factory=list)
    protect: set = field(default_factory=set)
    ready: list = field(default_factory=list)
    pending: dict = field(default_factory=dict)   # expert -> its read in flight
    backlog: list = field(default_factory=list)   # experts to read once a slot frees

    @property
    def misses(self) -> int:
        return len(self.ev.hit) - sum(self.ev.hit) - self.ev.late


class Schedule:
    def __init__(self, cache: ExpertCache, clock: Clock, counts: Telemetry, order: str = "ready_first"):
        """counts: where the run's reads are counted (demand_reads, prefetch_named / issued / used / wasted)."""
        if order not in ("ready_first", "wait_all"):
            raise WorkbenchError(f"execution {order!r}: choose ready_first or wait_all")
        # the clock (the streamer, a simulation) holds its schedule: the schedule refers back weakly, not in a cycle
        self.cache, self.clock, self.counts = cache, weakref.proxy(clock), counts
        self.wait_all = order == "wait_all"
        self.forget()

    def forget(self):
        """No prefetch outstanding, no prediction pending (a cold start)."""
        self.admission = GuessAdmission(len(self.cache.pools))
        self.prefetched: dict = {}          # key -> (bytes, token it was named for), issued and not yet used
        self.predicted_for: dict = {}       # (layer, token) -> experts a predictor named
        self.to_prefetch: list = []         # ((layer, token), experts) named at this layer, read after its misses
        self.spare, self.guess = 0, True    # what a guess may evict, and whether guesses are made (name)

    # ------------------------------------------------------------ a layer begins

    def begin_layer(self, layer: int, routed: list, tokens: list, ev: LayerEvent) -> LayerStep:
        """A MoE layer routed: per row, its experts (a set) and token index. Scores what was predicted for it."""
        self.cache.step()
        st = LayerStep(layer, routed, tokens, ev)
        for r in routed:
            for e in r:
                st.uses[e] = st.uses.get(e, 0) + 1
        st.needed = sorted(st.uses)
        st.protect = {(layer, e) for e in st.needed}
        ev.routed = st.needed
        if ev.phase == "decode":
            for r, t in zip(routed, tokens):
                named = self.predicted_for.pop((layer, t), None)
                if named:
                    self.admission.scored(named, r)
                    ev.predicted = ev.predicted + named
        return st

    def name(self, token: int, named: dict, certain: bool):
        """What a predictor named at this layer for `token`: {later layer, or (layer, token) of a later token:
        experts}. A prediction that is the routing (certain: oracle, Edge0) evicts as a demand read does; a guess
        only as GuessAdmission admits it."""
        self.spare = 0 if certain else self.admission.spare()
        self.guess = certain or self.admission.admit()
        for target, experts in named.items():
            target = target if isinstance(target, tuple) else (target, token)
            self.predicted_for[target] = experts = list(map(int, experts))
            self.to_prefetch.append((target, experts if certain else self.admission.admitted(experts)))

    # ------------------------------------------------------------ a layer runs

    def run_layer(self, st: LayerStep, low=None):
        """Bring every needed expert into memory and compute each batch in memory together (ready_first: what is
        there, then each arrival; wait_all: one batch). low(): compute that needs no read (a low tier's experts),
        done once the layer's reads are issued."""
        self.look_up(st)
        self.issue_demand(st)
        self.issue_named(st)
        if low is not None:
            t0 = self.clock.now()
            low()
            st.ev.compute_s += self.clock.now() - t0
        if not self.wait_all:
            self.compute(st)
        while st.pending or st.backlog or st.ready:
            if st.pending and (self.wait_all or not st.ready):
                landed = self.clock.wait(st, self.wait_all)
                t0 = self.clock.now()
                for e in landed:
                    st.ev.taken += self.clock.take((st.layer, e), st.pending.pop(e), st)
                    st.ready.append(e)
                st.ev.take_s += self.clock.now() - t0
            self.compute(st)
            self.issue_demand(st)
            if st.backlog and not st.pending:
                self.wait_for_slot(st)

    def look_up(self, st: LayerStep):
        """Each needed expert: a hit (in memory, or a prefetch landed: taken in), late (a prefetch in flight) or a
        miss (to read). Then the prefetches named for this layer and token that it did not route to are waste."""
        t0 = self.clock.now()
        ev, cache, clock, prefetched = st.ev, self.cache, self.clock, self.prefetched
        for e in st.needed:
            key = (st.layer, e)
            ent = cache.get(key)
            guessed = key in prefetched
            self.admission.asked_for(ent is not None, guessed)
            if guessed:
                self.counts.prefetch_used += 1
                del prefetched[key]
            if ent is not None and clock.flying(ent):
                ev.hit.append(False)
                ev.late += 1
                st.pending[e] = ent
                continue
            if ent is not None and clock.failed(ent):
                cache.drop(key)             # a read that failed earlier: read it again
                ent = None
            ev.hit.append(ent is not None)
            if ent is None:
                st.backlog.append(e)
            else:
                ev.taken += clock.take(key, ent, st)
                st.ready.append(e)
        last = max(st.tokens) if ev.phase == "decode" else -1
        for key in [k for k, (_, t) in prefetched.items() if k[0] == st.layer and t <= last]:
            self.counts.prefetch_wasted += 1
            self.counts.wasted_bytes += prefetched.pop(key)[0]
            cache.demote(key)               # named for this layer and not used: the first to go
        ev.take_s += clock.now() - t0

    def issue_demand(self, st: LayerStep):
        """Read the backlog's experts, as many as find a slot (never evicting what the layer still needs)."""
        t0 = self.clock.now()
        keys = []
        while st.backlog and self._slot((st.layer, st.backlog[0]), st.protect):
            keys.append((st.layer, st.backlog.pop(0)))
        if keys:
            st.ev.bytes_read += self.clock.issue(keys, DEMAND, st)
            self.counts.demand_reads += len(keys)
            for k in keys:
                st.pending[k[1]] = self.cache.peek(k)
            st.ev.issue_s += self.clock.now() - t0
            st.ev.submit_s += self.clock.now() - t0     # of issue_s, the demand reads' (in the token's other)
            st.ev.issues += 1
            st.ev.issued += len(keys)

    def issue_named(self, st: LayerStep):
        """The predictor's reads, queued behind the layer's demand reads (a guess: as admitted)."""
        t0 = self.clock.now()
        for (target, token), experts in self.to_prefetch:
            self.counts.prefetch_named += len(experts)
            if not self.guess:
                continue
            t1 = self.clock.now()
            keys = []
            for e in experts:
                key = (target, int(e))
                if key in self.cache or key in keys:
                    continue
                if not self._slot(key, st.protect, self.spare):
                    break
                keys.append(key)
            if keys:
                nbytes = self.clock.issue(keys, PREFETCH, st)
                for k in keys:
                    self.prefetched[k] = (nbytes // len(keys), token)
                self.counts.prefetch_issued += len(keys)
                st.ev.prefetched += len(keys)
                st.ev.issue_s += self.clock.now() - t1
                st.ev.issues += 1
                st.ev.issued += len(keys)
        self.to_prefetch.clear()
        st.ev.router_s += self.clock.now() - t0

    def _slot(self, key, protect, spare: int = 0) -> bool:
        ok = self.cache.reserve(key, None, protect, spare)
        if self.cache.last_evicted:
            self.clock.evicted(self.cache.last_evicted)
        return ok

    def compute(self, st: LayerStep):
        if st.ready:
            es, st.ready = sorted(st.ready), []
            self.clock.compute(st, es)
            st.protect.difference_update((st.layer, e) for e in es)   # done with them: evictable for the next wave

    def wait_for_slot(self, st: LayerStep):
        """Every free slot holds a read in flight (prefetches): wait for one to land, then it can go."""
        flying = [k for k in self.cache.keys() if self.clock.flying(self.cache.peek(k))]
        if not flying:
            raise WorkbenchError(f"layer {st.layer}: no cache slot for expert {st.backlog[0]}: pinned experts fill "
                                 f"the budget")
        self.clock.wait_for_slot(st, flying)
