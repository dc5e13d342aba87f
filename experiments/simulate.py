"""The simulator: a design's decode over a routing trace on a virtual clock, no model run; and replay, the same on
a clock where every read lands at once.

    python -m workbench simulate --trace data/traces/demo-tinystories-256.parquet --preset les --budget 0.25 \
        --device ufs22-phone [--shape qwen3.6-35b-a3b] --json
    python -m workbench replay data/traces/demo-tinystories-256.parquet --preset on_demand,les,smol --budget 0.25

Replay: each preset's schedule over the trace's routing and its recorded predictions, no timing: hit rates with no
late prefetches, exact recall and precision, reads per token, and Belady's bound at the same budget, over the
window simulate and bench take (`--prompt-tokens` rows, then `--tokens` - 1 decode steps, from row `--skip`).

What is decided is the engine's own code: the schedule (workbench.schedule: hits, late prefetches, misses, the
predictor's reads, ready_first or wait_all, waves) over the ExpertCache, the trace's recorded predictions
(TraceDrive, as `bench --routing-trace` uses them) and the pack's read plan (expert byte sizes, contiguous or
native layout, adjacent reads merged as Reader.submit merges them; a GGUF read in place: its own blocks, each
layer's). What is modelled is the clock it runs on:

  per MoE layer   clock += dense + router time, then the schedule's layer
  reads           a FIFO pool of `workers` reader threads; a (merged) read issued while n reads are in flight
                  takes the device profile's read_s(bytes, n), a large one in pieces on several threads as
                  the engine's reads into slots are (workbench.io.split_sizes); the pool thread then dequantizes
                  each expert of that read (as the streamer's read callback does), so an expert is ready after both
  compute         a measured profile of this engine (experiments.compute_profile): dense and router time per layer, expert
                  compute per expert, dequant (the packed engine: the crc check) per expert read, other per token,
                  a wake-up per wait that blocked (the compute thread runs again that long after the read lands),
                  and what reads cost the compute thread: an issue (per submit, per expert; then what the
                  readers it woke take from the cores the compute thread shares, on its work once the submit's
                  reads have landed: not hidden behind them) and taking each read in (with computing on its
                  fresh bytes), measured in streaming runs of the engine
  speculative     (a preset with speculative n) a step verifies the input token and the trace's recorded draft
                  (up to n tokens; with draft=modelled:A, the trace's next n tokens accepted as
                  runtime.speculative.ModelledAcceptance draws, as a measured run draws them) in one batch: the
                  layer reads the union of the batch's experts once; dense and router are charged for one row plus
                  the measured cost of each further row (row_s), expert compute per expert plus the measured cost
                  of each further row it computes (expert_row_s); the accepted draft tokens (where the trace's text
                  continues with them) and the step's own token are produced; a real draft's own time
                  (compute.draft_s a draft token, measured in its run) is charged before the batch
  prerouter       Edge0's heads, recorded in the trace, name the next token's experts (prefetched a token ahead)

  runs here       (this-machine, or --here: the device emulated on this machine) every read takes at least what
                  the reads of a streaming run of the engine took here (ComputeProfile.read_floor: an idle reader's
                  start after a submit, a read's latency and bandwidth alone and beside another, from the readers'
                  own stamps: workbench.devices.ServedReads), where the readers share the cores
                  with the compute thread and whatever else runs; the result is labelled as simulate --calibrate
                  found this machine (experiments/calibration.py), or "uncalibrated"

Not modelled as events: CPU contention between the reader threads and the compute thread (the real run shares
cores; the profile's costs of issuing and taking in reads and its read floor, measured in a streaming run, carry
its average),
page-cache effects (reads are O_DIRECT), Python scheduling jitter. The Belady bound replays the same accesses
with optimal replacement and perfect foresight: its hit rate is the most any policy gets at that budget, and
its tok/s assumes every miss read is hidden behind compute at the device's peak bandwidth.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import sys
from dataclasses import dataclass

import numpy as np

from engines import slot_bytes
from experiments.compute_profile import ComputeProfile, measure_compute
from runtime.speculative import ModelledAcceptance, modelled_acceptance
from workbench.cache import CachePlan
from workbench.devices import DeviceProfile
from workbench.errors import WorkbenchError
from workbench.io import split_sizes
from workbench.presets import Router
from workbench.spec import MoESpec
from workbench.registry import experts_for
from workbench.store.pack import PARTS, _align, _nbytes, expert_kinds, expert_shapes   # the pack's own read plan
from workbench.schedule import LayerStep, Schedule
from workbench.summary import Memory, Reads, RunSummary, TimeSplit
from workbench.telemetry import LayerEvent, Telemetry


@dataclass(frozen=True)
class ReadPlan:
    """How one layer's experts are read: bytes per (merged) read for a run of consecutive expert ids."""
    layout: str               # contiguous | native
    part_bytes: tuple         # encoded bytes of gate, up, down
    layers: dict | None = None    # MoE layer -> its part bytes, where layers differ (a GGUF's own mix of blocks)
    item: int = 0             # what one expert costs in the engine's cache, where a pack says (0: sized from the
                              # preset's storage, engines.slot_bytes)

    @property
    def disk_bytes(self):
        """An expert's encoded bytes (the mean over the layers, where they differ)."""
        if not self.layers:
            return sum(self.part_bytes)
        return sum(map(sum, self.layers.values())) / len(self.layers)

    def reads(self, experts: list[int], layer: int | None = None) -> list[tuple[list[int], int]]:
        """[(experts, bytes of one read)]: consecutive ids merge (adjacent in the pack); native: 3 reads per run."""
        part_bytes = self.layers.get(layer, self.part_bytes) if self.layers else self.part_bytes
        runs, out = [], []
        for e in sorted(experts):
            if runs and e == runs[-1][-1] + 1:
                runs[-1].append(e)
            else:
                runs.append([e])
        for run in runs:
            if self.layout == "contiguous":
                out.append((run, len(run) * _align(sum(part_bytes))))
            else:
                out += [(run, len(run) * _align(b)) for b in part_bytes]
        return out


def read_plan(spec: MoESpec, layout: str, experts: str) -> ReadPlan:
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    shapes = expert_shapes(d, ff)
    kinds = expert_kinds(shapes, experts)
    return ReadPlan(layout, tuple(_nbytes(shapes[p], kinds[p]) for p in PARTS))


def pack_plan(pack, engine: str) -> ReadPlan:
    """How a pack's experts are read, each layer's as the pack stores them, and what one costs in `engine`'s
    cache: for a model whose storage is its own (a GGUF streamed in place), not the preset's."""
    sizes = {L: tuple(_nbytes(pack.expert_shapes[p], pack.kinds_of(L)[p]) for p in PARTS) for L in pack.spec.moe_layers}
    counts = list(sizes.values())
    common = max(set(counts), key=counts.count)
    return ReadPlan(pack.layout, common, sizes if len(set(counts)) > 1 else None, slot_bytes(engine, pack))


class _Read:
    """A cache entry on the virtual clock: in flight until `ready` (ExpertCache asks done()): the read's end, then
    (if it ended while the compute thread held the GIL) the wait for the GIL, then the dequants of its read up to and
    including its own, each at the contended speed if the compute thread was computing when the read ended."""
    __slots__ = ("end", "k", "clock", "dq", "dq_busy", "taken", "_ready")

    def __init__(self, end: float, clock, k: int = 0, dq: float = 0.0, dq_busy: float = 0.0, taken: bool = False):
        self.end, self.k, self.clock, self.dq, self.dq_busy = end, k, clock, dq, dq_busy
        self.taken = taken          # taken in by the compute thread (ComputeProfile.land_s paid)
        self._ready = None

    @property
    def ready(self) -> float:
        if self._ready is not None:
            return self._ready
        busy = self.dq_busy and self.clock.working(self.end)
        ready = self.clock.gil(self.end) + self.k * (self.dq_busy if busy else self.dq)
        if self.end < self.clock.now:       # every work that started by the read's end is on the clock: final
            self._ready = ready
        return ready

    def done(self) -> bool:
        return self.ready <= self.clock.now


class _Pool:
    """A FIFO pool of reader threads on the virtual clock."""

    def __init__(self, workers: int, device: DeviceProfile, dequant_s: float, split: bool = True,
                 wake_s: float = 0.0, polling: tuple[float, float] = (0.0, 0.0)):
        self.workers = workers
        self.wake_s = wake_s                 # a sleeping reader starts a read this long after its submit call returns
        self.polling = polling               # (window, wake): a reader that landed a read less than window ago polls
                                             # for the next, and starts the first read of a submit wake after it
        self.free = [-math.inf] * workers    # when each worker is next free (a heap; never read: asleep)
        self.busy: list[tuple[float, float]] = []    # (end, start) of reads, a heap: the depth a new read sees
        self.device, self.dequant_s = device, dequant_s
        self.split = split                   # a large read in pieces on several workers, as the slot readers do
        self.dequants: list[float] = []      # start times of dequants not yet charged to the compute thread

    def submit(self, t: float, groups) -> dict:
        """Issue reads at time t; returns {expert: (end of its read, its place among the read's dequants)}."""
        ready, polled = {}, False
        while self.busy and self.busy[0][0] <= t:       # ended before any read of this submit starts
            heapq.heappop(self.busy)
        for experts, nbytes in groups:
            end = 0.0
            pieces = split_sizes(nbytes, self.workers) if self.split else [nbytes]
            for i, piece in enumerate(pieces):          # the last piece's worker does the read's dequants
                start, polls = self._start(t, polled)
                polled = polled or polls
                depth = 1 + sum(1 for e, s in self.busy if s <= start < e)
                done = start + self.device.read_s(piece, depth)
                heapq.heappush(self.busy, (done, start))
                end = max(end, done)
                if i < len(pieces) - 1:
                    heapq.heappush(self.free, done)
            offset = 0.0
            for k, e in enumerate(experts, 1):     # the pool thread dequantizes each expert of the read, in order
                self.dequants.append(end + offset)
                offset += self.dequant_s
                ready[e] = (end, k)
            heapq.heappush(self.free, end + offset)   # (at the uncontended speed: an approximation)
        return ready

    def _start(self, t: float, polled: bool) -> tuple[float, bool]:
        """When a read submitted at t starts, and whether a polling reader took it: a busy reader's next read as
        it lands its last; an idle one's (the one that landed a read last: it polls, if any does) a wake-up later."""
        idle = [f for f in self.free if f <= t]
        if not idle:
            return heapq.heappop(self.free), False
        free = max(idle)
        self.free.remove(free)
        heapq.heapify(self.free)
        window, wake = self.polling
        polls = not polled and t - free < window
        return t + (wake if polls else self.wake_s), polls


class _Clock:
    """The virtual clock and the compute thread's work so far: a read that ends while the compute thread works
    waits for the GIL until the thread's next switch (CPython's switch interval) or the end of that work."""

    def __init__(self, switch_s: float = 0.0):
        self.now, self.switch_s = 0.0, switch_s
        self.starts: list[float] = []
        self.ends: list[float] = []

    def _work_at(self, t: float) -> int:
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


class _Simulation:
    """One simulated run: the schedule (workbench.schedule) on the virtual clock, its reads on a pool of reader
    threads and its compute as the profile measured it. Prefill, then per decode step and MoE layer: route, name
    ahead, and the schedule's layer (simulate_run)."""

    def __init__(self, drive, spec: MoESpec, preset, budget: str, device: DeviceProfile, compute: ComputeProfile,
                 workers: int, plan: ReadPlan | None, shared_cpu: bool, switch_s: float | None, split: bool,
                 readers=None, acceptance=None):
        self.drive, self.spec, self.preset, self.profile = drive, spec, preset, compute
        a = modelled_acceptance(preset.execution.draft) if preset.execution.speculative else None
        # a modelled draft: a measured run's acceptance replayed, or A's draws; else the trace's recorded drafts
        self.acceptance = (acceptance or ModelledAcceptance(a)) if a is not None else None
        if preset.execution.speculative and a is None and preset.execution.draft != "lookup":
            raise WorkbenchError(f"draft={preset.execution.draft}: a simulated run replays the trace's recorded "
                                 f"prompt-lookup drafts (draft=lookup) or a modelled acceptance (draft=modelled:A)")
        self.instant = device is INSTANT
        self.plan = plan or read_plan(spec, preset.storage.layout.value, experts_for(preset.storage.experts, compute.engine))
        item = self.plan.item or slot_bytes(compute.engine, spec, preset.storage)
        n_experts = spec.num_experts * len(spec.moe_layers)
        self.cache_plan = CachePlan.of(preset, spec, budget, item)
        self.budget_bytes = self.cache_plan.budget_bytes
        self.cache = self.cache_plan.cache()
        # a read that lands while the compute thread computes is dequantized at the contended speed, measured (GIL
        # waits included, so the switch-interval model is then off unless asked for)
        self.shared_cpu = shared_cpu
        self.busy = compute.dequant_busy_s if shared_cpu else 0.0
        if switch_s is None:
            switch_s = sys.getswitchinterval() if shared_cpu and not self.busy else 0.0
        self.clock = _Clock(switch_s)
        self.slowed: list = []      # (when, seconds): what a submit's readers take from the compute thread, due once
                                    # its reads have landed (a heap)
        self.pool = _Pool(workers, device, compute.dequant_s, split, *(
            (readers.wake_s, (readers.poll_s, readers.wake_polling_s)) if readers else ()))
        self.fill(item * n_experts)
        self.pos = _Position()
        self.predictor = drive.predictor()
        self.counts = Telemetry(len(spec.moe_layers))
        self.schedule = Schedule(self.cache, self, self.counts, preset.execution.order.value)
        self.n = dict(bytes=0, wait=0.0, spec_steps=0, spec_accepted=0)

    def fill(self, total: int):
        """What is in memory before the prompt: every expert (all-resident), else the design's warm set."""
        landed = _Read(-1.0, self.clock, taken=True)
        if self.budget_bytes >= total:
            for L in self.spec.moe_layers:
                for e in range(self.spec.num_experts):
                    self.cache.pin((L, e), landed)
        elif (start := self.cache_plan.start(self.cache, self.drive.usage)) is not None:
            pinned, warm = start
            for k in pinned:
                self.cache.pin(k, landed)
            for k in warm:
                self.cache.reserve(k, landed)

    # ------------------------------------------------------------ the compute thread and the reader pool

    def work(self, seconds: float, slowed: bool = True):
        """The compute thread works `seconds`, plus (slowed) what the readers of each submit whose reads have landed
        by the work's end took from its cores, plus (shared_cpu) every dequant that takes the GIL from it: one whose
        read ended at t preempts the work at t + switch_s if the work is still going then."""
        clock, pool = self.clock, self.pool
        start, end = clock.now, clock.now + seconds
        while slowed and self.slowed and self.slowed[0][0] < end:       # due before or during this work
            end += heapq.heappop(self.slowed)[1]
        if self.shared_cpu:
            if clock.ends and start > clock.ends[-1]:       # it waited since its last work: those ran meanwhile
                pool.dequants = [t for t in pool.dequants if t >= start]
            while (mine := [t for t in pool.dequants if t + clock.switch_s < end]):
                pool.dequants = [t for t in pool.dequants if t + clock.switch_s >= end]
                end += len(mine) * self.profile.dequant_s
        if end > start:
            clock.starts.append(start)
            clock.ends.append(end)
        clock.now = end

    def submit(self, keys: list, counted: bool) -> int:
        """Submit reads of `keys` (slots reserved): the compute thread pays the issue, the pool reads them in merged
        runs; returns the bytes read."""
        c = self.profile
        groups = [(g, b) for L in sorted({k[0] for k in keys})
                  for g, b in [([(L, e) for e in run], nb)
                               for run, nb in self.plan.reads([k[1] for k in keys if k[0] == L], L)]]
        if self.instant:        # replay's clock: the reads land as they are issued, and nothing else happens
            for k in keys:
                self.cache.set(k, _Read(self.clock.now, self.clock))
        else:
            self.work(c.issue_call_s + c.issue_s * len(keys), slowed=False)     # submits follow each other at once
            ready = self.pool.submit(self.clock.now, groups)
            if c.after_issue_s:     # the compute thread's work once the reads have landed is that much slower
                heapq.heappush(self.slowed, (max(ready[k][0] for k in keys), c.after_issue_s))
            for k in keys:
                self.cache.set(k, _Read(ready[k][0], self.clock, ready[k][1], c.dequant_s, self.busy))
        nbytes = sum(b for _, b in groups)
        if counted:
            self.n["bytes"] += nbytes
        return nbytes

    def block(self, until: float, ev: LayerEvent):
        """The compute thread blocks until `until`; having slept, it runs again a wake-up later."""
        wait = max(0.0, until - self.clock.now)
        wait += self.profile.wake_s if wait > 0 else 0.0
        self.clock.now += wait
        ev.wait_s += wait
        self.n["wait"] += wait

    # ------------------------------------------------------------ the run's steps

    def prefill(self, prompt: int):
        """The prompt's rows through the schedule as the engine's prefill runs them (a layer's routed experts as one
        row, the predictor asked as the engine asks it). Untimed: decoding's clock and bytes start after it."""
        ctx = self.pos.step(0, "prefill")
        for L in self.spec.moe_layers:
            idx = self.drive.route(L, np.zeros((prompt, 1)), ctx)[0]
            ev = LayerEvent(token=-1, layer=L, phase="prefill", routed=[], predicted=[], hit=[])
            st = self.schedule.begin_layer(L, [set(idx.reshape(-1).tolist())], [0], ev)
            if self.predictor is not None:
                self.schedule.name(0, self.predictor.predict(L, {**ctx, "routed": idx}),
                                   getattr(self.predictor, "certain", False))
            self.schedule.run_layer(st)
            self.counts.add_event(ev)
        at_decode = list(self.cache.keys())              # what any policy starts decoding with (Belady too)
        self.pool.dequants, self.slowed = [], []          # the prompt's dequants and slowdown are over by then
        self.n.update(bytes=0, wait=0.0)
        return at_decode

    def decode_step(self, step: int, drafts: int) -> int:
        """One decode step: one token, or (speculative) the last token and up to `drafts` draft tokens verified in
        one batch. Returns the draft tokens accepted."""
        if not drafts:
            draft, accepted = [], 0
        elif self.acceptance is not None:         # the trace's next tokens, accepted as modelled (the same draws)
            draft, accepted = [0] * drafts, self.acceptance.draw(drafts)
        else:
            draft, accepted = self.drive.draft(step, drafts)
        if draft:
            self.work(self.profile.draft_s * len(draft))        # the draft proposes before the batch is verified
        batch = range(step, step + len(draft) + 1)
        self.n["spec_steps"] += 1
        self.n["spec_accepted"] += accepted
        for L in self.spec.moe_layers:
            self.layer(L, batch)
        self.work(self.profile.other_s)
        return accepted

    def layer(self, L: int, batch: range):
        """One MoE layer, as the engine runs it: dense and router on the clock (each further row of a batch at its
        own cost), the trace's routing, the predictor's names, then the schedule's layer."""
        c = self.profile
        one = c.dense_s + c.router_s
        self.work(one + (len(batch) - 1) * (one if c.row_s is None else c.row_s))
        routed = [set(int(e) for e in self.drive.route(L, np.zeros((1, 1)), self.pos.step(b))[0].reshape(-1))
                  for b in batch]
        ev = LayerEvent(token=batch[0], layer=L, phase="decode", routed=[], predicted=[], hit=[],
                        chosen=sum(map(len, routed)))
        st = self.schedule.begin_layer(L, routed, list(batch), ev)
        for i, b in enumerate(batch if self.predictor is not None else ()):
            ctx = {**self.pos.step(b), "routed": np.array(sorted(routed[i]))[None]}
            self.schedule.name(b, self.predictor.predict(L, ctx), getattr(self.predictor, "certain", False))
        self.schedule.run_layer(st)
        self.counts.add_event(ev)

    # ------------------------------------------------------------ the virtual clock (workbench.schedule.Clock)

    def now(self) -> float:
        return self.clock.now

    def issue(self, keys: list, priority: int, st: LayerStep) -> int:
        return self.submit(keys, True)

    def flying(self, ent) -> bool:
        return isinstance(ent, _Read) and not ent.done()

    def failed(self, ent) -> bool:
        return False

    def take(self, key, ent, st: LayerStep) -> bool:
        """The compute thread takes a landed read in (once)."""
        if not isinstance(ent, _Read) or ent.taken:
            return False
        ent.taken = True
        self.work(self.profile.land_s)
        return True

    def wait(self, st: LayerStep, every: bool) -> list[int]:
        """Wait for the first pending read (every: for all of them); those landed, in the order they landed."""
        at = [r.ready for r in st.pending.values()]
        self.block(max(at) if every else min(at), st.ev)
        return sorted((e for e, r in st.pending.items() if r.done()), key=lambda e: st.pending[e].ready)

    def wait_for_slot(self, st: LayerStep, flying: list):
        wait = min(self.cache.peek(k).ready for k in flying) - self.clock.now + self.profile.wake_s
        self.clock.now += wait
        st.ev.wait_s += wait
        self.n["wait"] += wait

    def compute(self, st: LayerStep, es: list[int]):
        c = self.profile
        further = c.expert_s if c.expert_row_s is None else c.expert_row_s
        t = sum(c.expert_s + further * (st.uses[e] - 1) for e in es)
        self.work(t)
        st.ev.compute_s += t

    def evicted(self, keys: list):
        pass

    def result(self, steps: int, decode_s: float) -> RunSummary:
        c = self.cache
        memory = Memory(self.budget_bytes, c.slots, min(c.capacity.values()), self.plan.disk_bytes, c.item_bytes)
        time = None if self.instant else TimeSplit(decode_s, self.n["wait"], decode_s - self.n["wait"])
        return RunSummary("instant" if self.instant else "simulated", steps, steps,
                          Reads.of(self.counts, self.n["bytes"]), memory, time)


@dataclass(frozen=True)
class Simulated:
    """A simulated run: its record, what it started decoding with (Belady's start too), its drafts."""
    summary: RunSummary
    at_decode: list
    spec_steps: int = 0
    spec_accepted: int = 0


def simulate_run(drive, spec: MoESpec, preset, budget: str, device: DeviceProfile, compute: ComputeProfile,
                 tokens: int, prompt: int = 4, workers: int = 1, plan: ReadPlan | None = None,
                 shared_cpu: bool = True, switch_s: float | None = None, split: bool = True,
                 readers=None, acceptance=None) -> Simulated:
    """Prefill `prompt` trace rows (reads only, untimed), then decode `tokens - 1` steps on the virtual clock,
    as `bench` measures: tok_s counts decode steps only. shared_cpu: the numpy engine's dequant (reader threads)
    and compute (its own thread) hold one GIL: a dequant that starts while the compute thread works delays that
    work by the dequant's length (one that starts while it waits costs it nothing) and itself takes the contended
    time (compute.dequant_busy_s); without a measured contended time, a read that ends while the compute thread
    works waits for the GIL instead (switch_s: CPython's switch interval, 0 to ignore). split: a large read goes to
    several readers in pieces (workbench.io.split_sizes), as reads into slots do; the numpy engine's reads do not.
    readers: this machine's readers as a streaming run served them (devices.ServedReads): their wake-ups.
    acceptance: with a modelled draft (draft=modelled:A), the drafts accepted a step, drawn from it in place of A's
    (runtime.speculative.ReplayedAcceptance: a measured run's, step by step)."""
    sim = _Simulation(drive, spec, preset, budget, device, compute, workers, plan, shared_cpu, switch_s, split,
                      readers, acceptance)
    at_decode = sim.prefill(prompt)
    t_decode = sim.clock.now
    steps, n_spec = max(0, tokens - 1), preset.execution.speculative
    produced, step = 0, 1
    while produced < steps:
        accepted = sim.decode_step(step, min(n_spec, steps - produced) if n_spec else 0)
        produced = min(steps, produced + accepted + 1)
        step += accepted + 1
    return Simulated(sim.result(steps, sim.clock.now - t_decode), at_decode, sim.n["spec_steps"],
                     sim.n["spec_accepted"])



INSTANT = DeviceProfile("instant", "every read lands at once (replay)", latency_s=0.0, read_bw=math.inf,
                        peak_bw=math.inf, queue_depth=1)


def replay_run(drive, spec: MoESpec, preset, budget: str, tokens: int, prompt: int, engine: str,
               plan: ReadPlan | None = None) -> Simulated:
    """simulate_run on the clock replay runs on: every read lands at once and nothing takes time (no compute, no
    wake-ups), so what a design serves from memory, reads and prefetches is its schedule's alone."""
    return simulate_run(drive, spec, preset, budget, INSTANT, ComputeProfile(0.0, 0.0, 0.0, 0.0, engine=engine),
                        tokens, prompt, plan=plan, shared_cpu=False, split=False)


def belady(drive, spec: MoESpec, preset, budget: str, prompt: int, tokens: int, initial=(),
           engine: str = "numpy", item: int = 0, accesses: list | None = None) -> dict:
    """Optimal replacement with perfect foresight (Belady's MIN) over the same decode accesses: the fewest experts
    any policy must read at this budget. Its hit rate bounds demand fetching; a prefetching design can show a higher
    hit rate (a prefetch is a read that lands in time), never fewer reads. initial: the experts in memory when
    decoding starts (the prompt's, a warm set), as the design had them; None: the best start any policy could have
    (the first experts decoding asks for, as many as fit), so that the bound holds whatever the prompt left.
    engine: whose cache the budget buys slots in (engines.slot_bytes), for a budget in bytes; item: what one
    expert costs there, where a pack says (ReadPlan.item). accesses: decode_accesses of the same window, if known."""
    cache = CachePlan.of(preset, spec, budget, item or slot_bytes(engine, spec, preset.storage))
    seq = accesses if accesses is not None else decode_accesses(drive, spec, prompt, tokens)
    return belady_of(seq, cache.per_pool, cache.scope == "per_layer", initial)


def decode_accesses(drive, spec: MoESpec, prompt: int, tokens: int) -> list:
    """The (layer, expert) a trace's decode steps ask for, in order, after `prompt` rows (any design's: the trace
    routes; Belady's bound is over them)."""
    pos = _Position()
    drive.route(spec.moe_layers[0], np.zeros((prompt, 1)), pos.step(0, "prefill"))      # the prompt's rows come first
    seq = []
    for step in range(1, max(0, tokens - 1) + 1):
        ctx = pos.step(step)
        for L in spec.moe_layers:
            seq += [(L, int(e)) for e in sorted(set(drive.route(L, np.zeros((1, 1)), ctx)[0].reshape(-1)))]
    return seq


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
        tokens: int = 64, prompt: int = 4, skip: int = 0, compute: ComputeProfile | None = None,
        workers: int | None = None,
        model: str | None = None, record: bool = True, spec: MoESpec | None = None, rung: dict | None = None,
        predictor: str | None = None, engine: str | None = None, here: bool | None = None, acceptance=None) -> dict:
    """One design over a trace. The simulated model: `spec` if given, else the traced model at `shape`'s expert
    shape, else the traced model itself. preset: a name or a Preset (a ladder rung). rung: {ladder, rung,
    rung_index, model} for the run record, so the dashboard's ladders page shows a simulated ladder beside the rest.
    engine: whose compute is measured (None: the default engine), unless `compute` is given: its engine's.
    here: the run predicted is this machine's, on its own flash or the device emulated on it (as bench --device
    measures): reads take at least what this machine's readers took in a streaming run (compute.read_floor), and
    the result is labelled as simulate --calibrate found it here; None: only for this-machine. acceptance: as
    simulate_run's."""
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
    if str(meta.get("expert_size", "")).startswith("unknown") and not shape and spec is None:
        raise WorkbenchError(f"{trace_path}: the traced model has no built-in shape, so no expert size to read or "
                             f"compute: pass --shape (one of workbench/shapes.py) to simulate it at one")
    note = "the given model's shape" if spec else "the traced model's shape"
    spec = spec or MoESpec.from_dict(meta["spec"])
    if shape:
        spec, note = shape_spec(shape, meta, spec)
    if compute is not None and engine is not None and engine != compute.engine:
        raise WorkbenchError(f"--engine {engine}: the compute profile given was measured on the {compute.engine} "
                             f"engine")
    if meta.get("imported") and compute is None and model is None:
        raise WorkbenchError(f"{trace_path}: an imported trace names no model here to measure compute on: pass --model "
                             f"(a checkpoint of its shape: make-model --shape {meta.get('shape')}) or --compute")
    drive = TraceDrive(trace_path, spec, str(p.prefetch) or None, trace=trace, skip=skip,
                       recall=p.prefetch.recall, params=dict(p.params))
    own = model is None or model == meta.get("model")        # the traced model: measured on its own trace
    simulated = model or (meta.get("model") if compute is None else None)     # the model whose storage is read
    here = dev.name == "this-machine" if here is None else here
    emulated = device if here and isinstance(device, str) and dev.name != "this-machine" else None
    compute = compute or measure_compute(model or meta.get("model") or "demo", spec, p.storage.experts, preset=p,
                                         routing_trace=str(trace_path) if own else None, engine=engine,
                                         device=emulated, tokens=tokens)
    readers = None
    if here and compute.read_floor:     # a read's service here at the least; an idle reader's wake-up before it
        readers = devices.ServedReads(**compute.read_floor)
        dev = devices.Slowest(dev, readers)
    # the slot readers check a read's crc before they stamp it landed, and an emulated read waits out the device's
    # time after both: here, the per-expert check is inside each read's time
    run_compute = dataclasses.replace(compute, dequant_s=0.0, dequant_busy_s=0.0) \
        if here and compute.read_floor and not compute.reader_holds_gil else compute
    workers = workers or dev.queue_depth
    plan = None
    if simulated and str(simulated).endswith(".gguf") and not shape:    # read in place: its own blocks, not the preset's
        from workbench.registry import resolve_pack, storage_for
        from workbench.store.pack import Pack
        storage = storage_for(simulated, p.storage, (), compute.engine)
        pack = Pack(resolve_pack(simulated, *storage))
        if pack.spec.to_dict() == spec.to_dict():
            p, plan = p.with_(**dict(zip(("layout", "experts", "rest"), storage))), pack_plan(pack, compute.engine)
    plan = plan or read_plan(spec, p.storage.layout.value, experts_for(p.storage.experts, compute.engine))
    sim = simulate_run(drive, spec, p, budget, dev, run_compute, tokens, prompt, workers, plan=plan,
                       shared_cpu=compute.reader_holds_gil, split=not compute.reader_holds_gil, readers=readers,
                       acceptance=acceptance)
    res = sim.summary.record()
    bound = belady(drive, spec, p, budget, prompt, tokens, initial=sim.at_decode, engine=compute.engine,
                   item=plan.item)
    compute_s = res["decode_steps"] * (len(spec.moe_layers) * (compute.dense_s + compute.router_s
                                                                + spec.top_k * compute.expert_s) + compute.other_s)
    miss_bytes = bound["belady_misses"] * plan.disk_bytes
    bound["belady_tok_s"] = res["decode_steps"] / max(compute_s, miss_bytes / dev.peak_bw)
    res.update(bound, simulated=True, emulated=False, device=dev.describe(), preset=p.name, budget=budget,
               shape=shape, shape_note=note, spec=spec.to_dict(), reader_workers=workers,
               compute_profile=dataclasses.asdict(compute), routing_trace=drive.source, tokens=tokens, prompt=prompt,
               skip=skip, spec_steps=sim.spec_steps, spec_accepted=sim.spec_accepted,
               modelled_acceptance=modelled_acceptance(p.execution.draft) if p.execution.speculative else None)
    res["device"]["emulated"] = False
    res["device"]["simulated"] = True
    from experiments.calibration import UNCALIBRATED, label
    # checked by simulate --calibrate only for runs here, at the traced model's own shape
    res["calibration"] = label(dev.name, simulated or meta.get("model")) \
        if here and not shape and note == "the traced model's shape" else UNCALIBRATED
    res["emulated_here"] = here
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


# ---------------------------------------------------------------- replay: the instant clock

REPLAYED = ("on_demand", "history", "shuffled", "les", "smol", "oracle")     # replay's presets by default


def replay(path, presets=REPLAYED, budget: str | None = None, tokens: int | None = None, prompt: int = 4,
           skip: int = 0, engine: str | None = None, knobs: dict | None = None) -> dict:
    """Each preset over the trace's window (prompt rows, then tokens - 1 decode steps, from row `skip`) on the
    schedule with every read landing at once: what it serves from memory, reads and prefetches, untimed. The
    predictors are the trace's recorded ones, as simulate and bench --routing-trace replay them."""
    from engines import default_engine
    from experiments.routing_trace import TraceDrive
    from experiments.traces import near_ties, read_trace
    from workbench.presets import get_preset, with_each
    tr = read_trace(path)
    meta = tr["meta"]
    spec = MoESpec.from_dict(meta["spec"])
    if list(spec.moe_layers) != list(tr["moe_layers"]):
        raise WorkbenchError(f"{path}: the trace's layers {tr['moe_layers']} are not the spec's MoE layers")
    engine = engine or default_engine()
    tokens = tokens or len(tr["ids"]) - prompt - skip + 1
    rows = []
    for p in with_each([get_preset(n) for n in presets], knobs or {}):
        p = simulable(p)
        b = str(budget if budget is not None else p.cache.budget)
        drive = TraceDrive(path, spec, str(p.prefetch) or None, trace=tr, skip=skip, recall=p.prefetch.recall,
                           params=dict(p.params))
        res = replay_run(drive, spec, p, b, tokens, prompt, engine)
        bound = belady(drive, spec, p, b, prompt, tokens, initial=res.at_decode, engine=engine)
        rows.append({"preset": p.name, "budget": b, **{k: v for k, v in res.summary.record().items() if k != "per_layer"},
                     "belady_hit_rate": bound["belady_hit_rate"]})
    return {"trace": str(path), "engine": meta.get("engine"), "model": meta.get("gguf") or meta.get("model"),
            "trace_tokens": len(tr["ids"]), "tokens": tokens, "prompt": prompt, "skip": skip, "cache_engine": engine,
            "clock": "instant: every read lands at once (no timing)",
            "routing_check": None if tr["logits"] is None else near_ties(tr["logits"], tr["topk"], spec.top_k),
            "prediction": drive.source.get("prediction"),
            "presets": rows}


def table(res: dict) -> str:
    from workbench.designs import short
    lines = [f"replay of {res['trace']} ({res['engine']}; rows {res['skip']}.., {res['prompt']} prompt + "
             f"{res['tokens']} tokens; every read lands at once)",
             f"{'preset':16} {'budget':>8} {'slots':>6} {'hit':>6} {'Belady':>7} {'recall':>7} {'precision':>9} "
             f"{'miss/tok':>9} {'prefetch/tok':>12}"]
    for r in res["presets"]:
        f = lambda v: "" if v is None else f"{v:.3f}"
        lines.append(f"{short(r['preset']):16} {r['budget']:>8} {r['pool_slots']:6d} {r['hit_rate']:6.3f} "
                     f"{r['belady_hit_rate']:7.3f} {f(r['prefetch_recall']):>7} {f(r['prefetch_precision']):>9} "
                     f"{r['misses_per_token']:9.2f} {r['prefetch_per_token']:12.2f}")
    return "\n".join(lines)
