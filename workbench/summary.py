"""One run's numbers, whichever clock ran it: bench's (measured), simulate's (a virtual clock) or replay's (instant:
every read lands at once). bench, simulate and replay fill the same record and serialize it here (RunSummary.record).

One name per expert-size quantity:
    expert_disk_bytes   what reading one expert moves from flash (the mean over layers: Pack.mean_expert_bytes)
    expert_mem_bytes    what one expert takes in the engine's cache (a slot)
    bytes_read          what the run read from flash while decoding
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.telemetry import Telemetry, prediction_rates, rates

CLOCKS = ("measured", "simulated", "instant")


@dataclass(frozen=True)
class Reads:
    """What decoding asked of the cache, read from flash and prefetched."""
    hits: int
    late: int                   # asked for while its read was in flight
    misses: int
    bytes_read: int
    experts_read: int           # on demand and prefetched, while decoding (as bytes_read)
    prefetch_issued: int        # while decoding
    prefetch_used: int
    prefetch_wasted: int
    recall: float | None        # of the predictor, over the layers it named experts for; None: it named nothing
    precision: float | None
    per_layer: tuple = ()       # Telemetry.per_layer rows
    dropped_fraction: float = 0.0     # of the model's top-k choices, those a lossy lever left out (per layer: rows)
    low_fraction: float = 0.0         # of the choices made, those computed from the low tier's copy

    @classmethod
    def of(cls, tel: Telemetry, bytes_read: int) -> Reads:
        """From what a schedule counted (Telemetry: the session's, or the simulator's counts)."""
        layers = tel.per_layer("decode")
        hits, late, misses = (sum(r[k] for r in layers) for k in ("hits", "late", "misses"))
        decode = [e for e in tel.events if e.phase == "decode"]
        dropped, chosen, low = (sum(r[k] for r in layers) for k in ("dropped", "chosen", "low"))
        return cls(hits, late, misses, bytes_read, sum(e.issued for e in decode), sum(e.prefetched for e in decode),
                   tel.prefetch_used, tel.prefetch_wasted, *prediction_rates(layers), tuple(layers),
                   dropped / (dropped + chosen) if dropped + chosen else 0.0, low / chosen if chosen else 0.0)


@dataclass(frozen=True)
class TimeSplit:
    """Where decoding's time went, seconds over the run. A part the clock does not split is None (the simulator's
    compute thread is one: compute_s)."""
    decode_s: float
    flash_wait_s: float
    compute_s: float
    router_s: float | None = None
    dequant_s: float | None = None
    other_s: float | None = None
    draft_s: float = 0.0        # a speculative run's draft proposing tokens (a draft model's forwards)


@dataclass(frozen=True)
class Drafts:
    """A speculative run's verification steps: what was drafted, what greedy decoding kept, what the batch cost."""
    source: str                 # what drafted: lookup (prompt lookup), a draft model's path
    steps: int                  # target forwards that verified drafts
    proposed: int
    accepted: int
    union_growth: float         # distinct experts a step's batch routed to over its first token's (telemetry)
    modelled: float | None = None     # a trace-driven run's modelled acceptance (runtime.speculative); None: real

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def record(self) -> dict:
        return {"draft": self.source, "spec_steps": self.steps, "spec_proposed": self.proposed,
                "spec_accepted": self.accepted, "spec_accept_rate": self.acceptance,
                "tokens_per_target_step": (self.accepted + self.steps) / max(1, self.steps),
                "union_growth": self.union_growth, "modelled_acceptance": self.modelled}


@dataclass(frozen=True)
class Memory:
    """What the budget bought."""
    budget_bytes: int
    cache_slots: int            # experts the cache holds, all pools
    pool_slots: int             # a pool's (a layer's, or the one global cache's; the smallest where they differ)
    expert_disk_bytes: int | None     # None: a trace of a model with no expert size known (import_trace.UNSIZED)
    expert_mem_bytes: int


@dataclass(frozen=True)
class RunSummary:
    clock: str                  # CLOCKS
    decode_steps: int
    produced: int               # tokens decoding produced (more than its steps where drafts were accepted)
    reads: Reads
    memory: Memory
    time: TimeSplit | None = None     # None: the instant clock, where nothing takes time
    drafts: Drafts | None = None      # None: one token a step

    @property
    def tok_s(self) -> float | None:
        if self.time is None:
            return None
        if self.time.decode_s > 0:
            return self.produced / self.time.decode_s
        return float("inf") if self.produced else 0.0

    @property
    def hit_rate(self) -> float:
        return rates(self.reads.hits, self.reads.late, self.reads.misses)["hit_rate"]

    def record(self) -> dict:
        """The run record's names (bench's result, simulate's, replay's rows, summary.json)."""
        r, m, n = self.reads, self.memory, max(1, self.produced)
        out = {"clock": self.clock, "decode_steps": self.decode_steps, "tok_s": self.tok_s,
               **rates(r.hits, r.late, r.misses), "hits": r.hits, "late": r.late, "misses": r.misses,
               "bytes_read": r.bytes_read, "bytes_read_per_token": r.bytes_read / n, "experts_read": r.experts_read,
               "experts_read_per_token": r.experts_read / n, "misses_per_token": r.misses / n,
               "prefetch_issued": r.prefetch_issued, "prefetch_per_token": r.prefetch_issued / n,
               "prefetch_used": r.prefetch_used, "prefetch_wasted": r.prefetch_wasted,
               "prefetch_recall": r.recall, "prefetch_precision": r.precision,
               "budget_bytes": m.budget_bytes, "cache_slots": m.cache_slots,
               "pool_slots": m.pool_slots, "expert_disk_bytes": m.expert_disk_bytes,
               "expert_mem_bytes": m.expert_mem_bytes,
               "dropped_fraction": r.dropped_fraction, "low_fraction": r.low_fraction, "per_layer": list(r.per_layer)}
        if (t := self.time) is not None:
            out.update(decode_s=t.decode_s, flash_wait_s=t.flash_wait_s, flash_wait_per_token_s=t.flash_wait_s / n,
                       compute_s=t.compute_s, router_s=t.router_s, dequant_s=t.dequant_s, other_s=t.other_s,
                       draft_s=t.draft_s)
        if self.drafts is not None:
            out.update(self.drafts.record())
        return out
