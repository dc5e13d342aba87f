"""The expert streamer: brings a layer's experts into memory and hands them to compute.

Reads go to the reader pool as one batch (adjacent experts merge); each expert is checked
and dequantized on the pool thread that completes its read, so reads and dequant overlap
compute. With a slot arena (workbench/arena.py) reads land in the expert's slot instead and the
reader only checks them; demand reads are read before prefetches. The budget is a hard bound: when the experts a layer needs do not all fit, they
are streamed through the cache in waves (compute, release, read the next).

ready_first: compute the experts already in memory, then each arriving expert in arrival
order. wait_all: wait for every issued read, then compute. Either way the results are
summed in expert-id order by the caller, so the numeric result is the same.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future


from workbench.cache import ExpertCache, GuessAdmission
from workbench.errors import WorkbenchError
from workbench.io import ALIGN, ChecksumError, Reader
from workbench.slot_reads import SlotRead
from workbench.store.pack import Pack
from workbench.telemetry import LayerEvent, Telemetry

# A read of an expert not back after this many seconds fails the run (a stalled disk; set WORKBENCH_READ_TIMEOUT)
READ_TIMEOUT_S = 60.0
IN_FLIGHT = (Future, SlotRead)      # a cache entry whose read has not been taken in yet


class ExpertStreamer:
    def __init__(self, pack: Pack, cache: ExpertCache, reader: Reader, telemetry: Telemetry,
                 execution: str = "ready_first", raw: bool = False, arena=None):
        if execution not in ("ready_first", "wait_all"):
            raise ValueError(f"execution {execution!r}: choose ready_first or wait_all")
        self.pack, self.cache, self.reader, self.tel = pack, cache, reader, telemetry
        self.execution = execution
        self.read_timeout = float(os.environ.get("WORKBENCH_READ_TIMEOUT", READ_TIMEOUT_S))
        self.raw = raw      # True: compute gets each part's encoded bytes, not f32 (an engine's raw_experts)
        self.arena = arena  # a SlotArena: reads land in slots, and an entry is its slot's offset
        self.prefetched: dict[tuple, tuple] = {}   # key -> (bytes, token), issued by a predictor, not yet consumed
        self.predicted_for: dict[tuple, list[int]] = {}  # (layer, token index) -> experts a predictor named
        self.to_prefetch: list = []     # ((layer, token index), experts) named by begin_layer, read by run_layer
        self._plan: dict = {}           # key -> what reading it into a slot takes (_plan_of)
        self.admission = GuessAdmission(len(pack.spec.moe_layers))
        self.spare, self.guess = 0, True    # what a prefetch may evict, and whether it is made (begin_layer)

    # ------------------------------------------------------------ reads

    def _reserve(self, key, protect=frozenset(), pin=False, spare: int = 0) -> bool:
        """A cache slot for key (evicting as the cache decides); the arena frees the slots of what was evicted."""
        ok = self.cache.pin(key, None) if pin else self.cache.reserve(key, None, protect, spare)
        if self.arena is not None and self.cache.last_evicted:
            self.arena.release(self.cache.last_evicted)
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
        claim, plan = self.arena.claim, self._plan
        requests, checks, total = [], {}, 0
        for key in keys:
            offsets, check, nbytes, lengths = plan.get(key) or self._plan_of(key)
            bufs = claim(key)
            if lengths:                         # a GGUF index's expert: its reads, not its slot regions
                bufs = [b[:n] for b, n in zip(bufs, lengths)]
            requests.append((key, list(zip(offsets, bufs))))
            checks[key] = check                 # the crc, by the reader; nothing is decoded
            total += nbytes
        cache_set = self.cache.set
        for key, fut in self.reader.submit_into(requests, priority, checks).items():
            cache_set(key, fut)
        return total

    def _plan_of(self, key) -> tuple:
        """(file offsets of its reads, its crc check, bytes read, read lengths or None) of an expert, worked out
        once. A GGUF index's parts lie off the 4 KiB boundaries O_DIRECT reads start at: each read starts at the
        boundary before its part and ends at the one after, and the crc runs start past it (pack.expert_heads)."""
        reads = self.pack.expert_reads(*key)
        check, lengths = self.pack.expert_check(*key), None
        heads = self.pack.expert_heads(key[0])
        if heads.any():             # a GGUF index's layer (slot regions sized for its largest read)
            heads = heads[key[1]].tolist()
            check = ([(i, a + heads[i], z + heads[i]) for i, a, z in check[0]], check[1])
            lengths = [-(-(h + n) // ALIGN) * ALIGN for h, (_, n) in zip(heads, reads)]
            reads = [(off - h, n) for h, (off, n) in zip(heads, reads)]
        self._plan[key] = plan = ([off for off, _ in reads], check, sum(n for _, n in reads), lengths)
        return plan

    def _landed(self, key, fut):
        """What the cache holds once a read has landed: the arena's slot offset, or the decoded expert."""
        try:
            w = self._bytes_of(key, fut)    # a failed read or checksum raises here, in the compute thread
        except Exception:
            self.cache.drop(key)            # not in memory: the next request reads it again
            raise
        return self.arena.where[key] if self.arena is not None else w

    def prefetch(self, layer: int, experts, protect=frozenset(), token: int = 0,
                 ev: LayerEvent | None = None) -> list[int]:
        """Predicted experts of `layer` at `token`: start reads for those not in memory. Never evicts `protect`; a
        guess is made and evicts as GuessAdmission says.
        ev: the layer event that pays for the issue (its issue_s, issues, issued)."""
        t0 = time.perf_counter()
        keys = []
        for e in experts if self.guess else ():
            key = (layer, int(e))
            if key in self.cache:
                continue
            if not self._reserve(key, protect, spare=self.spare):
                break
            keys.append(key)
        if keys:
            nbytes = self._issue(keys, priority=1)
            for k in keys:
                self.prefetched[k] = (nbytes // len(keys), token)
            self.tel.prefetch_issued += len(keys)
            if ev is not None:
                ev.issue_s += time.perf_counter() - t0
                ev.issues += 1
                ev.issued += len(keys)
        return [k[1] for k in keys]

    def empty(self):
        """Forget every expert that is not pinned (a cold start): reads still in flight land first, then every
        slot but the pinned ones is free, and no prefetch is outstanding."""
        flying = [(k, v) for k in self.cache.keys() if isinstance(v := self.cache.peek(k), IN_FLIGHT)]
        if flying:
            self._wait([v for _, v in flying], flying[0][0], every=True)
            for _, v in flying:
                v.done()                    # settled: its reader's jobs are free again
        keys = [k for k in self.cache.keys() if k not in self.cache.pinned]
        for k in keys:
            self.cache.drop(k)
        if self.arena is not None:
            self.arena.release(keys)
        self.prefetched.clear()
        self.predicted_for.clear()
        self.to_prefetch.clear()
        self.admission = GuessAdmission(self.admission.window)

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

    # ------------------------------------------------------------ one layer

    def begin_layer(self, layer: int, idx, token: int, ctx: dict, predictor, t0: float):
        """A MoE layer routed to experts `idx` at `token` (the engine's token index): start the predictor's
        prefetches. ctx: what the predictor reads (x, h, logits: numpy; phase; engine); t0: when the router started.
        Returns (needed, event)."""
        phase = ctx["phase"]
        ev = LayerEvent(token=token if phase == "decode" else -1, layer=layer, phase=phase,
                        routed=[], predicted=[], hit=[], t_start=t0)
        ctx["routed"] = idx
        ev.router_s = time.perf_counter() - t0
        ev.predicted = self.predicted_for.pop((layer, token), []) if phase == "decode" else []
        needed = sorted(set(idx.ravel().tolist()))     # np.unique's list, at a fifth of its cost per layer
        if ev.predicted:
            self.admission.scored(ev.predicted, needed)
        self.cache.step()
        if predictor is not None:        # name later layers' experts now; run_layer reads them after its own
            # a prediction that is the routing (oracle, Edge0) evicts as a demand read does; a guess as admitted
            certain = getattr(predictor, "certain", False)
            self.spare = 0 if certain else self.admission.spare()
            self.guess = certain or self.admission.admit()
            t1 = time.perf_counter()
            for target, experts in predictor.predict(layer, ctx).items():
                # a target is a layer (this token) or (layer, token index) for a later token (Edge0)
                target = target if isinstance(target, tuple) else (target, token)
                self.predicted_for[target] = experts = list(map(int, experts))
                self.to_prefetch.append((target, experts if certain else self.admission.admitted(experts)))
            ev.router_s += time.perf_counter() - t1
        ev.routed = needed
        return needed, ev

    def run_layer(self, layer: int, needed: list[int], compute, ev: LayerEvent):
        """Bring every needed expert into memory and call compute(experts, their cache entries) on each batch
        that is in memory together (ready_first: what is there, then each arrival; wait_all: one batch)."""
        protect = {(layer, e) for e in needed}
        ready, pending, backlog = [], {}, []
        t_take = time.perf_counter()
        hit, get, prefetched = ev.hit, self.cache.get, self.prefetched
        for e in needed:
            key = (layer, e)
            ent = get(key)
            self.admission.asked_for(ent is not None, key in prefetched)
            if key in prefetched:
                self.tel.prefetch_used += 1
                del prefetched[key]
            if isinstance(ent, IN_FLIGHT):
                if not ent.done():
                    hit.append(False)                         # a late prefetch: still in flight
                    ev.late += 1
                    pending[e] = ent
                    continue
                if ent.exception() is None:                   # a prefetch that landed in time
                    hit.append(True)
                    self.cache.set(key, self._landed(key, ent))
                    ev.taken += 1
                    ready.append(e)
                    continue
                self.cache.drop(key)        # a read that failed earlier (a prefetch, a failed request): read it again
                ent = None
            hit.append(ent is not None)
            (backlog if ent is None else ready).append(e)
        ev.take_s += time.perf_counter() - t_take
        for key in [k for k, (_, t) in self.prefetched.items() if k[0] == layer and t <= ev.token]:
            self.tel.prefetch_wasted += 1                 # predicted for this layer and token, not used
            self.tel.wasted_bytes += self.prefetched.pop(key)[0]
            self.cache.demote(key)

        def issue_backlog():
            t0 = time.perf_counter()
            keys = []
            while backlog:
                key = (layer, backlog[0])
                if not self._reserve(key, protect):
                    break
                keys.append(key)
                backlog.pop(0)
            if keys:
                ev.bytes_read += self._issue(keys)
                for k in keys:
                    pending[k[1]] = self.cache.peek(k)
                ev.issue_s += time.perf_counter() - t0
                ev.submit_s += time.perf_counter() - t0
                ev.issues += 1
                ev.issued += len(keys)

        def run(es):
            if not es:
                return
            t0 = time.perf_counter()
            compute(es, [self.cache.peek((layer, e)) for e in es])
            ev.compute_s += time.perf_counter() - t0
            protect.difference_update((layer, e) for e in es)   # done with them: evictable for the next wave

        issue_backlog()
        if self.to_prefetch:                # the predictor's reads, queued behind this layer's demand reads
            t0 = time.perf_counter()
            for (target, token), experts in self.to_prefetch:
                self.prefetch(target, experts, protect=protect, token=token, ev=ev)
            self.to_prefetch.clear()
            ev.router_s += time.perf_counter() - t0
        if self.execution == "ready_first":
            run(ready)
            ready = []
        while pending or backlog or ready:
            if pending and (self.execution == "wait_all" or not ready):
                t0 = time.perf_counter()
                done = self._wait(list(pending.values()), (layer, min(pending)), self.execution == "wait_all")
                waited = time.perf_counter() - t0
                dq = sum(getattr(f, "dequant_s", 0.0) for f in done)
                ev.dequant_s += min(waited, dq)
                ev.wait_s += waited - min(waited, dq)
                ev.split_wait(t0, t0 + waited - min(waited, dq), done, self.execution == "wait_all")
                t0 = time.perf_counter()
                for e in [e for e, f in pending.items() if f in done]:
                    ev.took(pending[e], t0)
                    self.cache.set((layer, e), self._landed((layer, e), pending.pop(e)))
                    ready.append(e)
                    ev.taken += 1
                ev.take_s += time.perf_counter() - t0
            run(sorted(ready))
            ready = []
            issue_backlog()
            if backlog and not pending:
                self._wait_for_a_slot(layer, backlog[0], ev)

    def _wait_for_a_slot(self, layer, e, ev):
        """Every free slot is taken by reads in flight (prefetches): wait for one to land, then it can go."""
        flying = {k: v for k in self.cache.keys() if isinstance(v := self.cache.peek(k), IN_FLIGHT) and not v.done()}
        if not flying:
            raise RuntimeError(f"layer {layer}: no cache slot for expert {e}: pinned experts fill the budget")
        t0 = time.perf_counter()
        self._wait(list(flying.values()), next(iter(flying)))
        ev.wait_s += time.perf_counter() - t0
