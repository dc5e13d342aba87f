"""The expert streamer: brings a layer's experts into memory and hands them to compute, on the real clock of
the schedule (workbench/schedule.py decides what is read, prefetched, evicted and computed when).

Reads go to the reader pool as one batch (adjacent experts merge); each expert is checked and dequantized on the
pool thread that completes its read, so reads and dequant overlap compute. With a slot arena (workbench/arena.py)
reads land in the expert's slot instead and the reader only checks them; demand reads are read before prefetches.
Whatever order the schedule computes a layer's experts in, the caller sums them in expert-id order, so the numeric
result is the same.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future


import numpy as np

from workbench.arena import ReadPlan
from workbench.cache import ExpertCache
from workbench.errors import WorkbenchError
from workbench.io import ChecksumError, Reader
from workbench.slot_reads import SlotRead
from workbench.store.pack import Pack
from workbench.schedule import LayerStep, Schedule
from workbench.telemetry import LayerEvent, Telemetry

# A read of an expert not back after this many seconds fails the run (a stalled disk; set WORKBENCH_READ_TIMEOUT)
READ_TIMEOUT_S = 60.0
IN_FLIGHT = (Future, SlotRead)      # a cache entry whose read has not been taken in yet


class ExpertStreamer:
    def __init__(self, pack: Pack, cache: ExpertCache, reader: Reader, telemetry: Telemetry,
                 execution: str = "ready_first", raw: bool = False, arena=None):
        self.pack, self.cache, self.reader, self.tel = pack, cache, reader, telemetry
        self.read_timeout = float(os.environ.get("WORKBENCH_READ_TIMEOUT", READ_TIMEOUT_S))
        self.raw = raw      # True: compute gets each part's encoded bytes, not f32 (an engine's raw_experts)
        self.arena = arena  # a SlotArena: reads land in slots, and an entry is its slot's offset
        self.plan = ReadPlan(pack, arena) if arena is not None else None    # what reading each expert takes
        self.schedule = Schedule(cache, self, telemetry, execution)

    # ------------------------------------------------------------ reads

    def _reserve(self, key, pin=False) -> bool:
        """A cache slot for key (evicting as the cache decides); the arena frees the slots of what was evicted."""
        ok = self.cache.pin(key, None) if pin else self.cache.reserve(key, None)
        if self.cache.last_evicted:
            self.evicted(self.cache.last_evicted)
        return ok

    def _issue(self, keys: list[tuple], priority: int = 0) -> int:
        """Start reads for keys (slots already reserved); returns bytes requested. priority: 0 demand, 1 prefetch."""
        if self.arena is not None:
            return self._issue_into_slots(keys, priority)
        reads = {key: self.pack.expert_reads(*key) for key in keys}
        futs = self.reader.submit([((key, i), off, n) for key in keys for i, (off, n) in enumerate(reads[key])])
        total = 0
        for key in keys:
            fut = Future()
            fut.dequant_s = 0.0
            self.cache.set(key, fut)
            part_futs = [futs[(key, i)] for i in range(len(reads[key]))]
            total += sum(n for _, n in reads[key])
            remaining = [len(part_futs)]

            def done(_f, key=key, fut=fut, part_futs=part_futs, remaining=remaining):
                remaining[0] -= 1
                if remaining[0]:
                    return
                try:
                    chunks = [self._bytes_of(key, f, read) for f, read in zip(part_futs, reads[key])]
                    t0 = time.perf_counter()
                    w = self.pack.decode_expert(key[0], key[1], chunks, raw=self.raw)
                    fut.dequant_s = time.perf_counter() - t0
                    fut.set_result(w)
                except BaseException as e:  # surfaced in the compute thread by fut.result()
                    fut.set_exception(e)
                finally:        # a read future holds this callback, which holds the futures: a cycle that kept
                    part_futs.clear()   # each read's buffer alive until a full GC (RSS climbed for ~700 requests)

            for f in part_futs:
                f.add_done_callback(done)
        return total

    def _bytes_of(self, key, f: Future, read: tuple | None = None):
        """A finished read's bytes, or a one-line error naming the file, the offset and the expert (the read: the
        expert's first, unless given)."""
        try:
            return f.result()
        except ChecksumError:
            raise self.pack.checksum_error(*key) from None
        except (OSError, EOFError) as e:
            read = read or self.pack.expert_reads(*key)[0]
            why = f"past the end of the file ({str(e).rsplit(', ', 1)[-1]})" if isinstance(e, EOFError) \
                else e.strerror or str(e)
            raise WorkbenchError(f"{self.pack.path}: reading expert {key[1]} of layer {key[0]} failed at offset "
                                 f"{read[0]} ({read[1]} bytes): {why}") from None

    def _wait(self, futures, key, every: bool = False) -> list:
        """The done ones once any of these expert reads is (every: all), bounded by read_timeout: a stalled read
        fails the run, it does not hang it."""
        done = self.reader.wait(futures, self.read_timeout, every)
        if not done or (every and len(done) < len(futures)):
            (off, n), *_ = self.pack.expert_reads(*key)
            raise WorkbenchError(f"{self.pack.path}: reading expert {key[1]} of layer {key[0]} at offset {off} "
                                 f"({n} bytes) did not complete within {self.read_timeout:g} s (stalled disk?)")
        return done

    def _issue_into_slots(self, keys, priority) -> int:
        plan, address = self.plan, self.arena.address
        rows = np.array([plan.row(key) for key in keys], np.int64)
        parts, checks, crcs, nbytes = plan.reads(rows, np.array([address(key) for key in keys], np.int64))
        cache_set = self.cache.set
        for key, fut in self.reader.submit_parts(keys, parts, checks, crcs, priority, self.arena.memory).items():
            cache_set(key, fut)         # checked by the reader as it lands; nothing is decoded
        return nbytes

    def _landed(self, key, fut):
        """What the cache holds once a read has landed: the arena's slot offset, or the decoded expert."""
        try:
            w = self._bytes_of(key, fut)    # a failed read or checksum raises here, in the compute thread
        except Exception:
            self.cache.drop(key)            # not in memory: the next request reads it again
            raise
        return self.arena.where[key] if self.arena is not None else w

    def empty(self):
        """Forget every expert that is not pinned (a cold start): reads still in flight land first, then every
        slot but the pinned ones is free, the cache's policy starts anew and no prefetch is outstanding."""
        flying = [(k, v) for k in self.cache.keys() if isinstance(v := self.cache.peek(k), IN_FLIGHT)]
        if flying:
            self._wait([v for _, v in flying], flying[0][0], every=True)
            for _, v in flying:
                v.done()                    # settled: its reader's jobs are free again
        keys = self.cache.clear()
        if self.arena is not None:
            self.arena.release(keys)
        self.schedule.forget()

    def load_resident(self, keys, pin=True):
        """Fill the cache with these experts now (all-resident or a warm set), synchronously."""
        keys = [k for k in keys if k not in self.cache]
        for k in keys:
            if not self._reserve(k, pin=pin):
                raise ValueError("warm set larger than the cache")
        self._issue(keys)
        for k in keys:
            self._wait([self.cache.peek(k)], k, every=True)
            self.cache.set(k, self._landed(k, self.cache.peek(k)))

    # ------------------------------------------------------------ one layer, scheduled (workbench.schedule)

    def begin_layer(self, layer: int, idx, token: int, ctx: dict, predictor, t0: float, low=None) -> LayerStep:
        """A MoE layer routed to experts `idx` at `token` (the engine's token index): the schedule's step, with the
        predictor's names for later layers (read by run_layer after this layer's own misses). ctx: what the
        predictor reads (x, h, logits: numpy; phase; engine); t0: when the router started. low: the choices
        computed from the low tier (bool, as idx), which are not brought in."""
        phase = ctx["phase"]
        ev = LayerEvent(token=token if phase == "decode" else -1, layer=layer, phase=phase,
                        routed=[], predicted=[], hit=[], t_start=t0)
        ctx["routed"] = idx
        ev.chosen = int((idx >= 0).sum())
        ev.dropped = idx.shape[0] * self.pack.spec.top_k - ev.chosen
        ev.low = 0 if low is None else int(low.sum())
        first = idx[0] if low is None else idx[0][~low[0]]
        ev.one = len(set(first[first >= 0].tolist()))
        ev.router_s = time.perf_counter() - t0
        st = self.schedule.begin_layer(layer, [set((idx.ravel() if low is None else idx[~low]).tolist())], [token], ev)
        if predictor is not None:
            t1 = time.perf_counter()
            self.schedule.name(token, predictor.predict(layer, ctx), getattr(predictor, "certain", False))
            ev.router_s += time.perf_counter() - t1
        return st

    def run_layer(self, st: LayerStep, compute, low=None):
        """Bring every needed expert into memory and call compute(experts, their cache entries) on each batch
        that is in memory together, as the schedule orders; low(): the work that reads nothing (the low tier's)."""
        st.work = compute
        self.schedule.run_layer(st, low)

    # ------------------------------------------------------------ the real clock (workbench.schedule.Clock)

    now = staticmethod(time.perf_counter)

    def issue(self, keys: list, priority: int, st: LayerStep) -> int:
        return self._issue(keys, priority)

    def flying(self, ent) -> bool:
        return isinstance(ent, IN_FLIGHT) and not ent.done()

    def failed(self, ent) -> bool:
        return isinstance(ent, IN_FLIGHT) and ent.done() and ent.exception() is not None

    def take(self, key, ent, st: LayerStep) -> bool:
        if not isinstance(ent, IN_FLIGHT):
            return False
        st.ev.took(ent, time.perf_counter())
        self.cache.set(key, self._landed(key, ent))
        return True

    def wait(self, st: LayerStep, every: bool) -> list[int]:
        t0 = time.perf_counter()
        done = self._wait(list(st.pending.values()), (st.layer, min(st.pending)), every)
        waited = time.perf_counter() - t0
        dq = min(waited, sum(getattr(f, "dequant_s", 0.0) for f in done))
        st.ev.dequant_s += dq
        st.ev.wait_s += waited - dq
        st.ev.split_wait(t0, t0 + waited - dq, done, every)
        return [e for e, f in st.pending.items() if f in done]

    def wait_for_slot(self, st: LayerStep, flying: list):
        t0 = time.perf_counter()
        self._wait([self.cache.peek(k) for k in flying], flying[0])
        st.ev.wait_s += time.perf_counter() - t0

    def compute(self, st: LayerStep, es: list[int]):
        t0 = time.perf_counter()
        st.work(es, [self.cache.peek((st.layer, e)) for e in es])
        st.ev.compute_s += time.perf_counter() - t0

    def evicted(self, keys: list):
        if self.arena is not None:
            self.arena.release(keys)
