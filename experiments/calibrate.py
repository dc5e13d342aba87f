"""simulate --calibrate's runs: the simulator as a user runs it (A) against measured runs of the same designs on
this machine, per design, budget and device, arms alternating within each round (experiments.calibration stores
and labels the result).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

from experiments.calibration import BUDGETS, DESIGNS, DEVICES, PROMPT, TRACE, machine
from workbench.errors import WorkbenchError


def _med(xs: list) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def calibrate(designs=DESIGNS, budgets=BUDGETS, devices=DEVICES, rounds: int = 3, tokens: int = 32,
              trace=TRACE, model: str = "demo", log=print) -> dict:
    """Measured (bench --routing-trace) vs simulated A for each design x budget x device (resident: at all, once a
    round); each round measures each design's compute profile once per device (measure_compute: runs of its own,
    never the runs it predicts; its streaming run's reads emulated as the device's arms are) and the compute
    thread's wake-up with this machine's reads (probe_reader), and alternates the arms' order from round to
    round."""
    from experiments.bench import measure
    from experiments.routing_trace import drive
    from runtime.session import open_session
    from experiments.compute_profile import measure_compute
    from experiments.simulate import run as simulate
    from experiments.traces import read_trace
    from workbench import devices as D, disk_probe
    from workbench.io import slot_readers
    from workbench.presets import get_preset
    from workbench.registry import resolve_pack
    from workbench.spec import MoESpec
    if rounds < 1 or tokens < 2:
        raise WorkbenchError(f"simulate --calibrate: --rounds {rounds} and --tokens {tokens}: at least 1 and 2")
    from experiments.simulate import simulable
    from workbench.presets import Budget
    for dev in devices:
        D.load(dev)
    for d in designs:
        simulable(get_preset(d))
    for b in budgets:
        Budget(b)
    trace = str(trace)
    spec = MoESpec.from_dict(read_trace(trace)["meta"]["spec"])
    arms = [(dev, d, "all" if d == "resident" else b) for dev in devices for d in designs
            for b in (("all",) if d == "resident" else budgets)]
    got = {a: {"measured": [], "simulated": [], "simulated_no_floor": [], "typical": [], "hit_measured": [],
               "hit_simulated": []}
           for a in arms}
    profiles = {dev: {d: [] for d in designs} for dev in devices}
    load0, t0 = os.getloadavg(), time.time()
    prompt, skipped = None, {}
    for r in range(rounds):
        wake = disk_probe.probe_reader(resolve_pack(model, "contiguous", "q4", "q4"),
                                       workers=slot_readers()).sources["wake_s"]
        # each design's profile, its streaming run's reads as the arms it predicts read (this disk, or emulated)
        cps = {(dev, d): dataclasses.replace(measure_compute(
            model, spec, get_preset(d).storage.experts, preset=d, routing_trace=trace, tokens=tokens,
            device=None if dev == "this-machine" else dev), wake_s=wake) for dev in devices for d in designs}
        for (dev, d), cp in cps.items():
            profiles[dev][d].append(dataclasses.asdict(cp))
        for dev, d, b in (arms if r % 2 == 0 else arms[::-1]):
            if (dev, d, b) in skipped:
                continue
            try:
                with open_session(model, d, b, prompt=PROMPT, tokens=tokens, drive=drive(trace),
                                  device=None if dev == "this-machine" else dev) as sess:     # as bench runs it
                    m = measure(sess, PROMPT, tokens)
                    m["typical_tok_s"] = 1 / statistics.median(t.wall_s for t in sess.tel.tokens
                                                               if t.phase == "decode")
            except WorkbenchError as e:      # a budget the design cannot run at (per-layer pools below top-k)
                if r or "below one layer's top-k" not in str(e):
                    raise
                skipped[(dev, d, b)] = str(e)
                continue
            if prompt is None:
                prompt = _prompt_tokens(model)
            s = simulate(trace, d, b, dev, tokens=tokens, prompt=prompt, compute=cps[(dev, d)],
                         workers=m["reader_workers"], record=False, here=True)
            s0 = simulate(trace, d, b, dev, tokens=tokens, prompt=prompt, record=False, workers=m["reader_workers"],
                          compute=dataclasses.replace(cps[(dev, d)], read_floor=None))      # the model before read_floor
            for k, v in (("measured", m["tok_s"]), ("simulated", s["tok_s"]), ("simulated_no_floor", s0["tok_s"]),
                         ("typical", m["typical_tok_s"]),
                         ("hit_measured", m["hit_rate"]),
                         ("hit_simulated", s["hit_rate"])):
                got[(dev, d, b)][k].append(v)
            if log:
                log(f"round {r + 1}/{rounds} {dev} {d} budget {b}: measured {m['tok_s']:.1f} tok/s, "
                    f"SIMULATED (A) {s['tok_s']:.1f}")
    rows = []
    for dev, d, b in (a for a in arms if a not in skipped):
        x = got[(dev, d, b)]
        mm, ss = _med(x["measured"]), _med(x["simulated"])
        s0 = _med(x["simulated_no_floor"])
        rows.append({"device": dev, "design": d, "budget": b, "measured_tok_s": mm, "simulated_tok_s": ss,
                     "a_over_measured": ss["median"] / mm["median"], "simulated_no_floor_tok_s": s0,
                     "no_floor_over_measured": s0["median"] / mm["median"], "typical_tok_s": _med(x["typical"]),
                     "a_over_typical": ss["median"] / statistics.median(x["typical"]),
                     "hit_measured": statistics.median(x["hit_measured"]),
                     "hit_simulated": statistics.median(x["hit_simulated"])})
    within = {dev: max(abs(r["a_over_measured"] - 1) for r in rows if r["device"] == dev) for dev in devices
              if any(r["device"] == dev for r in rows)}
    return {"machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "elapsed_s": time.time() - t0, "load_start": list(load0), "load_end": list(os.getloadavg()),
            "trace": trace, "model": model, "tokens": tokens, "rounds": rounds, "designs": list(designs),
            "budgets": list(budgets), "devices": list(devices), "rows": rows, "within": within,
            "skipped": [{"device": dev, "design": d, "budget": b, "why": why} for (dev, d, b), why in skipped.items()],
            "compute_profiles": profiles}


def _prompt_tokens(model: str) -> int:
    from workbench.registry import resolve_pack, tokenizer_for
    from workbench.store.pack import Pack
    return len(tokenizer_for(Pack(resolve_pack(model, "contiguous", "q4", "q4"))).encode(PROMPT).ids)
