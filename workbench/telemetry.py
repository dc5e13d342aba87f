"""Telemetry: one event per (token, layer), one record per token, and their aggregates.

The per-token time split adds up to wall time by construction:
compute + router + dequant + flash_wait + other == wall, where `other` is what is left. The two parts reading
costs the compute thread split further, into what a miss's time goes to (the run record's tokens, the live
page's wait breakdown):
  flash_wait = queue + device + completion    the read the wait ended on: still queued for a reader thread,
                                              reading (preadv and its crc; an emulated device's time), and
                                              landed but not yet seen by the waiting thread (its wake-up)
  other = submit + handoff + python           issuing demand reads, taking landed reads in (crc combined, the
                                              cache entry made the slot), and the engine's Python around them
Each read's own latency (issue to taken in) splits the same way: submit, queue, device, landed (landing to taken
in: completion and hand-off together), summed over a layer's demand reads in its event (read_*_s).
Live views read `ring` (a bounded deque the engine appends to) and `tokens`.

Every expert a token's routing demands is exactly one of (the three rates add up to 1):
  hit   in memory when the layer asks (resident, or a prefetch that has landed);
  late  a prefetch still in flight: no new read, but the layer may wait for it;
  miss  read on demand.
A prefetch that no routing asks for is waste (prefetch_wasted, wasted_bytes), never a hit.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field



def rates(hits: int, late: int, misses: int) -> dict:
    """hit_rate, late_rate and miss_rate of the experts routing demanded (they add up to 1)."""
    n = max(1, hits + late + misses)
    return {"hit_rate": hits / n, "late_rate": late / n, "miss_rate": misses / n}


def prediction_rates(layers: list[dict]) -> tuple:
    """(recall, precision) of a predictor over per-layer rows (Telemetry.per_layer), counting the layers it served;
    (None, None) where it named nothing."""
    served = [r for r in layers if r["predicted"]]
    routed, named, used = (sum(r[k] for r in served) for k in ("routed", "predicted", "predicted_used"))
    return (used / routed, used / named) if named else (None, None)


@dataclass
class LayerEvent:
    token: int                  # index of the generated token (prefill: -1)
    layer: int
    phase: str                  # prefill | decode
    routed: list[int]           # distinct experts the layer used
    predicted: list[int]        # experts the predictor named for this layer (prefetched)
    hit: list[bool]             # per routed expert: already in memory when the layer asked
    late: int = 0               # of the routed experts not hit: prefetches still in flight (the rest are misses)
    bytes_read: int = 0         # bytes the reader transferred for this layer's misses
    chosen: int = 0             # (row, expert) choices the routing made (rows x the columns it returned)
    dropped: int = 0            # of the model's top-k choices, those the routing left out (a lossy lever)
    low: int = 0                # of the choices, those computed from the low tier's copy (low_on_miss, low_by_hotness)
    one: int = 0                # distinct experts the step's first token routed to (a batch's union: routed / one)
    wait_s: float = 0.0         # compute thread blocked on reads (flash wait)
    dequant_s: float = 0.0      # the part of the blocked time spent dequantizing
    compute_s: float = 0.0
    router_s: float = 0.0
    # inside the split above, what reading costs the compute thread (the simulator's compute profile measures them):
    issue_s: float = 0.0        # issuing reads (slots reserved and claimed, submits): demand ones in other, the
    issues: int = 0             # predictor's in router_s; issues: submits, issued: experts
    issued: int = 0
    prefetched: int = 0         # of issued, the predictor's (for this layer or later ones)
    take_s: float = 0.0         # taking landed reads in (settled, crc compared, the cache entry made the slot)
    taken: int = 0
    submit_s: float = 0.0       # of issue_s, the demand reads' (in other)
    # the flash wait split by where the read it ended on was (split_wait): queued, reading, landed not yet seen
    queue_s: float = 0.0
    device_s: float = 0.0
    completion_s: float = 0.0
    # each demand read's latency, from its issue to taken in, summed over the reads (took): what it spent being
    # submitted, queued, read, and landed before the compute thread took it in
    reads_taken: int = 0
    read_submit_s: float = 0.0
    read_queue_s: float = 0.0
    read_device_s: float = 0.0
    read_landed_s: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0

    def split_wait(self, t0: float, t1: float, done: list, every: bool) -> None:
        """Add the wait [t0, t1] (perf_counter seconds) on reads, which ended when one of `done` landed (every:
        the last of them), to queue / device / completion by where that read was: the three add up to t1 - t0."""
        stamped = [f for f in done if getattr(f, "t_end", 0)]
        if not stamped:                     # no stamps (a decode on the pool thread): all of it is completion
            self.completion_s += t1 - t0
            return
        f = (max if every else min)(stamped, key=lambda f: f.t_end)
        start, end = min(max(f.t_start / 1e9, t0), t1), min(max(f.t_end / 1e9, t0), t1)
        self.queue_s += start - t0
        self.device_s += end - start
        self.completion_s += t1 - end

    def took(self, fut, now: float) -> None:
        """A demand read (priority 0) taken in at `now`: its latency split into submit, queue, device, landed."""
        if getattr(fut, "priority", 0) or not getattr(fut, "t_queued", 0) or not getattr(fut, "t_end", 0):
            return                  # a prefetch, or a read that failed (not stamped)
        submit, queued, start, end = fut.t_submit / 1e9, fut.t_queued / 1e9, fut.t_start / 1e9, fut.t_end / 1e9
        self.reads_taken += 1
        self.read_submit_s += queued - submit
        self.read_queue_s += max(0.0, start - queued)
        self.read_device_s += end - max(start, queued)
        self.read_landed_s += now - end


@dataclass
class TokenRecord:
    token: int
    phase: str
    n_tokens: int               # tokens processed in this forward (prefill: prompt length)
    wall_s: float
    compute_s: float
    router_s: float
    dequant_s: float
    flash_wait_s: float
    other_s: float
    hits: int
    misses: int                 # read on demand (late prefetches are neither hits nor misses)
    bytes_read: int
    cache_bytes: int
    text: str = ""
    late: int = 0
    produced: int = 1           # decode: tokens this step added to the output (speculative steps add more)
    drafted: int = 0            # draft tokens this step verified after its first
    draft_s: float = 0.0        # the draft's own time proposing them (in wall_s, not in other_s)
    # flash_wait_s split (LayerEvent.split_wait), and other_s: demand submits, hand-off (take_s), the rest
    queue_s: float = 0.0
    device_s: float = 0.0
    completion_s: float = 0.0
    submit_s: float = 0.0
    handoff_s: float = 0.0
    python_s: float = 0.0

    @classmethod
    def of(cls, events, wall_s: float, compute_s: float, draft_s: float = 0.0, **kw) -> "TokenRecord":
        """A step's record from its layer events: the split adds up to wall_s (other_s and python_s what is left)."""
        router, dq, wait = (sum(getattr(v, k) for v in events) for k in ("router_s", "dequant_s", "wait_s"))
        queue, device, completion = (sum(getattr(v, k) for v in events) for k in ("queue_s", "device_s", "completion_s"))
        submit, handoff = sum(v.submit_s for v in events), sum(v.take_s for v in events)
        other = max(0.0, wall_s - draft_s - compute_s - router - dq - wait)
        hits, late = sum(sum(v.hit) for v in events), sum(v.late for v in events)
        return cls(wall_s=wall_s, compute_s=compute_s, router_s=router, dequant_s=dq, flash_wait_s=wait,
                   other_s=other, hits=hits, late=late, misses=sum(len(v.hit) for v in events) - hits - late,
                   queue_s=queue, device_s=device, completion_s=completion, submit_s=min(submit, other),
                   handoff_s=min(handoff, other - min(submit, other)), python_s=max(0.0, other - submit - handoff),
                   draft_s=draft_s, **kw)


@dataclass
class Telemetry:
    num_layers: int
    ring_size: int = 4096
    events: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    wasted_bytes: int = 0
    prefetch_named: int = 0     # experts a predictor named (issued or not: a guess may not be admitted)
    demand_reads: int = 0       # experts read on demand
    spec_proposed: int = 0      # speculative verification: draft tokens proposed, accepted, target steps
    spec_accepted: int = 0
    spec_steps: int = 0

    def __post_init__(self):
        self.ring = deque(maxlen=self.ring_size)
        self.lock = threading.Lock()

    def clear(self):
        """Forget what was recorded (a warm-up's numbers), in place: the engine and streamer keep recording here."""
        with self.lock:
            self.events.clear()
            self.tokens.clear()
            self.ring.clear()
            self.prefetch_issued = self.prefetch_used = self.prefetch_wasted = self.wasted_bytes = 0
            self.prefetch_named = self.demand_reads = 0
            self.spec_proposed = self.spec_accepted = self.spec_steps = 0

    def add_event(self, ev: LayerEvent):
        with self.lock:
            self.events.append(ev)
            self.ring.append(ev)

    def add_token(self, rec: TokenRecord):
        with self.lock:
            self.tokens.append(rec)

    # ------------------------------------------------------------ aggregates

    def per_layer(self, phase: str | None = "decode") -> list[dict]:
        rows = {}
        for ev in self.events:
            if phase and ev.phase != phase:
                continue
            r = rows.setdefault(ev.layer, dict(layer=ev.layer, hits=0, late=0, misses=0, bytes_read=0, wait_s=0.0,
                                               compute_s=0.0, predicted=0, predicted_used=0, routed=0,
                                               dropped=0, chosen=0, low=0))
            h = sum(ev.hit)
            r["hits"] += h
            r["late"] += ev.late
            r["misses"] += len(ev.hit) - h - ev.late
            r["bytes_read"] += ev.bytes_read
            r["wait_s"] += ev.wait_s
            r["compute_s"] += ev.compute_s
            used = len(set(ev.predicted) & set(ev.routed))
            r["predicted"] += len(ev.predicted)
            r["predicted_used"] += used
            r["routed"] += len(ev.routed)
            r["dropped"] += ev.dropped
            r["chosen"] += ev.chosen
            r["low"] += ev.low
        out = []
        for L in sorted(rows):
            r = rows[L]
            r.update(rates(r["hits"], r["late"], r["misses"]))
            r["recall"] = r["predicted_used"] / r["routed"] if r["predicted"] else None
            r["precision"] = r["predicted_used"] / r["predicted"] if r["predicted"] else None
            asked = r["dropped"] + r["chosen"]
            r["dropped_fraction"] = r["dropped"] / asked if asked else 0.0
            r["low_fraction"] = r["low"] / r["chosen"] if r["chosen"] else 0.0
            out.append(r)
        return out

    def summary(self) -> dict:
        """What the clock measured: decode's time split, prefill, reads' latencies. What the schedule counted (hits,
        reads, prefetches) is workbench.summary.Reads.of(this); what drafts did, workbench.summary.Drafts."""
        dec = [t for t in self.tokens if t.phase == "decode"]
        pre = [t for t in self.tokens if t.phase == "prefill"]
        wall = sum(t.wall_s for t in dec)
        produced = sum(t.produced for t in dec)
        s = dict(
            decode_steps=len(dec), produced=produced,
            tok_s=produced / wall if wall > 0 else 0.0,
            prefill_tokens=sum(t.n_tokens for t in pre),
            prefill_tok_s=sum(t.n_tokens for t in pre) / max(1e-12, sum(t.wall_s for t in pre)) if pre else 0.0,
            decode_bytes_read=sum(t.bytes_read for t in dec),
            decode_s=wall,
            wasted_bytes=self.wasted_bytes,
        )
        for k in ("flash_wait_s", "dequant_s", "compute_s", "router_s", "other_s", "draft_s",
                  "queue_s", "device_s", "completion_s", "submit_s", "handoff_s", "python_s"):
            s[k] = sum(getattr(t, k) for t in dec)
        issuing = [e for e in self.events if e.phase == "decode" and e.issued]
        s["issue_s"] = sum(e.issue_s for e in issuing)              # demand reads' and the predictor's
        s["issue_per_expert_s"] = s["issue_s"] / max(1, sum(e.issued for e in issuing))
        taken = [e for e in self.events if e.phase == "decode" and e.reads_taken]
        n = sum(e.reads_taken for e in taken)
        s["demand_reads_taken"] = n
        for k in ("submit", "queue", "device", "landed"):       # a demand read's latency, mean seconds a read
            s[f"read_{k}_s"] = sum(getattr(e, f"read_{k}_s") for e in taken) / n if n else 0.0
        return s

    def union_growth(self, phase: str = "decode") -> float:
        """Distinct experts a step's batch routed to over those its first token alone did, summed over layers: what
        verifying drafts in one batch multiplies a step's expert demand by (1.0 without drafts)."""
        evs = [e for e in self.events if e.phase == phase]
        return sum(len(e.routed) for e in evs) / max(1, sum(e.one for e in evs))

    def event_rows(self) -> list[dict]:
        return [asdict(e) for e in self.events]

    def token_rows(self) -> list[dict]:
        return [asdict(t) for t in self.tokens]
