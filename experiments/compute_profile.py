"""Compute profiles: what an engine's compute thread and reader threads spend per layer, per expert and per token,
measured on this machine (measure_compute), taken from a measured run (compute_from_run) or loaded from a JSON
file (load_compute). The simulator (experiments.simulate) replays a design's decode on a virtual clock with one.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import time
import zlib
from dataclasses import dataclass

import numpy as np

from workbench.errors import WorkbenchError
from workbench.spec import MoESpec
from workbench.store.pack import PARTS, _decode, _encode, expert_kinds, expert_shapes

PROMPT = [1, 2, 3, 4]       # the profile's runs' prompt (token ids): its experts count in what a run holds


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
                              # compared, the cache entry made the slot) and computes on its fresh bytes, or (the
                              # larger) all a streaming run's compute thread spends beyond a resident one's per read
                              # besides its issues: the readers' CPU on shared cores included (_per_read_rest)
    row_s: float | None = None    # per MoE layer, dense + router time of each row of a batch after the first
                                  # (speculative verification); None: each row costs what one token does
    read_floor: dict | None = None  # this machine's reads as its readers served them in the streaming run
                                    # (DeviceProfile's latency_s: an idle reader's wake-up, read_bw, peak_bw,
                                    # queue_depth): what reads take here at the least (_read_floor)
    engine: str = "numpy"     # the engine measured: what an expert costs in its cache (engines.expert_bytes), so what
                              # a byte budget buys (the packed engine's slots of packed bytes, numpy's f32 experts)
    source: str = ""


def measure_compute(model: str, spec: MoESpec, experts: str, tokens: int = 16, engine: str | None = None,
                    preset=None, routing_trace: str | None = None, stream_budget: str = "0.5") -> ComputeProfile:
    """This engine's compute, measured in two runs of the model as `preset` (None: resident), driven by
    `routing_trace` if given (as the runs it predicts are):
      in memory                every expert in memory (or, where they do not all fit here, at the largest budget
                               that does, after a run of the same tokens brought theirs in: only what no read touched
                               counts, _untouched): dense, router (the predictor's naming inside) and other time per
                               layer and token, expert compute per expert on bytes in memory
      at `stream_budget`       what reading costs the compute thread, from the streamer's own timers: an issue (per
                               submit and per expert, fitted over the layers' issues), taking a landed read in (less
                               what a layer's look at its experts costs with every one in memory), and computing
                               on bytes just read instead of bytes long in memory (per expert read); or, where
                               larger, all the run's compute thread spends beyond the resident run's besides its
                               issues, per expert read (the reader threads' CPU on cores it shares shows there)
    Expert compute and what a reader thread does per expert are then timed on this spec's expert shape with the
    engine's own kernels on the formats its pack holds (each layer's: a GGUF's own blocks, ggml's g2..g8, the affine
    formats): the numpy engine's matmuls and the pack's decode (dequant), or the packed engine's compiled kernels
    (ggml's for GGUF blocks) on the encoded bytes, one call per layer's top-k, and the crc its readers check
    (`dequant_s` is then that check)."""
    from experiments.routing_trace import drive
    from workbench.presets import get_preset
    from runtime.session import open_session
    p = get_preset(preset or "resident") if isinstance(preset or "resident", str) else preset
    p = p.with_(experts=experts, speculative=0)     # a batch's rows: _row_cost
    resident, stream_budget = _budgets(model, p, engine, tokens, stream_budget)
    runs, row, reads, workers = [], None, None, 1
    for budget in (resident, stream_budget):
        with open_session(model, p, budget, prompt=PROMPT, tokens=tokens, drive=drive(routing_trace),
                          engine=engine) as s:
            if not runs:            # warm-up, as bench's: kernels compiled or loaded untimed (the streaming run
                # after it needs none, and would find the same experts cached); below "all", the same tokens, so
                # that the measured run finds its experts in memory
                s.generate(PROMPT, tokens=4 if resident == "all" else tokens)
                s.reset_telemetry()
                s.generate(PROMPT, tokens=tokens)
                formats, held, layout = _formats(s.pack), s.pack.quant["experts"], s.pack.layout
            else:                   # warmed up and started cold, as bench measures: first reads into fresh
                s.generate([5, 6, 7, 8], tokens=4)      # buffers and first kernel calls are not a decode's
                s.reset_telemetry()
                s.cold_start()
                with _timed_reads(s.reader) as reads:
                    s.generate(PROMPT, tokens=tokens)
                workers = s.reader.workers
            runs.append(([t for t in s.tel.tokens if t.phase == "decode"],
                         [e for e in s.tel.events if e.phase == "decode"]))
            if len(runs) == 1 and not routing_trace:
                row = _row_cost(s)
            measured_model, name = s.spec, s.engine.name
            mlp = s.engine.mlp if len(runs) == 2 else None
        if len(runs) == 1:
            del s               # its cache (cyclic garbage) gone before the next run fills its own: at full size the
            gc.collect()        # two would not fit together
    (all_dec, all_evs), stream = runs
    quiet = _untouched(all_dec, all_evs)
    dec, evs = quiet if quiet[0] else (all_dec, all_evs)       # none: every token, reads and all
    nl = len(measured_model.moe_layers)
    # medians over the tokens: on a shared machine a stall (another process taking the core) lands in one token
    per_token = {}
    for e in evs:
        per_token.setdefault(e.token, []).append(e)
    at = lambda t: per_token.get(t.token, [])
    dense = statistics.median((t.compute_s - sum(e.compute_s for e in at(t))) / nl for t in dec)
    router = statistics.median(e.router_s for e in evs)
    other = statistics.median(t.other_s + t.flash_wait_s + t.dequant_s for t in dec)
    expert_measured = statistics.median(sum(e.compute_s for e in at(t)) / max(1, sum(len(e.routed) for e in at(t)))
                                        for t in dec)
    issue_call, issue, land = _read_costs(evs, stream[1], expert_measured)
    land = max(land, _per_read_rest(dec, *stream, issue_call, issue))
    d, ff = spec.hidden_size, spec.moe_intermediate_size
    packed = name == "packed"
    shape = (measured_model.hidden_size, measured_model.moe_intermediate_size)
    target = formats if shape == (d, ff) else _formats_at(formats, held, d, ff)
    kernel = (lambda d_, ff_, f: _packed_time(d_, ff_, f, spec.top_k)) if packed else (lambda d_, ff_, f: _mlp_time(mlp, d_, ff_))
    expert = expert_measured
    if shape != (d, ff):
        # another expert shape: the kernel timed at both shapes, the engine's per-expert overhead carried over
        expert += _over_layers(target, lambda f: kernel(d, ff, f)) - _over_layers(formats, lambda f: kernel(*shape, f))
    reps = 20
    work = {f: _reader_work(f, d, ff, packed) for f in target}
    deq = _over_layers(target, lambda f: _mean_time(work[f], reps))
    if measured_model.to_dict() != spec.to_dict():
        # another shape: attention projections and the router timed at both shapes, the difference added
        dense += _dense_time(spec) - _dense_time(measured_model)
        if row is not None:
            row = max(0.0, row + _row_time(spec) - _row_time(measured_model))
        router += _matvec_time(spec.num_experts, spec.hidden_size) - _matvec_time(measured_model.num_experts,
                                                                                  measured_model.hidden_size)
    from workbench import slot_reads
    most = max(target, key=lambda f: len(target[f]))        # the format most layers hold: the contended check's
    ones = np.ones((1, d), np.float32)
    w = _weights(d, ff)
    held_text = "/".join(sorted({k for f in target for k in f}))
    where = "every expert in memory" if resident == "all" else (
        f"its experts in memory at budget {resident}, the largest that fits here (not every expert does), after the "
        f"same tokens ran once: the {len(quiet[0])} of {len(all_dec)} decode tokens no read touched"
        f"{'' if quiet[0] else ', so every token, its reads included'}")
    return ComputeProfile(dense_s=dense, router_s=router, expert_s=expert, dequant_s=deq, other_s=other, issue_s=issue,
                          issue_call_s=issue_call, land_s=land, row_s=row, read_floor=_read_floor(reads, workers),
                          reader_holds_gil=not (packed and slot_reads.runs_here()), engine=name,
                          dequant_busy_s=_contended(work[most], (lambda: kernel(d, ff, most)) if packed else lambda: mlp(
                              ones, w["gate"], w["up"], w["down"])),
                          source=f"measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on this machine (shared, "
                                 f"loaded), {name} engine: {model} as {p.name}{' (routing trace)' if routing_trace else ''} with "
                                 f"{where} for dense/router/other (medians over tokens), at budget "
                                 f"{stream_budget} for issues, reads taken in (the streamer's timers, "
                                 f"{layout} layout) and the reads' floor (the readers' stamps); expert compute and "
                                 f"{'crc check' if packed else 'dequant'} on its {held_text} experts at d={d}, ff={ff} with the "
                                 f"engine's kernels")


def _budgets(model: str, preset, engine: str | None, tokens: int, stream: str) -> tuple[str, str]:
    """The budgets of measure_compute's two runs: "all" and `stream` where a Session of `model` as `preset` can
    hold every expert here (the memory guard's rule, workbench.memory.check_fits); else the largest budget that
    leaves room for what a run of `tokens` holds besides its cache (KV, linear-attention checkpoints, this
    process), a fraction of the experts, and `stream` or, where that holds as much, half of it."""
    from engines import default_engine, engine_class, expert_bytes
    from workbench import memory
    from workbench.host import peak_rss_bytes
    from workbench.presets import Budget
    from workbench.registry import resolve_pack, storage_for
    from workbench.store.pack import Pack
    pack = Pack(resolve_pack(model, *storage_for(model, preset.storage, (), engine)))
    engine = engine or default_engine(pack)
    resident = engine_class(engine).resident_bytes(pack)
    if resident is None:                # an engine that holds its weights itself: the Session does not guard it
        return "all", stream
    item = expert_bytes(engine, pack)
    m = memory.memory_needs(pack.spec, {n: t["shape"] for n, t in pack.tensors.items()}, Budget("all"), item,
                            resident, engine, context=tokens + 16, runtime_bytes=peak_rss_bytes())
    if m["available_bytes"] is None or m["needed_bytes"] <= m["available_bytes"]:
        return "all", stream
    fits = memory.largest_budget(m["run_bytes"] - m["cache_bytes"], m["all_experts_cache_bytes"], m["available_bytes"])
    if not fits[:1].isdigit() or float(fits) <= 0:
        raise WorkbenchError(f"{model}: a compute profile needs some of its experts in memory, and "
                             f"{m['available_bytes'] / 2**20:.0f} MiB available hold none beside its weights "
                             f"({resident / 2**20:.0f} MiB)")
    # no more than the run's own experts need (its prompt and tokens, every one routed to new experts): the
    # machine's memory is not the profile's to take
    used = (len(PROMPT) + tokens) * pack.spec.top_k * len(pack.spec.moe_layers) / pack.num_expert_total
    fits = f"{min(float(fits), math.ceil(100 * used) / 100):.2f}"
    held = lambda b: Budget(b).nbytes(item, pack.num_expert_total)
    return fits, (stream if held(stream) < held(fits) else f"{float(fits) / 2:.2f}")


def _untouched(tokens: list, events: list) -> tuple[list, list]:
    """The decode tokens no read touched (every expert a hit, nothing issued, taken in, late or waited for) and
    their layer events: what a run with every expert in memory measures (with every expert in memory, all of
    them)."""
    quiet = lambda e: all(e.hit) and not (e.issues or e.taken or e.late or e.wait_s)
    loud = {e.token for e in events if not quiet(e)}
    return [t for t in tokens if t.token not in loud], [e for e in events if e.token not in loud]


def _formats(pack) -> dict:
    """{(gate, up, down kinds): its MoE layers} of a pack: the formats its experts are computed on (a GGUF's own
    blocks differ by layer in a mix such as Q2_K_S or Q4_K_M)."""
    out: dict = {}
    for L in pack.spec.moe_layers:
        out.setdefault(tuple(pack.kinds_of(L)[p] for p in PARTS), []).append(L)
    return out


def _formats_at(formats: dict, experts: str, d: int, ff: int) -> dict:
    """The formats at another expert shape: a GGUF's own blocks as they are, a precision's (q4, g4, ...) as
    convert would write that shape (pack.expert_kinds)."""
    if experts == "raw":
        return formats
    shapes = expert_shapes(d, ff)
    kinds = tuple(expert_kinds(shapes, experts)[p] for p in PARTS)
    return {kinds: [L for ls in formats.values() for L in ls]}


def _over_layers(formats: dict, time_of) -> float:
    """The mean over the MoE layers of a per-expert time that depends on the layer's format."""
    n = sum(len(v) for v in formats.values())
    return sum(time_of(f) * len(v) for f, v in formats.items()) / n


def _weights(d: int, ff: int) -> dict:
    rng = np.random.default_rng(0)
    return {"gate": rng.standard_normal((ff, d), dtype=np.float32) * 0.02,
            "up": rng.standard_normal((ff, d), dtype=np.float32) * 0.02,
            "down": rng.standard_normal((d, ff), dtype=np.float32) * 0.02}


def _encoded(kinds: tuple, d: int, ff: int) -> dict:
    """Random weights of one expert, encoded in `kinds` (gate, up, down) as a pack stores them."""
    w = _weights(d, ff)
    return {p: _encode(w[p], k) for p, k in zip(PARTS, kinds)}


def _reader_work(kinds: tuple, d: int, ff: int, packed: bool):
    """What a reader thread does per expert read (Pack.decode_expert): the checksum, and for an engine that does
    not compute on the encoded bytes (numpy) the decode of each part."""
    enc = _encoded(kinds, d, ff)
    shapes = expert_shapes(d, ff)
    if packed:
        return lambda: _crc(enc)
    return lambda: [(zlib.crc32(enc[p]), _decode(enc[p], shapes[p], k)) for p, k in zip(PARTS, kinds)]


def _mean_time(f, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps


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


class _timed_reads:
    """The reads a session's reader serves meanwhile: (submitted ns, [(bytes, started ns, landed ns)] per submit),
    from the readers' own stamps (SlotRead and Future t_start, t_end)."""

    def __init__(self, reader):
        self.reader, self.calls = reader, []

    def __enter__(self):
        submit = self.reader.submit_into

        def timed(requests, priority=0, checks=None):
            t0 = time.perf_counter_ns()
            futs = submit(requests, priority, checks)
            sizes = {k: sum(b.nbytes for _, b in parts) for k, parts in requests}
            self.calls.append((t0, [(sizes[k], f) for k, f in futs.items()]))
            return futs
        self.reader.submit_into = timed
        return self

    def __exit__(self, *exc):
        del self.reader.submit_into             # the class's method again
        self.calls = [(t0, [(n, f.t_start, f.t_end) for n, f in fs if getattr(f, "t_end", 0)])
                      for t0, fs in self.calls]


def _read_floor(reads: _timed_reads | None, workers: int) -> dict | None:
    """What a read takes on this machine in a streaming run of the engine (its readers and compute thread sharing
    the cores with each other and whatever else runs), as DeviceProfile fields: a latency (the median wait from a
    submit to its first read starting: a reader's wake-up, which the simulator charges to a read that finds its
    reader idle), the median rate of a read that ran alone (read_bw) and the rate the readers reached together
    where reads overlapped (peak_bw: the overlapping reads' bytes over the time they covered; a read's own rate
    times the readers would count two reads that only touched as `workers` in flight); the simulator floors the
    device's reads at them. Experts read in one preadv share its stamps and count as one read. None: no reads."""
    firsts = [min(t for _, t, _ in fs) - t0 for t0, fs in reads.calls if fs] if reads else []
    merged: dict = {}           # experts read in one preadv (adjacent in the pack) share its stamps: one read
    for i, (_, fs) in enumerate(reads.calls if reads else []):
        for n, t, t1 in fs:
            if t1 > t:
                merged[(i, t, t1)] = merged.get((i, t, t1), 0) + n
    spans = sorted((t, t1, n) for (_, t, t1), n in merged.items())
    if not firsts or not spans:
        return None
    alone, shared, together = [], [], []    # rates of reads alone and overlapping; (bytes, ns) of each overlap
    run, reach = [spans[0]], spans[0][1]
    for span in spans[1:] + [(float("inf"), float("inf"), 0)]:
        if span[0] < reach:
            run.append(span)
            reach = max(reach, span[1])
            continue
        rates = [n / ((t1 - t) / 1e9) for t, t1, n in run]
        if len(run) == 1:
            alone += rates
        else:
            shared += rates
            together.append((sum(n for *_, n in run), reach - run[0][0]))
        run, reach = [span], span[1]
    bw = statistics.median(alone or shared)
    peak = max(bw, sum(b for b, _ in together) / (sum(ns for _, ns in together) / 1e9)) if together else \
        bw * max(1, workers)
    return {"latency_s": max(0.0, statistics.median(firsts) / 1e9), "read_bw": bw, "peak_bw": peak,
            "queue_depth": max(1, workers)}


def _crc(enc):
    """What the packed engine's reader thread does per expert (Pack.decode_expert(raw=True)): the checksum."""
    crc = 0
    for p in PARTS:
        crc = zlib.crc32(enc[p], crc)
    return crc


def _packed_time(d: int, ff: int, kinds: tuple, k: int, reps: int = 10) -> float:
    """Per expert: the packed engine's kernel on k experts' encoded bytes in one call, as the engine calls it per
    layer: engines/packed_kernels.moe_layer on the affine formats and bf16, ggml's (engines/ggml_kernels.moe_ready)
    on GGUF blocks."""
    from engines import ggml_kernels as G
    from engines import packed_kernels as K
    shapes = expert_shapes(d, ff)
    enc = _encoded(kinds, d, ff)
    slot = np.concatenate([enc[p] for p in PARTS])
    nbytes = slot.nbytes
    arena = np.tile(slot, k)
    off, idx = np.arange(k, dtype=np.int64) * nbytes, np.arange(k, dtype=np.int64)
    X, Y, w = np.ones((1, d), np.float32), np.empty((k, d), np.float32), np.ones(k, np.float32)
    if all(kind in K.BITS for kind in kinds):
        parts, _ = K.expert_parts(shapes, dict(zip(PARTS, kinds)))
        call = lambda: K.moe_layer(arena, off, np.zeros(k, np.int64), idx, w, X, Y, parts, d, ff, K.F16)
    else:
        starts = np.cumsum([0] + [enc[p].nbytes for p in PARTS])
        parts = G.expert_parts(shapes, dict(zip(PARTS, kinds)), dict(zip(PARTS, map(int, starts))))
        heads = np.zeros((k, 3), np.int64)
        call = lambda: G.moe_ready(arena, idx, off, idx, k, w, X, Y, parts, heads, d, ff)
    call()                                           # compiled (cached) before timing
    return _mean_time(call, reps) / k


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


def _per_read_rest(resident_tokens, stream_tokens, stream_events, issue_call: float, issue: float) -> float:
    """Per expert read taken in, what the streaming run's compute thread spends beyond the resident run's typical
    token (flash waits aside) that its issues do not explain: taking reads in, computing on fresh bytes, and the
    CPU the reader threads take from it where they share its cores (their syscalls and crc checks, their wake-ups),
    which show as slower dense, router and other time, not in the streamer's timers. The median over the tokens
    that took reads in of each one's excess per read: a stall lands in one token."""
    if not resident_tokens:
        return 0.0
    busy = lambda t: t.compute_s + t.router_s + t.other_s
    base = statistics.median(busy(t) for t in resident_tokens)
    per_token: dict = {}
    for e in stream_events:
        per_token.setdefault(e.token, []).append(e)
    rest = []
    for t in stream_tokens:
        evs = per_token.get(t.token, [])
        taken = sum(e.taken for e in evs)
        if taken:
            issued = sum(issue_call * e.issues + issue * e.issued for e in evs)
            rest.append((busy(t) - base - issued) / taken)
    return max(0.0, statistics.median(rest)) if rest else 0.0


def load_compute(path) -> ComputeProfile:
    d = json.loads(open(path).read())
    if "slots" in d:                        # a profile written before it named its engine
        d["engine"] = "packed" if d.pop("slots") else "numpy"
    return ComputeProfile(**d)
