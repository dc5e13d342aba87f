"""Calibration: the simulator as a user runs it (A: each design's compute profile measured in runs of its own,
reads by the device's stored profile) against measured runs of the same designs on this machine, per design,
budget and device, arms alternating within each round; medians with min-max and the load average.

    python -m workbench simulate --calibrate [--budgets 0.1,0.25,0.5] [--device this-machine,ufs22-phone]

The result is stored in the profiles cache ($WORKBENCH_CACHE/profiles/calibration.json), keyed by this machine;
a simulated number of a run here (simulate --here: this machine's flash or the device emulated on it) is labelled
"calibrated here (within X%)" on a machine and device that has one (X: the worst |A / measured - 1| there),
"uncalibrated" otherwise (label).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError

DESIGNS = ("on_demand", "les", "smol", "oracle", "resident")
BUDGETS = ("0.1", "0.25", "0.5")
DEVICES = ("this-machine", "ufs22-phone")
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "demo-tinystories-256.parquet"
PROMPT = "Once upon a time"
UNCALIBRATED = "uncalibrated"


def path() -> Path:
    from workbench.registry import cache_dir
    return cache_dir() / "profiles" / "calibration.json"


def machine() -> str:
    """What a calibration holds for: this host, its CPU and its cores (a cache copied elsewhere does not count)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()} · {cpu} · {os.cpu_count()} cores"


def _med(xs: list) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def calibrate(designs=DESIGNS, budgets=BUDGETS, devices=DEVICES, rounds: int = 3, tokens: int = 32,
              trace=TRACE, model: str = "demo", log=print) -> dict:
    """Measured (bench --routing-trace) vs simulated A for each design x budget x device (resident: at all, once a
    round); each round measures each design's compute profile once (measure_compute: runs of its own, never the
    runs it predicts) and the compute thread's wake-up with this machine's reads (probe_reader), and alternates the
    arms' order from round to round."""
    from experiments.bench import bench
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
    got = {a: {"measured": [], "simulated": [], "simulated_no_floor": [], "hit_measured": [], "hit_simulated": []}
           for a in arms}
    profiles = {d: [] for d in designs}
    load0, t0 = os.getloadavg(), time.time()
    prompt = None
    for r in range(rounds):
        wake = disk_probe.probe_reader(resolve_pack(model, "contiguous", "q4", "q4"),
                                       workers=slot_readers()).sources["wake_s"]
        cps = {d: dataclasses.replace(measure_compute(model, spec, get_preset(d).storage.experts, preset=d,
                                                      routing_trace=trace), wake_s=wake) for d in designs}
        for d in designs:
            profiles[d].append(dataclasses.asdict(cps[d]))
        for dev, d, b in (arms if r % 2 == 0 else arms[::-1]):
            m = bench(model, d, budget=b, tokens=tokens, prompt=PROMPT, routing_trace=trace,
                      device=None if dev == "this-machine" else dev, record=False)
            if prompt is None:
                prompt = _prompt_tokens(model)
            s = simulate(trace, d, b, dev, tokens=tokens, prompt=prompt, compute=cps[d],
                         workers=m["reader_workers"], record=False, here=True)
            s0 = simulate(trace, d, b, dev, tokens=tokens, prompt=prompt, record=False, workers=m["reader_workers"],
                          compute=dataclasses.replace(cps[d], read_floor=None))      # the model before read_floor
            for k, v in (("measured", m["tok_s"]), ("simulated", s["tok_s"]), ("simulated_no_floor", s0["tok_s"]),
                         ("hit_measured", m["hit_rate"]),
                         ("hit_simulated", s["hit_rate"])):
                got[(dev, d, b)][k].append(v)
            if log:
                log(f"round {r + 1}/{rounds} {dev} {d} budget {b}: measured {m['tok_s']:.1f} tok/s, "
                    f"SIMULATED (A) {s['tok_s']:.1f}")
    rows = []
    for dev, d, b in arms:
        x = got[(dev, d, b)]
        mm, ss = _med(x["measured"]), _med(x["simulated"])
        s0 = _med(x["simulated_no_floor"])
        rows.append({"device": dev, "design": d, "budget": b, "measured_tok_s": mm, "simulated_tok_s": ss,
                     "a_over_measured": ss["median"] / mm["median"], "simulated_no_floor_tok_s": s0,
                     "no_floor_over_measured": s0["median"] / mm["median"],
                     "hit_measured": statistics.median(x["hit_measured"]),
                     "hit_simulated": statistics.median(x["hit_simulated"])})
    within = {dev: max(abs(r["a_over_measured"] - 1) for r in rows if r["device"] == dev) for dev in devices}
    return {"machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "elapsed_s": time.time() - t0, "load_start": list(load0), "load_end": list(os.getloadavg()),
            "trace": trace, "model": model, "tokens": tokens, "rounds": rounds, "designs": list(designs),
            "budgets": list(budgets), "devices": list(devices), "rows": rows, "within": within,
            "compute_profiles": profiles}


def _prompt_tokens(model: str) -> int:
    from workbench.registry import resolve_pack, tokenizer_for
    from workbench.store.pack import Pack
    return len(tokenizer_for(Pack(resolve_pack(model, "contiguous", "q4", "q4"))).encode(PROMPT).ids)


def store(res: dict, where: Path | None = None) -> Path:
    """Kept beside the other devices' calibrations of this machine (a device calibrated again replaces its own)."""
    where = Path(where or path())
    old = read(where)
    if old and old.get("machine") == res["machine"]:
        kept = [r for r in old.get("rows", []) if r["device"] not in res["devices"]]
        res = {**res, "rows": kept + res["rows"], "within": {**{k: v for k, v in old.get("within", {}).items()
                                                                 if k not in res["devices"]}, **res["within"]}}
    atomic_write(where, json.dumps(res, indent=1, default=str))
    return where


def read(where: Path | None = None) -> dict | None:
    where = Path(where or path())
    if not where.is_file():
        return None
    try:
        res = json.loads(where.read_text())
        if not isinstance(res.get("within"), dict) or not isinstance(res.get("rows"), list):
            raise ValueError("no 'within' or 'rows'")
    except (OSError, ValueError, AttributeError) as e:
        raise WorkbenchError(f"{where}: not a calibration (simulate --calibrate writes one): {e}") from None
    return res


def label(device: str, where: Path | None = None) -> str:
    """How a simulated number on `device` is labelled here: "calibrated here (within X%)" once simulate --calibrate
    ran on this machine for that device, else "uncalibrated"."""
    res = read(where)
    if not res or res.get("machine") != machine() or device not in res["within"]:
        return UNCALIBRATED
    return f"calibrated here (within {res['within'][device] * 100:.0f}%)"


def table(res: dict) -> str:
    """The calibration as markdown: A / measured per design x budget x device."""
    L = [f"Calibration on {res['machine']} ({res['when']}, {res['rounds']} alternating rounds, {res['tokens']} tokens, "
         f"load average {res['load_start'][0]:.1f} at the start, {res['load_end'][0]:.1f} at the end); "
         f"median (min-max)", "",
         "| device | design | budget | measured tok/s | A: SIMULATED tok/s | A / measured | A without read_floor / "
         "measured | hit measured | hit simulated |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    mr = lambda v: f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"
    for r in res["rows"]:
        L.append(f"| {r['device']} | {r['design']} | {r['budget']} | {mr(r['measured_tok_s'])} | "
                 f"{mr(r['simulated_tok_s'])} | {r['a_over_measured']:.2f} | {r['no_floor_over_measured']:.2f} | "
                 f"{r['hit_measured']:.3f} | "
                 f"{r['hit_simulated']:.3f} |")
    L += [""] + [f"- {dev}: calibrated here (within {w * 100:.0f}%)" for dev, w in res["within"].items()]
    return "\n".join(L)
