"""The simulator: a design's decode over a routing trace on a virtual clock, no model run.

    python -m workbench simulate --trace data/traces/demo-tinystories-256.parquet --preset les --budget 0.25 \
        --device ufs22-phone [--shape qwen3.6-35b-a3b] --json

It keeps the engine's own pieces where they carry the logic: the ExpertCache (budget, policy, scope, pins,
protection of in-flight and current-layer experts), the trace's recorded predictions (TraceDrive, as
`bench --routing-trace` uses them) and the pack's read plan (expert byte sizes, contiguous or native layout,
adjacent reads merged as Reader.submit merges them). What is modelled, mirroring ExpertStreamer:

  per MoE layer   clock += dense + router time; the predictor's experts for a later layer are reserved and
                  read; the layer's misses are reserved and read; ready_first computes experts already in
                  memory first, then each in arrival order; wait_all waits for every read, then computes
  reads           a FIFO pool of `workers` reader threads; a (merged) read issued while n reads are in flight
                  takes the device profile's read_s(bytes, n), a large one in pieces on several threads as
                  the engine's reads into slots are (workbench.io.split_sizes); the pool thread then dequantizes
                  each expert of that read (as the streamer's read callback does), so an expert is ready after both
  compute         a measured profile of this engine (ComputeProfile): dense and router time per layer, expert
                  compute per expert, dequant (the packed engine: the crc check) per expert read, other per token,
                  a wake-up per wait that blocked (the compute thread runs again that long after the read lands),
                  and what reads cost the compute thread: an issue (per submit, per expert) and taking each read
                  in (with computing on its fresh bytes), measured in a streaming run of the engine
  speculative     (a preset with speculative n) a step verifies the input token and the trace's recorded draft
                  (up to n tokens) in one batch: the layer reads the union of the batch's experts once; dense and
                  router are charged for one row plus the measured cost of each further row (row_s), expert
                  compute per (token, expert) pair; the accepted draft tokens
                  (where the trace's text continues with them) and the step's own token are produced
  prerouter       Edge0's heads, recorded in the trace, name the next token's experts (prefetched a token ahead)

Not modelled as events: CPU contention between the reader threads and the compute thread (the real run shares
cores; the profile's costs of issuing and taking in reads, measured in a streaming run, carry its average),
page-cache effects (reads are O_DIRECT), Python scheduling jitter. The Belady bound replays the same accesses
with optimal replacement and perfect foresight: its hit rate is the most any policy gets at that budget, and
its tok/s assumes every miss read is hidden behind compute at the device's peak bandwidth.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import statistics
import time
import zlib
from dataclasses import dataclass

import numpy as np

from engines import expert_bytes
from workbench.cache import ExpertCache, GuessAdmission, reserve_ahead, warm_set
from workbench.devices import DeviceProfile
from workbench.errors import WorkbenchError
from workbench.io import split_sizes
from workbench.presets import Budget, CacheScope, Order, Router
from workbench.spec import MoESpec
from workbench.registry import experts_for
from workbench.store.pack import PARTS, _align, _nbytes, expert_kind, expert_kinds   # the pack's own read plan
from workbench.telemetry import rates


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds on the compute thread (dense, router, expert per expert, other per token) and on a reader
    thread (dequant per expert)."""
    dense_s: float            # per MoE layer: attention, norms, and the token's share of embedding/head
    router_s: float           # per MoE layer
    expert_s: float           # per expert computed
    dequant_s: float          # per expert read, at the pack's expert precision
    other_s: float = 0.0      # per token: what the engine spends outside the measured parts
    issue_s: float = 0.0      # per expert read issued: the compute thread's cost of submitting it (reader pool, futures)
    issue_call_s: float = 0.0     # per issue (a layer's demand reads, a predictor's reads for one layer): its fixed cost
    dequant_busy_s: float = 0.0   # per expert, on a reader thread while the compute thread computes (GIL contention)
    reader_holds_gil: bool = True   # the reader's per-expert work takes the compute thread's GIL (numpy's dequant,
                                    # Python reader threads); not the packed engine's GIL-free readers (slot_reads)
    wake_s: float = 0.0       # per blocking wait: from the read it waits for landing to the compute thread running
                              # again (its poll returning, the settle); probe_reader measures it
    land_s: float = 0.0       # per expert read, when the compute thread takes it in (its read settled, its crc
                              # compared, the cache entry made the slot) and computes on its fresh bytes
    row_s: float | None = None    # per MoE layer, dense + router time of each row of a batch after the first
                                  # (speculative verification); None: each row costs what one token does
    engine: str = "numpy"     # the engine measured: what an expert costs in its cache (engines.expert_bytes), so what
                              # a byte budget buys (the packed engine's slots of packed bytes, numpy's f32 experts)
    source: str = ""


@dataclass(frozen=True)
class ReadPlan:
    """How one layer's experts are read: bytes per (merged) read for a run of consecutive expert ids."""
    layout: str               # contiguous | native
    part_bytes: tuple         # encoded bytes of gate, up, down

    def reads(self, experts: list[int]) -> list[tuple[list[int], int]]:
        """[(experts, bytes of one read)]: consecutive ids merge (adjacent in the pack); native: 3 reads per run."""
        runs, out = [], []
        for e in sorted(experts):
            if runs and e == runs[-1][-1] + 1:
                runs[-1].append(e)
            else:
                runs.append([e])
        for run in runs:
            if self.layout == "contiguous":
                out.append((run, len(run) * _align(sum(self.part_bytes))))
            else:
                out += [(run, len(run) * _align(b)) for b in self.part_bytes]
        return out


def read_plan(spec: MoESpec, layout: str, experts: str) -> ReadPlan:
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    kinds = expert_kinds(shapes, experts)
    return ReadPlan(layout, tuple(_nbytes(shapes[p], kinds[p]) for p in PARTS))


class _Read:
    """A cache entry on the virtual clock: in flight until `ready` (ExpertCache asks done()): the read's end, then
    (if it ended while the compute thread held the GIL) the wait for the GIL, then the dequants of its read up to and
    including its own, each at the contended speed if the compute thread was computing when the read ended."""
    __slots__ = ("end", "k", "clock", "dq", "dq_busy", "taken")

    def __init__(self, end: float, clock, k: int = 0, dq: float = 0.0, dq_busy: float = 0.0, taken: bool = False):
        self.end, self.k, self.clock, self.dq, self.dq_busy = end, k, clock, dq, dq_busy
        self.taken = taken          # taken in by the compute thread (ComputeProfile.land_s paid)

    @property
    def ready(self) -> float:
        busy = self.dq_busy and self.clock.working(self.end)
        return self.clock.gil(self.end) + self.k * (self.dq_busy if busy else self.dq)

    def done(self) -> bool:
        return self.ready <= self.clock.now


class _Pool:
    """A FIFO pool of reader threads on the virtual clock."""

    def __init__(self, workers: int, device: DeviceProfile, dequant_s: float, split: bool = True):
        self.workers = workers
        self.free = [0.0] * workers          # when each worker is next free (a heap)
        self.busy: list[tuple[float, float]] = []    # (start, end) of reads, for the depth a new read sees
        self.device, self.dequant_s = device, dequant_s
        self.split = split                   # a large read in pieces on several workers, as the slot readers do
        self.dequants: list[float] = []      # start times of dequants not yet charged to the compute thread

    def submit(self, t: float, groups) -> dict:
        """Issue reads at time t; returns {expert: (end of its read, its place among the read's dequants)}."""
        ready = {}
        for experts, nbytes in groups:
            end = 0.0
            pieces = split_sizes(nbytes, self.workers) if self.split else [nbytes]
            for i, piece in enumerate(pieces):          # the last piece's worker does the read's dequants
                start = max(t, heapq.heappop(self.free))
                depth = 1 + sum(1 for s, e in self.busy if s <= start < e)
                done = start + self.device.read_s(piece, depth)
                self.busy.append((start, done))
                end = max(end, done)
                if i < len(pieces) - 1:
                    heapq.heappush(self.free, done)
            offset = 0.0
            for k, e in enumerate(experts, 1):     # the pool thread dequantizes each expert of the read, in order
                self.dequants.append(end + offset)
                offset += self.dequant_s
                ready[e] = (end, k)
            heapq.heappush(self.free, end + offset)   # (at the uncontended speed: an approximation)
        self.busy = [(s, e) for s, e in self.busy if e > t]
        return ready


class _Clock:
    """The virtual clock and the compute thread's work so far: a read that ends while the compute thread works
    waits for the GIL until the thread's next switch (CPython's switch interval) or the end of that work."""

    def __init__(self, switch_s: float = 0.0):
        self.now, self.switch_s = 0.0, switch_s
        self.starts: list[float] = []
        self.ends: list[float] = []

    def _work_at(self, t: float) -> int:
        import bisect
        i = bisect.bisect_right(self.starts, t) - 1
        return i if i >= 0 and t < self.ends[i] else -1

    def working(self, t: float) -> bool:
        return self._work_at(t) >= 0

    def gil(self, t: float) -> float:
        i = self._work_at(t)
        return min(t + self.switch_s, self.ends[i]) if self.switch_s and i >= 0 else t


class _Position:
    """What the trace drive reads of an engine (its token index, in the hooks' ctx), on the virtual clock."""

    def __init__(self):
        self.token_index = 0

    def step(self, token_index: int, phase: str = "decode") -> dict:
        self.token_index = token_index
        return {"engine": self, "phase": phase}


def _layer_event(layer):
    return dict(layer=layer, hits=0, late=0, misses=0, bytes_read=0, wait_s=0.0, compute_s=0.0)


def simulate_run(drive, spec: MoESpec, preset, budget: str, device: DeviceProfile, compute: ComputeProfile,
                 tokens: int, prompt: int = 4, workers: int = 1, plan: ReadPlan | None = None,
                 shared_cpu: bool = True, switch_s: float | None = None, split: bool = True) -> dict:
    """Prefill `prompt` trace rows (reads only, untimed), then decode `tokens - 1` steps on the virtual clock,
    as `bench` measures: tok_s counts decode steps only. shared_cpu: the numpy engine's dequant (reader threads)
    and compute (its own thread) hold one GIL: a dequant that starts while the compute thread works delays that
    work by the dequant's length (one that starts while it waits costs it nothing) and itself takes the contended
    time (compute.dequant_busy_s); without a measured contended time, a read that ends while the compute thread
    works waits for the GIL instead (switch_s: CPython's switch interval, 0 to ignore). split: a large read goes to
    several readers in pieces (workbench.io.split_sizes), as reads into slots do; the numpy engine's reads do not."""
    plan = plan or read_plan(spec, preset.storage.layout.value, experts_for(preset.storage.experts, compute.engine))
    item, n_experts = expert_bytes(compute.engine, spec, preset.storage), spec.num_experts * len(spec.moe_layers)
    total = item * n_experts
    budget_bytes = Budget(budget).nbytes(item, n_experts)
    cache = ExpertCache(Budget(budget).slots(item, n_experts), item, spec.moe_layers, policy=preset.cache.policy.value,
                        scope=preset.cache.scope.value, min_slots_per_layer=spec.top_k)
    import sys
    # a read that lands while the compute thread computes is dequantized at the contended speed, measured (GIL waits
    # included, so the switch-interval model is then off unless asked for)
    busy = compute.dequant_busy_s if shared_cpu else 0.0
    if switch_s is None:
        switch_s = sys.getswitchinterval() if shared_cpu and not busy else 0.0
    clock = _Clock(switch_s)
    pool = _Pool(workers, device, compute.dequant_s, split)
    resident = budget_bytes >= total
    landed = _Read(-1.0, clock, taken=True)
    if resident:
        for L in spec.moe_layers:
            for e in range(spec.num_experts):
                cache.pin((L, e), landed)
    elif preset.cache.warm:
        for k in warm_set(cache, drive.usage):
            cache.reserve(k, landed)

    pos = _Position()
    predictor = drive.predictor()
    admission, named_for = GuessAdmission(len(spec.moe_layers)), {}     # as the streamer's prefetches
    layers = {L: _layer_event(L) for L in spec.moe_layers}
    n = dict(bytes=0, wait=0.0, issued=0, used=0, predicted=0, demand=0, spec_steps=0, spec_accepted=0)
    prefetched: set = set()

    def work(seconds):
        """The compute thread works `seconds`, plus (shared_cpu) every dequant that takes the GIL from it: one whose
        read ended at t preempts the work at t + switch_s if the work is still going then."""
        start, end = clock.now, clock.now + seconds
        if shared_cpu:
            if clock.ends and start > clock.ends[-1]:       # it waited since its last work: those ran meanwhile
                pool.dequants = [t for t in pool.dequants if t >= start]
            while (mine := [t for t in pool.dequants if t + clock.switch_s < end]):
                pool.dequants = [t for t in pool.dequants if t + clock.switch_s >= end]
                end += len(mine) * compute.dequant_s
        if end > start:
            clock.starts.append(start)
            clock.ends.append(end)
        clock.now = end

    def issue(keys, t, counted):
        work(compute.issue_call_s + compute.issue_s * len(keys))
        t = clock.now
        groups = [(g, b) for L in sorted({k[0] for k in keys})
                  for g, b in [([(L, e) for e in run], nb) for run, nb in plan.reads([k[1] for k in keys if k[0] == L])]]
        ready = pool.submit(t, groups)
        for k in keys:
            cache.set(k, _Read(ready[k][0], clock, ready[k][1], compute.dequant_s, busy))
        if counted:
            n["bytes"] += sum(b for _, b in groups)
        return sum(b for _, b in groups)

    # prefill: every routed expert of the prompt rows, read and landed before decoding starts (untimed)
    ctx = pos.step(0, "prefill")
    for L in spec.moe_layers:
        idx = drive.route(L, np.zeros((prompt, 1)), ctx)[0]
        keys = [(L, int(e)) for e in sorted(set(idx.reshape(-1).tolist())) if (L, int(e)) not in cache]
        for k in keys:
            if not cache.reserve(k, None):
                break
        keys = [k for k in keys if cache.peek(k) is None and k in cache]
        if keys:
            issue(keys, clock.now, False)
        clock.now = max([clock.now] + [cache.peek(k).ready for k in cache.keys(L) if isinstance(cache.peek(k), _Read)])
    t_decode = clock.now
    at_decode = list(cache.keys())                   # what any policy starts decoding with (Belady too)
    for k in at_decode:
        if isinstance(ent := cache.peek(k), _Read):
            ent.taken = True                         # taken in while the prompt ran
    pool.dequants = []                               # the prompt's dequants are done before decoding starts
    steps = max(0, tokens - 1)
    produced, step, n_spec = 0, 1, preset.execution.speculative
    while produced < steps:
        # one decode step: one token, or (speculative) the last token and its draft verified in one batch
        draft, accepted = drive.draft(step, min(n_spec, steps - produced)) if n_spec else ([], 0)
        batch = range(step, step + len(draft) + 1)
        n["spec_steps"] += 1
        n["spec_accepted"] += accepted
        for L in spec.moe_layers:
            ev = layers[L]
            cache.step()
            one = compute.dense_s + compute.router_s
            work(one + (len(batch) - 1) * (one if compute.row_s is None else compute.row_s))
            routed = [set(int(e) for e in drive.route(L, np.zeros((1, 1)), pos.step(b))[0].reshape(-1)) for b in batch]
            uses = {e: sum(e in r for r in routed) for e in set().union(*routed)}     # (token, expert) pairs
            needed = sorted(uses)
            protect = {(L, e) for e in needed}
            for i, b in enumerate(batch):       # the streamer's GuessAdmission judges the names made for here
                if (L, b) in named_for:
                    admission.scored(named_for.pop((L, b)), routed[i])
            named: dict = {}
            for b in batch if predictor is not None else ():
                for target, experts in predictor.predict(L, pos.step(b)).items():
                    # a later layer of this token, or (layer, token) of a later token (Edge0's prerouter)
                    named.setdefault(target[0] if isinstance(target, tuple) else target, []).extend(experts)
                    named_for[target if isinstance(target, tuple) else (target, b)] = list(map(int, experts))
            ready, pending, backlog = [], {}, []

            def take(ent):
                """The compute thread takes a landed read in (once)."""
                if not ent.taken:
                    ent.taken = True
                    work(compute.land_s)

            certain = getattr(predictor, "certain", False)
            spare, guess = (0, True) if certain else (admission.spare(), admission.admit())
            for e in needed:
                k = (L, e)
                ent = cache.get(k)
                admission.asked_for(ent is not None, k in prefetched)
                if k in prefetched:
                    prefetched.discard(k)
                    n["used"] += 1
                if ent is None:
                    backlog.append(e)
                    ev["misses"] += 1
                elif ent.done():
                    ev["hits"] += 1
                    take(ent)
                    ready.append(e)
                else:
                    ev["late"] += 1
                    pending[e] = ent

            def issue_backlog(predicted=False):
                """As the streamer's: the backlog's reads, then (predicted) the predictor's, queued behind them."""
                keys = []
                while backlog and cache.reserve((L, backlog[0]), None, protect):
                    keys.append((L, backlog.pop(0)))
                if keys:
                    n["demand"] += len(keys)
                    ev["bytes_read"] += issue(keys, clock.now, True)
                    for k in keys:
                        pending[k[1]] = cache.peek(k)
                for target, experts in (named.items() if predicted and guess else ()):
                    experts = list(dict.fromkeys(int(e) for e in experts))
                    n["predicted"] += len(experts)
                    then = reserve_ahead(cache, [(target, e) for e in experts], None, protect, spare)
                    if then:
                        issue(then, clock.now, True)
                        prefetched.update(then)
                        n["issued"] += len(then)

            def run(es):
                """One compute call on the experts `es` (in memory together)."""
                t = sum(compute.expert_s * uses[e] for e in es)
                protect.difference_update((L, e) for e in es)
                work(t)
                ev["compute_s"] += t

            issue_backlog(predicted=True)
            if preset.execution.order is Order.READY_FIRST:
                run(ready)
                ready = []
            while pending or backlog or ready:
                if pending and (preset.execution.order is Order.WAIT_ALL or not ready):
                    at = [r.ready for r in pending.values()]
                    until = max(at) if preset.execution.order is Order.WAIT_ALL else min(at)
                    wait = max(0.0, until - clock.now)
                    wait += compute.wake_s if wait > 0 else 0.0    # it slept: it runs again a wake-up later
                    clock.now += wait
                    ev["wait_s"] += wait
                    n["wait"] += wait
                    for e in sorted((e for e, r in pending.items() if r.done()), key=lambda e: pending[e].ready):
                        take(pending.pop(e))
                        ready.append(e)
                run(ready)
                ready = []
                issue_backlog()
                if backlog and not pending:          # every free slot holds a read in flight: wait for one
                    flying = [v.ready for k in cache.keys() if isinstance(v := cache.peek(k), _Read) and not v.done()]
                    if not flying:
                        raise WorkbenchError(f"layer {L}: no cache slot for expert {backlog[0]}: pinned experts fill the budget")
                    wait = min(flying) - clock.now + compute.wake_s
                    clock.now += wait
                    ev["wait_s"] += wait
                    n["wait"] += wait
        work(compute.other_s)
        produced = min(steps, produced + accepted + 1)
        step += accepted + 1
    decode_s = clock.now - t_decode
    hits, late, misses = (sum(r[k] for r in layers.values()) for k in ("hits", "late", "misses"))
    for r in layers.values():
        r.update(rates(r["hits"], r["late"], r["misses"]))
    return {"tok_s": steps / decode_s if decode_s > 0 else float("inf"), **rates(hits, late, misses),
            "hits": hits, "late": late, "misses": misses, "bytes_read": n["bytes"], "bytes_read_per_token": n["bytes"] / max(1, steps),
            "flash_wait_s": n["wait"], "flash_wait_per_token_s": n["wait"] / max(1, steps), "decode_s": decode_s,
            "decode_steps": steps, "prefetch_issued": n["issued"], "prefetch_used": n["used"],
            "experts_read": n["demand"] + n["issued"], "spec_steps": n["spec_steps"], "spec_accepted": n["spec_accepted"],
            "budget_bytes": budget_bytes, "cache_slots": cache.capacity[spec.moe_layers[0]], "cache_at_decode": at_decode,
            "per_layer": [layers[L] for L in spec.moe_layers]}


def belady(drive, spec: MoESpec, preset, budget: str, prompt: int, tokens: int, initial=(),
           engine: str = "numpy") -> dict:
    """Optimal replacement with perfect foresight (Belady's MIN) over the same decode accesses: the fewest experts
    any policy must read at this budget. Its hit rate bounds demand fetching; a prefetching design can show a higher
    hit rate (a prefetch is a read that lands in time), never fewer reads. initial: the experts in memory when
    decoding starts (the prompt's, a warm set), as the design had them; None: the best start any policy could have
    (the first experts decoding asks for, as many as fit), so that the bound holds whatever the prompt left.
    engine: whose cache the budget buys slots in (engines.expert_bytes), for a budget in bytes."""
    slots = Budget(budget).slots(expert_bytes(engine, spec, preset.storage), spec.num_experts * len(spec.moe_layers))
    per_layer = preset.cache.scope is CacheScope.PER_LAYER

    pos = _Position()
    drive.route(spec.moe_layers[0], np.zeros((prompt, 1)), pos.step(0, "prefill"))      # the prompt's rows come first
    seq = []
    for step in range(1, max(0, tokens - 1) + 1):
        ctx = pos.step(step)
        for L in spec.moe_layers:
            seq += [(L, int(e)) for e in sorted(set(drive.route(L, np.zeros((1, 1)), ctx)[0].reshape(-1)))]
    return belady_of(seq, slots // len(spec.moe_layers) if per_layer else slots, per_layer, initial)


def belady_of(seq: list, cap: int, per_layer: bool = False, initial=()) -> dict:
    """Belady's MIN over a sequence of (layer, expert) accesses with `cap` slots (a pool's, per layer or global);
    initial as belady's."""
    nxt, last = [0] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], len(seq) + i)
        last[seq[i]] = i
    pools: dict = {}            # pool -> {key: its next use}, and a max-heap of (-next use, key), stale entries skipped
    first = {}
    for i, k in enumerate(seq):
        first.setdefault(k, i)

    def put(pool, k, use):
        pool[0][k] = use
        heapq.heappush(pool[1], (-use, k))
    for k in (sorted(first, key=first.get) if initial is None else initial):
        pool = pools.setdefault(k[0] if per_layer else 0, ({}, []))
        if len(pool[0]) < cap:
            put(pool, tuple(k), first.get(tuple(k), 2 * len(seq) + 1))
    misses = 0
    for i, k in enumerate(seq):
        pool = pools.setdefault(k[0] if per_layer else 0, ({}, []))
        if k not in pool[0]:
            misses += 1
            if len(pool[0]) >= cap:                    # evict the one used farthest in the future
                while True:
                    use, victim = heapq.heappop(pool[1])
                    if pool[0].get(victim) == -use:
                        del pool[0][victim]
                        break
        put(pool, k, nxt[i])
    return {"belady_hit_rate": 1 - misses / max(1, len(seq)), "belady_misses": misses, "accesses": len(seq)}


def simulable(p):
    """The preset, if the simulator can replay it: a trace records exact routing (what a predictor named is
    replayed as prefetches, LES's speculative verification as the batch's union of experts)."""
    if p.routing.router is not Router.EXACT:
        raise WorkbenchError(f"simulate: preset {p.name} changes routing; the trace replays exact routing (to replay "
                             f"what its predictor named as prefetches, pass another preset and --predictor)")
    return p


def run(trace_path: str, preset, budget: str | None, device: str, shape: str | None = None,
        tokens: int = 64, prompt: int = 4, compute: ComputeProfile | None = None, workers: int | None = None,
        model: str | None = None, record: bool = True, spec: MoESpec | None = None, rung: dict | None = None,
        predictor: str | None = None, engine: str | None = None) -> dict:
    """One design over a trace. The simulated model: `spec` if given, else the traced model at `shape`'s expert
    shape, else the traced model itself. preset: a name or a Preset (a ladder rung). rung: {ladder, rung,
    rung_index, model} for the run record, so the dashboard's ladders page shows a simulated ladder beside the rest.
    engine: whose compute is measured (None: the default engine), unless `compute` is given: its engine's."""
    from workbench import devices
    from workbench.presets import get_preset
    from experiments.routing_trace import TraceDrive
    from experiments.traces import read_trace
    p = get_preset(preset) if isinstance(preset, str) else preset
    if predictor:
        p = p.with_(predictor=predictor)
    p = simulable(p)
    budget = str(budget if budget is not None else p.cache.budget)
    dev = devices.load(device) if isinstance(device, str) else device     # a name, a profile, or devices.Slowest
    trace = read_trace(trace_path)          # read once: its metadata here, its rows in the drive
    meta = trace["meta"]
    note = "the given model's shape" if spec else "the traced model's shape"
    spec = spec or MoESpec.from_dict(meta["spec"])
    if shape:
        spec, note = shape_spec(shape, meta, spec)
    if compute is not None and engine is not None and engine != compute.engine:
        raise WorkbenchError(f"--engine {engine}: the compute profile given was measured on the {compute.engine} "
                             f"engine")
    drive = TraceDrive(trace_path, spec, str(p.prefetch) or None, trace=trace)
    own = model is None or model == meta.get("model")        # the traced model: measured on its own trace
    compute = compute or measure_compute(model or meta.get("model") or "demo", spec, p.storage.experts, preset=p,
                                         routing_trace=str(trace_path) if own else None, engine=engine)
    workers = workers or dev.queue_depth
    plan = read_plan(spec, p.storage.layout.value, experts_for(p.storage.experts, compute.engine))
    res = simulate_run(drive, spec, p, budget, dev, compute, tokens, prompt, workers, plan=plan,
                       shared_cpu=compute.reader_holds_gil, split=not compute.reader_holds_gil)
    bound = belady(drive, spec, p, budget, prompt, tokens, initial=res.pop("cache_at_decode"), engine=compute.engine)
    compute_s = res["decode_steps"] * (len(spec.moe_layers) * (compute.dense_s + compute.router_s
                                                                + spec.top_k * compute.expert_s) + compute.other_s)
    miss_bytes = bound["belady_misses"] * sum(plan.part_bytes)
    bound["belady_tok_s"] = res["decode_steps"] / max(compute_s, miss_bytes / dev.peak_bw)
    res.update(bound, simulated=True, emulated=False, device=dev.describe(), preset=p.name, budget=budget,
               shape=shape, shape_note=note, spec=spec.to_dict(), reader_workers=workers,
               compute_profile=dataclasses.asdict(compute), routing_trace=drive.source, tokens=tokens, prompt=prompt,
               expert_disk_bytes=sum(plan.part_bytes))
    res["device"]["emulated"] = False
    res["device"]["simulated"] = True
    if record:
        from workbench.runs import write_run
        cfg = {"simulated": True, "trace": str(trace_path), "preset": p.to_dict(), "budget": budget, "device": device,
               "shape": shape, "spec": spec.to_dict(), "compute_profile": dataclasses.asdict(compute), "tokens": tokens,
               **(rung or {})}
        res["run"] = str(write_run(f"sim-{p.name}", cfg, {k: v for k, v in res.items() if k != "per_layer"},
                                   res["per_layer"], []))
    return res


def shape_spec(shape: str, meta: dict, traced: MoESpec) -> tuple[MoESpec, str]:
    """The traced model's layers at a real model's expert shape, experts r-fold as make-model --experts would."""
    from workbench.shapes import SHAPES
    if shape not in SHAPES:
        raise WorkbenchError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    k = s["num_experts_per_tok"]
    r = k // meta["top_k"] if k % meta["top_k"] == 0 else 0
    if not r or r * meta["num_experts"] > s["num_experts"]:
        raise WorkbenchError(f"--shape {shape}: top-{k} is not a multiple of the trace's top-{meta['top_k']} "
                             f"within {s['num_experts']} experts")
    spec = dataclasses.replace(traced, hidden_size=s["hidden_size"], moe_intermediate_size=s["moe_intermediate_size"],
                               top_k=k, num_experts=r * meta["num_experts"], num_heads=s["num_attention_heads"],
                               num_kv_heads=s["num_key_value_heads"], head_dim=s["head_dim"])
    return spec, (f"{shape}'s expert shape (d {s['hidden_size']}, moe ff {s['moe_intermediate_size']}, top-{k}; "
                  f"{s['num_attention_heads']}/{s['num_key_value_heads']} heads of {s['head_dim']}) with "
                  f"{r * meta['num_experts']} experts ({r} x the trace's) on the trace's {len(traced.moe_layers)} MoE layers")


def measure_compute(model: str, spec: MoESpec, experts: str, tokens: int = 16, engine: str | None = None,
                    preset=None, routing_trace: str | None = None, stream_budget: str = "0.5") -> ComputeProfile:
    """This engine's compute, measured in two runs of the model as `preset` (None: resident), driven by
    `routing_trace` if given (as the runs it predicts are):
      every expert in memory   dense, router (the predictor's naming inside) and other time per layer and token,
                               expert compute per expert on bytes in memory
      at `stream_budget`       what reading costs the compute thread, from the streamer's own timers: an issue (per
                               submit and per expert, fitted over the layers' issues), taking a landed read in (less
                               what a layer's look at its experts costs with every one in memory), and computing
                               on bytes just read instead of bytes long in memory (per expert read)
    Expert compute and what a reader thread does per expert are then timed on this spec's expert shape with the
    engine's own kernels: the numpy engine's matmuls and codec (dequant), or the packed engine's compiled kernels on
    the encoded bytes, one call per layer's top-k, and the crc its readers check (`dequant_s` is then that check)."""
    from experiments.routing_trace import drive
    from workbench.presets import get_preset
    from workbench.session import open_session
    from workbench.store import quant
    p = get_preset(preset or "resident") if isinstance(preset or "resident", str) else preset
    p = p.with_(experts=experts, speculative=0)     # a batch's rows: _row_cost
    runs, row = {}, None
    for budget in ("all", stream_budget):
        with open_session(model, p, budget, prompt=[1, 2, 3, 4], tokens=tokens, drive=drive(routing_trace),
                          engine=engine) as s:
            if budget == "all":     # warm-up, as bench's: kernels compiled or loaded untimed (the streaming run
                s.generate([1, 2, 3, 4], tokens=4)      # after it needs none, and would find the same experts cached)
                s.reset_telemetry()
            s.generate([1, 2, 3, 4], tokens=tokens)
            runs[budget] = ([t for t in s.tel.tokens if t.phase == "decode"],
                            [e for e in s.tel.events if e.phase == "decode"])
            if budget == "all" and not routing_trace:
                row = _row_cost(s)
            measured_model, mlp, name = s.spec, s.engine.mlp, s.engine.name
    dec, evs = runs["all"]
    nl, steps = len(measured_model.moe_layers), max(1, len(dec))
    dense = (sum(t.compute_s for t in dec) - sum(e.compute_s for e in evs)) / steps / nl
    router = sum(e.router_s for e in evs) / max(1, len(evs))
    other = sum(t.other_s + t.flash_wait_s + t.dequant_s for t in dec) / steps
    expert_measured = sum(e.compute_s for e in evs) / max(1, sum(len(e.routed) for e in evs))
    issue_call, issue, land = _read_costs(evs, runs[stream_budget][1], expert_measured)
    rng = np.random.default_rng(0)
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    w = {"gate": rng.standard_normal((ff, d), dtype=np.float32) * 0.02,
         "up": rng.standard_normal((ff, d), dtype=np.float32) * 0.02,
         "down": rng.standard_normal((d, ff), dtype=np.float32) * 0.02}
    packed = name == "packed"
    kernel = (lambda d_, ff_: _packed_time(d_, ff_, experts, spec.top_k)) if packed else (lambda d_, ff_: _mlp_time(mlp, d_, ff_))
    expert = expert_measured
    if (measured_model.hidden_size, measured_model.moe_intermediate_size) != (d, ff):
        # another expert shape: the kernel timed at both shapes, the engine's per-expert overhead carried over
        expert += kernel(d, ff) - kernel(measured_model.hidden_size, measured_model.moe_intermediate_size)
    reps = 20
    enc = {p: (quant.encode(w[p], expert_kind(w[p].shape, experts)) if expert_kind(w[p].shape, experts) != "bf16"
               else None) for p in PARTS}
    reader_work = (lambda: _crc(enc)) if packed else (lambda: _dequant(enc, w, experts))
    t0 = time.perf_counter()
    for _ in range(reps):
        reader_work()
    deq = (time.perf_counter() - t0) / reps
    if measured_model.to_dict() != spec.to_dict():
        # another shape: attention projections and the router timed at both shapes, the difference added
        dense += _dense_time(spec) - _dense_time(measured_model)
        if row is not None:
            row = max(0.0, row + _row_time(spec) - _row_time(measured_model))
        router += _matvec_time(spec.num_experts, spec.hidden_size) - _matvec_time(measured_model.num_experts,
                                                                                  measured_model.hidden_size)
    from workbench import slot_reads
    return ComputeProfile(dense_s=dense, router_s=router, expert_s=expert, dequant_s=deq, other_s=other, issue_s=issue,
                          issue_call_s=issue_call, land_s=land, row_s=row,
                          reader_holds_gil=not (packed and slot_reads.AVAILABLE), engine=name,
                          dequant_busy_s=_contended(reader_work, (lambda: kernel(d, ff)) if packed else lambda: mlp(
                              np.ones((1, d), np.float32), w["gate"], w["up"], w["down"])),
                          source=f"measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on this machine (shared, "
                                 f"loaded), {name} engine: {model} as {p.name}{' (routing trace)' if routing_trace else ''} with "
                                 f"every expert in memory for dense/router/other, at budget {stream_budget} for "
                                 f"issues and reads taken in (the streamer's timers, {p.storage.layout.value} "
                                 f"layout); expert and {experts} "
                                 f"{'crc check' if packed else 'dequant'} at d={d}, ff={ff} with the engine's kernels")


def compute_from_run(res: dict, spec: MoESpec, measured: ComputeProfile) -> ComputeProfile:
    """The compute thread's profile of one measured `bench` run (its per-layer expert compute, dense, router and
    other time per token), with dequant per expert from `measured`: simulating with it checks only the flash
    model (reads, waits, overlap), not the compute measurement."""
    n, nl = max(1, res["decode_steps"]), len(spec.moe_layers)
    layers = res["per_layer"]
    moe = sum(r["compute_s"] for r in layers)
    return ComputeProfile(dense_s=(res["compute_s"] - moe) / n / nl, router_s=res["router_s"] / n / nl,
                          expert_s=moe / max(1, sum(r["routed"] for r in layers)), dequant_s=measured.dequant_s,
                          dequant_busy_s=measured.dequant_busy_s, reader_holds_gil=measured.reader_holds_gil,
                          engine=measured.engine,
                          other_s=res["other_s"] / n, issue_s=0.0, wake_s=measured.wake_s,
                          source="the measured run's own compute, router and other time (issue cost inside them)")


def _dequant(enc, w, experts):
    """As Pack.decode_expert: the checksum, then the codec, for each part."""
    from workbench.store import quant
    for p in PARTS:
        if enc[p] is not None:
            zlib.crc32(enc[p])
            quant.decode(enc[p], w[p].shape, expert_kind(w[p].shape, experts))


def _crc(enc):
    """What the packed engine's reader thread does per expert (Pack.decode_expert(raw=True)): the checksum."""
    crc = 0
    for p in PARTS:
        if enc[p] is not None:
            crc = zlib.crc32(enc[p], crc)
    return crc


def _packed_time(d: int, ff: int, experts: str, k: int, reps: int = 10) -> float:
    """Per expert: the packed engine's kernel (engines/packed_kernels.moe_layer) on k experts' encoded bytes in
    one call, as the engine calls it per layer."""
    from engines import packed_kernels as K
    from workbench.store import quant
    rng = np.random.default_rng(0)
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    kinds = {p: expert_kind(shapes[p], experts) for p in PARTS}
    parts, nbytes = K.expert_parts(shapes, kinds)
    slot = np.concatenate([quant.encode(rng.standard_normal(shapes[p], dtype=np.float32) * 0.02, kinds[p]) for p in PARTS])
    arena = np.tile(slot, k)
    off, idx = np.arange(k, dtype=np.int64) * nbytes, np.arange(k, dtype=np.int64)
    X, Y, w = np.ones((1, d), np.float32), np.empty((k, d), np.float32), np.ones(k, np.float32)
    call = lambda: K.moe_layer(arena, off, np.zeros(k, np.int64), idx, w, X, Y, parts, d, ff, K.F16)
    call()                                           # compiled (cached) before timing
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t0) / reps / k


def _contended(dequant, compute, n: int = 40) -> float:
    """Mean time of `dequant` on a second thread while this engine's expert compute runs without pause on another:
    what a reader thread's dequant takes in a ready-first design (GIL waits and all), measured."""
    import threading
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            compute()
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            dequant()
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        t.join()
    return float(np.mean(times))


def _matvec_time(rows: int, cols: int, reps: int = 20, tokens: int = 1) -> float:
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.02
    x = np.ones((tokens, cols), np.float32)
    t0 = time.perf_counter()
    for _ in range(reps):
        x @ w.T
    return (time.perf_counter() - t0) / reps


def _dense_time(spec: MoESpec, tokens: int = 1) -> float:
    """The attention projections of one layer for `tokens` tokens (q, k, v, o)."""
    q, kv, d = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    t = lambda r, c: _matvec_time(r, c, tokens=tokens)
    return t(q, d) + 2 * t(kv, d) + t(d, q)


def _row_time(spec: MoESpec, rows: int = 5) -> float:
    """What each token after the first adds to one layer's attention projections in a batch of `rows`."""
    return (_dense_time(spec, rows) - _dense_time(spec)) / (rows - 1)


def _mlp_time(mlp, d: int, ff: int, reps: int = 20) -> float:
    rng = np.random.default_rng(0)
    g, u, dn = (rng.standard_normal(s, dtype=np.float32) * 0.02 for s in ((ff, d), (ff, d), (d, ff)))
    x = rng.standard_normal((1, d), dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(reps):
        mlp(x, g, u, dn)
    return (time.perf_counter() - t0) / reps


def _row_cost(s, rows: int = 5, reps: int = 8) -> float:
    """Per MoE layer, what each row after the first adds to a decode step's dense and router time (a speculative
    batch of `rows`, the LES ladder's 1 + 4): decode steps of 1 and of `rows` tokens at the session's position, the
    KV cache truncated back after each, medians."""
    e, tel, nl = s.engine, s.tel, len(s.spec.moe_layers)
    took = {1: [], rows: []}
    for _ in range(reps):
        for n in took:
            pos, n_ev = e.pos, len(tel.events)
            s.step([1] * n, "decode")
            e.truncate(pos)
            evs, tok = tel.events[n_ev:], tel.tokens[-1]
            took[n].append((tok.compute_s - sum(v.compute_s for v in evs) + tok.router_s) / nl)
    return max(0.0, (statistics.median(took[rows]) - statistics.median(took[1])) / (rows - 1))


def _read_costs(resident_events, stream_events, expert_s: float) -> tuple[float, float, float]:
    """(per issue, per expert issued, per expert read taken in and computed) from the streamer's own timers in a
    streaming run (telemetry.LayerEvent), less what the same layers cost with every expert in memory. The issue's
    two costs: a line through the median time of a layer's one submit of n experts, for each n."""
    by_n: dict = {}             # experts in a layer's one submit -> its times (the median resists a stall)
    for e in stream_events:
        if e.issues == 1:
            by_n.setdefault(e.issued, []).append(e.issue_s)
    per_call = per_expert = 0.0
    by_n = {k: v for k, v in by_n.items() if len(v) >= 3} or by_n     # a size seen once or twice: a stall decides it
    if by_n:
        n = np.array(sorted(by_n), float)
        med = np.array([statistics.median(by_n[k]) for k in sorted(by_n)])
        w = np.sqrt([len(by_n[k]) for k in sorted(by_n)])
        if len(n) > 1:
            per_expert, per_call = np.linalg.lstsq(np.c_[n, np.ones_like(n)] * w[:, None], med * w, rcond=None)[0]
        if len(n) == 1 or per_expert < 0 or per_call < 0:      # one size, or a fit that makes no sense: per expert
            per_call, per_expert = 0.0, float(np.sum(med * w ** 2) / np.sum(n * w ** 2))
    taken = sum(e.taken for e in stream_events)
    look = sum(e.take_s for e in resident_events) / max(1, len(resident_events))
    take = sum(e.take_s for e in stream_events) - look * len(stream_events)
    fresh = sum(e.compute_s for e in stream_events) - expert_s * sum(len(e.routed) for e in stream_events)
    return float(per_call), float(per_expert), max(0.0, (take + fresh) / taken) if taken else 0.0


def load_compute(path) -> ComputeProfile:
    d = json.loads(open(path).read())
    if "slots" in d:                        # a profile written before it named its engine
        d["engine"] = "packed" if d.pop("slots") else "numpy"
    return ComputeProfile(**d)
