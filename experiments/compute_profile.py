"""Compute profiles: what an engine's compute thread and reader threads spend per layer, per expert and per token,
measured on this machine (measure_compute), taken from a measured run (compute_from_run) or loaded from a JSON
file (load_compute). The simulator (experiments.simulate) replays a design's decode on a virtual clock with one.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
import time
import zlib
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

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
    land_s: float = 0.0       # per expert read taken in: the compute thread's time on it (its read settled, its crc
                              # compared, the cache entry made the slot, its fresh bytes computed on)
    after_issue_s: float = 0.0    # per issue, after its call: the compute thread's time lost while the readers it
                                  # woke start on the cores it shares (both fitted over a streaming run's tokens:
                                  # _reading_costs)
    row_s: float | None = None    # per MoE layer, dense + router time of each row of a batch after the first
                                  # (speculative verification); None: each row costs what one token does
    expert_row_s: float | None = None     # per expert, each row of a batch after the first that routes to it (one
                                          # kernel call computes an expert's rows); None: expert_s a row
    draft_s: float = 0.0      # per draft token proposed: a real draft's own time (a draft model's forward, an MTP
                              # block's), measured in its run (benchmarks/speculative.py); 0: modelled drafts cost nothing
    read_floor: dict | None = None  # this machine's reads as its readers served them in the streaming run
                                    # (devices.ServedReads: an idle reader's wake-up, a read's latency and bandwidth
                                    # alone and beside another): what reads take here at the least (_read_floor)
    engine: str = "numpy"     # the engine measured: what an expert costs in its cache (engines.slot_bytes), so what
                              # a byte budget buys (the packed engine's slots of packed bytes, numpy's f32 experts)
    source: str = ""


def measure_compute(model: str, spec: MoESpec, experts: str, tokens: int = 16, engine: str | None = None,
                    preset=None, routing_trace: str | None = None, stream_budget: str = "0.5",
                    device: str | None = None) -> ComputeProfile:
    """This engine's compute, measured in runs of the model as `preset` (None: resident) of `tokens` tokens each (the
    runs predicted: attention grows with the context), driven by `routing_trace` if given (as the runs it predicts
    are), the streaming ones' reads emulated as `device` if given (for runs predicted under that emulation here: its
    readers' sleeps and wake-ups share the cores too):
      in memory                every expert in memory (or, where they do not all fit here, at the largest budget
                               that does, after a run of the same tokens brought theirs in: only what no read touched
                               counts, _untouched): dense, router (the predictor's naming inside) and other time per
                               layer and token, expert compute per expert on bytes in memory
      at `stream_budget`       three cold runs: what reading costs the compute thread: the submit call (per issue
                               and per expert, by the streamer's own timers), and what their tokens spend beyond the
                               resident run's besides those calls, fitted per issue (the readers woken on the cores it
                               shares) and per read taken in (_reading_costs); and how this machine's readers served
                               their reads (their own stamps: _read_floor)
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
    decode = lambda tel: ([t for t in tel.tokens if t.phase == "decode"], [e for e in tel.events if e.phase == "decode"])
    row, reads, poll_ns, stream = None, None, 0, []
    for budget in (resident, stream_budget):
        with open_session(model, p, budget, prompt=PROMPT, tokens=max(4, tokens), drive=drive(routing_trace), engine=engine,
                          device=device if budget is stream_budget else None) as s:
            if budget is resident:  # warm-up, as bench's: kernels compiled or loaded untimed (the streaming run
                # after it needs none, and would find the same experts cached); below "all", the same tokens, so
                # that the measured run finds its experts in memory
                s.generate_text(PROMPT, 4 if resident == "all" else tokens)
                s.reset_telemetry()
                s.generate_text(PROMPT, tokens)
                formats, held, layout = _formats(s.pack), s.pack.quant["experts"], s.pack.layout
                all_dec, all_evs = decode(s.tel)
                row, expert_row = (None, None) if routing_trace else _row_cost(s)
            else:                   # warmed up and started cold, as bench measures: first reads into fresh
                s.generate([5, 6, 7, 8], tokens=4)      # buffers and first kernel calls are not a decode's
                with _timed_reads(s.reader) as reads:   # three runs (a fit's point a token), each at the
                    for _ in range(3):                  # contexts of the runs predicted (attention grows with them)
                        s.reset_telemetry()
                        s.cold_start()
                        s.generate_text(PROMPT, tokens)      # forced text on a made checkpoint (runtime.text)
                        stream.append(decode(s.tel))
                poll_ns = s.reader.poll_ns
                mlp = s.engine.mlp
            measured_model, name = s.spec, s.engine.name
    quiet = _untouched(all_dec, all_evs)
    dec, evs = quiet if quiet[0] else (all_dec, all_evs)       # none: every token, reads and all
    nl = len(measured_model.moe_layers)
    # means over the tokens, stalls and all: a run's time is their sum, and the runs predicted stall as often
    at = _by_token(evs)
    dense = statistics.fmean([(t.compute_s - sum(e.compute_s for e in at(t))) / nl for t in dec])
    router = statistics.fmean([e.router_s for e in evs])
    other = statistics.fmean([t.other_s + t.flash_wait_s + t.dequant_s for t in dec])
    expert_measured = statistics.fmean([sum(e.compute_s for e in at(t)) / max(1, sum(len(e.routed) for e in at(t)))
                                        for t in dec])
    issue_call, issue = _issue_costs([e for _, evs_ in stream for e in evs_])
    after_issue, land = _reading_costs(dec, stream, issue_call, issue)
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
                          issue_call_s=issue_call, after_issue_s=after_issue, land_s=land, row_s=row,
                          expert_row_s=expert_row,
                          read_floor=_read_floor(reads, poll_ns),
                          reader_holds_gil=not (packed and slot_reads.runs_here()), engine=name,
                          dequant_busy_s=_contended(work[most], (lambda: kernel(d, ff, most)) if packed else lambda: mlp(
                              ones, w["gate"], w["up"], w["down"])),
                          source=f"measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on this machine (shared, "
                                 f"loaded), {name} engine: {model} as {p.name}{' (routing trace)' if routing_trace else ''} with "
                                 f"{where} for dense/router/other (means over tokens), at budget "
                                 f"{stream_budget}{f' (reads emulated as {device})' if device else ''} for issues, "
                                 f"reads taken in (the streamer's timers, "
                                 f"{layout} layout) and the reads' floor (the readers' stamps); expert compute and "
                                 f"{'crc check' if packed else 'dequant'} on its {held_text} experts at d={d}, ff={ff} with the "
                                 f"engine's kernels")


def _by_token(events):
    """A token record's layer events (of one run: token indices repeat across runs)."""
    per_token: dict = {}
    for e in events:
        per_token.setdefault(e.token, []).append(e)
    return lambda t: per_token.get(t.token, [])


def _ordinary(xs: np.ndarray) -> np.ndarray:
    """Which values lie within four robust deviations (1.4826 MAD) of their median: the others are stalls."""
    med = np.median(xs)
    return np.abs(xs - med) <= 4 * 1.4826 * np.median(np.abs(xs - med))


def _budgets(model: str, preset, engine: str | None, tokens: int, stream: str) -> tuple[str, str]:
    """The budgets of measure_compute's two runs: "all" and `stream` where a Session of `model` as `preset` can
    hold every expert here (the memory guard's rule, workbench.memory.check_fits); else the largest budget that
    leaves room for what a run of `tokens` holds besides its cache (KV, linear-attention checkpoints, this
    process), a fraction of the experts, and `stream` or, where that holds as much, half of it."""
    from engines import default_engine, engine_class, slot_bytes
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
    item = slot_bytes(engine, pack)
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
    """The reads a session's reader serves meanwhile, from the readers' own stamps: calls, (called ns, returned ns,
    [(bytes, started ns, landed ns)] per key) per submit (SlotRead and Future t_start, t_end), and jobs, [(bytes,
    started ns, landed ns)] per preadv where the readers log them (the slot readers: a key of the native layout is
    three)."""

    def __init__(self, reader):
        self.reader, self.calls, self.jobs = reader, [], []

    def __enter__(self):
        submit = self.reader.submit_into

        def timed(requests, priority=0, checks=None):
            t0 = time.perf_counter_ns()
            futs = submit(requests, priority, checks)
            sizes = {k: sum(b.nbytes for _, b in parts) for k, parts in requests}
            self.calls.append((t0, time.perf_counter_ns(), [(sizes[k], f) for k, f in futs.items()]))
            return futs
        self.reader.submit_into = timed
        self.logs = getattr(self.reader, "log", None) is None      # a test's log left as it is
        if self.logs:
            self.reader.log = []
        return self

    def __exit__(self, *exc):
        del self.reader.submit_into             # the class's method again
        self.calls = [(t0, t1, [(n, f.t_start, f.t_end) for n, f in fs if getattr(f, "t_end", 0)])
                      for t0, t1, fs in self.calls]
        if self.logs:
            self.jobs = [(int(n), round(t * 1e9), round(t1 * 1e9)) for n, _, t, t1 in self.reader.log]
            self.reader.log = None


def _read_floor(reads: _timed_reads | None, poll_ns: int = 0) -> dict | None:
    """What a read takes on this machine in a streaming run of the engine (its readers and compute thread sharing
    the cores with each other and whatever else runs), for devices.ServedReads: an idle reader's wake-up (the
    mean wait from the return of a submit call that found every reader idle to its first read starting, as the
    simulator's reader pool starts it after the issue's call; apart, where a reader that
    landed a read less than poll_ns before polls for the next: the slot readers'), and a read's service as
    latency + bytes / bandwidth, fitted apart for reads that started alone and reads that started while another
    was in flight (a reader that just woke on an idle core serves slower than one already running). Each preadv is
    a read (the readers' log; else experts read in one preadv, which share its stamps, count as one). None: no
    reads."""
    if not reads or not any(fs for _, _, fs in reads.calls):
        return None
    spans = sorted((t, t1, n) for n, t, t1 in reads.jobs) if reads.jobs else \
        sorted((t, t1, n) for (_, t, t1), n in _merged(reads.calls).items())
    starts, ends = [t for t, _, _ in spans], sorted(t1 for _, t1, _ in spans)
    in_flight = lambda t: bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)    # reads with start <= t < end
    firsts = [(t0, t1, min(t for _, t, _ in fs)) for t0, t1, fs in reads.calls if fs]
    sleeping, polling = [], []          # the waits of submits that found every reader idle, from the call's return
    for t0, t1, t in firsts:
        if not in_flight(t0):
            last = ends[bisect.bisect_right(ends, t0) - 1] if ends[0] <= t0 else None
            (polling if last is not None and t0 - last < poll_ns else sleeping).append((t - t1) / 1e9)
    alone, overlapped = [], []
    for t, t1, n in spans:
        (alone if in_flight(t) == 1 else overlapped).append((n, (t1 - t) / 1e9))
    fits = [_service(x) for x in (alone, overlapped)]
    fits = [f or next(g for g in fits if g) for f in fits]
    mean = lambda xs: max(0.0, statistics.fmean(xs))
    wake = mean(sleeping or polling or [(t - t1) / 1e9 for _, t1, t in firsts])
    return {"wake_s": wake, "wake_polling_s": mean(polling) if polling else wake, "poll_s": poll_ns / 1e9,
            "latency_s": [f[0] for f in fits], "read_bw": [f[1] for f in fits]}


def _merged(calls) -> dict:
    """{(submit, started, landed): bytes}: the keys of one submit that share a preadv's stamps, as one read."""
    merged: dict = {}
    for i, (_, _, fs) in enumerate(calls):
        for n, t, t1 in fs:
            if t1 > t:
                merged[(i, t, t1)] = merged.get((i, t, t1), 0) + n
    return merged


def _service(reads: list) -> tuple[float, float] | None:
    """(latency, bandwidth) of reads [(bytes, seconds)]: _line; None: no reads."""
    by: dict = {}
    for n, t in reads:
        by.setdefault(n, []).append(t)
    if not by:
        return None
    lat, per_byte = _line(by)
    return lat, 1 / per_byte if per_byte > 0 else math.inf


def _line(by: dict) -> tuple[float, float]:
    """(intercept, slope) of a line through the mean y of each x ({x: [y]}; a run's time is the sum of its reads' and
    calls', stalls and all), each point weighted by the root of its count, neither negative (non-negative least
    squares: where the means do not grow with x the cost is the intercept's, a call's, not x's); one x: no
    intercept, the points' ratio."""
    xs = np.array(sorted(by), float)
    mean = np.array([statistics.fmean(by[x]) for x in sorted(by)])
    count = np.array([len(by[x]) for x in sorted(by)], float)
    if len(xs) > 1:
        w = np.sqrt(count)
        at0, slope = nnls(np.c_[np.ones_like(xs), xs] * w[:, None], mean * w)[0]
        return float(at0), float(slope)
    return 0.0, float(np.sum(mean * count) / np.sum(xs * count))


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


def _row_cost(s, rows: int = 5, reps: int = 8) -> tuple[float, float | None]:
    """What each row after the first adds to a decode step (a speculative batch of `rows`, the LES ladder's 1 + 4):
    per MoE layer, to its dense and router time; per expert, to its compute where the row routes to an expert
    another row does (the expert's rows in one kernel call). Decode steps of 1 and of `rows` distinct tokens at the
    session's position, the KV cache truncated back after each, medians; the second None where no batch shared an
    expert."""
    e, tel, nl = s.engine, s.tel, len(s.spec.moe_layers)
    took, per_expert, shared = {1: [], rows: []}, [], []
    for _ in range(reps):
        for n in took:
            pos, n_ev = e.pos, len(tel.events)
            s.step(list(range(1, n + 1)), "decode")
            e.truncate(pos)
            evs, tok = tel.events[n_ev:], tel.tokens[-1]
            took[n].append((tok.compute_s - sum(v.compute_s for v in evs) + tok.router_s) / nl)
            distinct, pairs = sum(len(v.routed) for v in evs), sum(v.chosen for v in evs)
            if n == 1:
                per_expert.append(sum(v.compute_s for v in evs) / max(1, distinct))
            elif pairs > distinct:
                shared.append((sum(v.compute_s for v in evs), distinct, pairs - distinct))
    row = max(0.0, (statistics.median(took[rows]) - statistics.median(took[1])) / (rows - 1))
    if not shared:
        return row, None
    one = statistics.median(per_expert)
    return row, max(0.0, statistics.median((moe - d * one) / extra for moe, d, extra in shared))


def _issue_costs(stream_events) -> tuple[float, float]:
    """(per issue, per expert issued): the submit call itself, by the streamer's own timers in a streaming run
    (telemetry.LayerEvent issue_s): a line through the mean time of a layer's one submit of n experts (_line)."""
    by_n: dict = {}             # experts in a layer's one submit -> its times
    for e in stream_events:
        if e.issues == 1:
            by_n.setdefault(e.issued, []).append(e.issue_s)
    by_n = {k: v for k, v in by_n.items() if len(v) >= 3} or by_n     # a size seen once or twice: too few to fit
    return _line(by_n) if by_n else (0.0, 0.0)


def _reading_costs(resident_tokens, stream_runs, issue_call: float, issue: float) -> tuple[float, float]:
    """(per issue after its call, per read taken in): what streaming runs' compute thread spends beyond the
    resident run's mean token (flash waits aside) and beyond its submit calls, fitted over their tokens as
    a * issues + b * reads taken in (non-negative, a token whose excess is far off the fit dropped: a stall).
    Taking a read in and computing on its fresh bytes go with the reads; the reader threads' wake-ups and CPU on
    the cores the compute thread shares go with the submits that start them, and show as slower dense, router and
    other time, not in the streamer's timers."""
    if not resident_tokens:
        return 0.0, 0.0
    busy = lambda t: t.compute_s + t.router_s + t.other_s
    base = statistics.fmean([busy(t) for t in resident_tokens])
    X, y = [], []
    for stream_tokens, stream_events in stream_runs:      # (decode tokens, their layer events) of each run
        at = _by_token(stream_events)
        for t in stream_tokens:
            evs = at(t)
            issues, issued, taken = (sum(getattr(e, k) for e in evs) for k in ("issues", "issued", "taken"))
            if issues or taken:
                X.append((issues, taken))
                y.append(busy(t) - base - issue_call * issues - issue * issued)
    if not X:
        return 0.0, 0.0
    X, y = np.array(X, float), np.array(y)
    keep = np.ones(len(y), bool)
    for _ in range(3):
        coef = nnls(X[keep], y[keep])[0]
        keep = _ordinary(y - X @ coef)
    return float(coef[0]), float(coef[1])


def load_compute(path) -> ComputeProfile:
    d = json.loads(open(path).read())
    if "slots" in d:                        # a profile written before it named its engine
        d["engine"] = "packed" if d.pop("slots") else "numpy"
    if (fl := d.get("read_floor")) and "peak_bw" in fl:      # a floor written before it fitted a read's latency
        d["read_floor"] = {"wake_s": fl["latency_s"], "latency_s": [0.0, 0.0],
                           "read_bw": [fl["read_bw"], min(fl["read_bw"], fl["peak_bw"] / 2)]}
    return ComputeProfile(**d)
