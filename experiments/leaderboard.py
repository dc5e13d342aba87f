"""The leaderboard: every design given (the built-ins, the field's, your own files) on every routing trace given, at
budgets 0.05-0.5, on the schedule every clock shares (workbench/schedule.py).

    python -m workbench leaderboard data/traces/qwen3-30b-a3b-bigmoeonedge.parquet --design mine.py:Mine --json

Per trace, design and budget:
  replay       hit rate, experts and bytes read a token, every read landing at once (experiments.simulate.replay_run)
  Belady       the hit rate of optimal replacement over the same decode accesses, and the design's fraction of it
               (a prefetching design can pass 1: a prefetch that lands in time is a hit Belady's demand reads lack)
  simulated    tok/s on each device profile's flash with one compute profile (measured on --model, or --compute
               FILE), labelled SIMULATED; not run where neither gives one (an imported trace names no model here)
"""
from __future__ import annotations

import dataclasses
import time

from workbench.errors import WorkbenchError

BUILTIN = ("on_demand", "history", "shuffled", "les", "smol", "oracle")
FIELD = tuple(f"workbench.designs.field:{n}" for n in
              ("LFU", "LFUAging", "S3FIFO", "LeastStale", "HotStore", "CoActivation", "LookaheadS3FIFO"))
BUDGETS = ("0.05", "0.1", "0.15", "0.25", "0.35", "0.5")
DEVICES = ("ufs22-phone", "this-machine")


def label(name: str) -> str:
    """A design's name in tables: a preset's, a module's class (the field's), or a file's name and class."""
    from workbench.designs import short
    return short(name)


@dataclasses.dataclass
class Row:
    """One design on one trace at one budget."""
    trace: str
    design: str
    budget: str
    slots: int
    hit_rate: float
    late_rate: float
    reads_per_token: float
    bytes_per_token: float
    belady_hit_rate: float
    of_belady: float
    recall: float | None
    precision: float | None
    simulated_tok_s: dict           # device -> tok/s (SIMULATED), empty where no compute profile
    prediction: str | None = None   # how the trace drove its predictor (a modelled lookahead's recall, say)
    not_run: str | None = None      # why the design cannot run at this budget or on this trace


def run(traces: list[str], designs=BUILTIN + FIELD, budgets=BUDGETS, devices=DEVICES, compute=None,
        model: str | None = None, tokens: int | None = None, prompt: int = 4, skip: int = 0,
        engine: str | None = None, progress=None, workers: int | None = None) -> dict:
    """compute: a ComputeProfile for every trace (else measured once per trace on `model`, at q4 experts; else the
    simulated columns are not run, and the result says why). The (trace, design) pairs run on `workers` processes
    (default: every core), each a design's budgets in turn."""
    from engines import default_engine
    from experiments.compute_profile import measure_compute
    from experiments.routing_trace import TraceDrive
    from experiments.simulate import decode_accesses
    from experiments.traces import read_trace
    from workbench import devices as D
    from workbench.presets import get_preset
    from workbench.spec import MoESpec
    t0 = time.perf_counter()
    for d in designs:
        get_preset(d)                   # every design loads, or one line says why, before anything runs
    profiles = [D.load(d) for d in devices]
    jobs, notes, used = [], {}, {}
    for path in traces:
        tr = read_trace(path)
        spec = MoESpec.from_dict(tr["meta"]["spec"])
        prof = compute
        if prof is None and model:
            prof = measure_compute(model, spec, "q4", tokens=16, engine=engine)
        used[str(path)] = dataclasses.asdict(prof) if prof else None
        notes[str(path)] = ("SIMULATED with " + (prof.source or f"a compute profile of the {prof.engine} engine")
                            if prof else "not simulated: no compute profile (pass --model, a checkpoint of the "
                                         "trace's shape, or --compute FILE)")
        n = tokens or len(tr["ids"]) - prompt - skip + 1
        eng = prof.engine if prof else (engine or default_engine())
        seq = decode_accesses(TraceDrive(str(path), spec, None, trace=tr, skip=skip), spec, prompt, n)
        jobs += [(str(path), tr, spec, d, budgets, profiles, prof, n, prompt, skip, eng, seq) for d in designs]
    rows = []
    for got in _map(_design_rows, jobs, workers):
        rows += got
        if progress:
            progress("\n".join(f"{label(r.design)} @{r.budget}: " + (f"hit {r.hit_rate:.3f} (Belady "
                                                                      f"{r.belady_hit_rate:.3f})" if not r.not_run
                                                                      else f"not run: {r.not_run}") for r in got))
    return {"traces": [str(t) for t in traces], "designs": list(designs), "budgets": list(budgets),
            "devices": [d.name for d in profiles], "tokens": tokens, "prompt": prompt, "skip": skip,
            "compute": notes, "compute_profiles": used, "clock": "replay: every read lands at once; simulated: each device profile's reads "
                                       "and the compute profile's time (SIMULATED)",
            "rows": [dataclasses.asdict(r) for r in rows], "seconds": time.perf_counter() - t0}


def _map(fn, jobs: list, workers: int | None):
    import multiprocessing
    import os
    n = min(len(jobs), workers or os.cpu_count() or 1)
    if n <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(fn, jobs)
        return
    with multiprocessing.get_context("fork").Pool(n) as pool:       # the traces and loaded designs, inherited
        yield from pool.imap(fn, jobs)


def _design_rows(job) -> list[Row]:
    """One design on one trace at every budget: replay, Belady, and the simulated clocks."""
    from experiments.routing_trace import TraceDrive
    from experiments.simulate import belady, replay_run, simulable, simulate_run
    from workbench.presets import get_preset
    path, tr, spec, name, budgets, profiles, prof, n, prompt, skip, eng, seq = job
    sized = not str(tr["meta"].get("expert_size", "")).startswith("unknown")     # import_trace.UNSIZED: no bytes
    p, why = simulable_or_none(get_preset(name), simulable)
    rows = []
    drive = None
    for b in budgets:
        if why:
            rows.append(_not_run(path, name, b, why))
            continue

        def fresh():        # a predictor of the design's own learns as it runs: each run starts it anew
            nonlocal drive
            if drive is None or drive.own is not None:
                drive = TraceDrive(path, spec, str(p.prefetch) or None, trace=tr, skip=skip,
                                   recall=p.prefetch.recall, params=dict(p.params))
            return drive
        try:
            res = replay_run(fresh(), spec, p, b, n, prompt, eng)
        except WorkbenchError as e:
            if "below one layer's top-k" not in str(e) and "hot store" not in str(e):
                raise
            rows.append(_not_run(path, name, b, str(e)))
            continue
        bound = belady(drive, spec, p, b, prompt, n, initial=res.at_decode, engine=eng, accesses=seq)
        sim = {dev.name: simulate_run(fresh(), spec, p, b, dev, prof, n, prompt, dev.queue_depth,
                                      shared_cpu=prof.reader_holds_gil, split=not prof.reader_holds_gil).summary.tok_s
               for dev in (profiles if prof else ())}
        r, bh = res.summary.record(), bound["belady_hit_rate"]
        rows.append(Row(path, name, b, r["pool_slots"], r["hit_rate"], r["late_rate"], r["experts_read_per_token"],
                        r["bytes_read_per_token"] if sized else None, bh, r["hit_rate"] / bh if bh else float("nan"),
                        r["prefetch_recall"], r["prefetch_precision"], sim, drive.source.get("prediction")))
    return rows


def simulable_or_none(p, simulable):
    """(preset, None), or (preset, why a trace cannot run it)."""
    try:
        return simulable(p), None
    except WorkbenchError as e:
        return p, str(e)


def _not_run(path, name, budget, why) -> Row:
    nan = float("nan")
    return Row(str(path), name, budget, 0, nan, nan, nan, nan, nan, nan, None, None, {}, None, why)


def table(res: dict) -> str:
    """Markdown: per trace, the designs at each budget, best hit rate first."""
    out = []
    for t in res["traces"]:
        rows = [r for r in res["rows"] if r["trace"] == t]
        out += [f"### {t}", "", res["compute"][t], "",
                "| budget | design | hit | of Belady | Belady | reads/token | MB/token | "
                + " | ".join(f"tok/s {d} (SIMULATED)" for d in res["devices"]) + " |",
                "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(res["devices"])]
        for b in res["budgets"]:
            ok = sorted((r for r in rows if r["budget"] == b and not r["not_run"]), key=lambda r: -r["hit_rate"])
            for r in ok:
                sims = [f"{r['simulated_tok_s'][d]:.1f}" if d in r["simulated_tok_s"] else "" for d in res["devices"]]
                mb = "" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e6:.2f}"
                out.append(f"| {b} | {label(r['design'])} | {r['hit_rate']:.3f} | {r['of_belady']:.2f} | "
                           f"{r['belady_hit_rate']:.3f} | {r['reads_per_token']:.1f} | {mb} | "
                           + " | ".join(sims) + " |")
            for r in (r for r in rows if r["budget"] == b and r["not_run"]):
                out.append(f"| {b} | {label(r['design'])} | not run: {r['not_run']} |||||" + "|" * len(res["devices"]))
        said = {label(r["design"]): r["prediction"] for r in rows if r.get("prediction")}
        out += [""] + [f"- {d}: {why}" for d, why in said.items()]
        out.append("")
    return "\n".join(out)
