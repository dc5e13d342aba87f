"""Calibration, stored and labelled: the simulator as a user runs it (A: each design's compute profile measured in
runs of its own, reads by the device's stored profile) against measured runs of the same designs on this machine,
per design, budget and device, arms alternating within each round; medians with min-max and the load average.

    python -m workbench simulate --calibrate [--budgets 0.1,0.25,0.5] [--device this-machine,ufs22-phone]

(the runs: experiments.calibrate).

The result is stored in the profiles cache ($WORKBENCH_CACHE/profiles/calibration.json), keyed by this machine;
a simulated number of a run here (simulate --here: this machine's flash or the device emulated on it) is labelled
"calibrated here (within X%)" on a machine and device that has one (X: the worst |A / measured - 1| there),
"uncalibrated" otherwise (label).
"""
from __future__ import annotations

import json
import os
import platform
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


def label(device: str, model: str | None = None, where: Path | None = None) -> str:
    """How a simulated number on `device` of `model` is labelled here: "calibrated here (within X%)" once simulate
    --calibrate ran on this machine for that device on that model, "uncalibrated" otherwise (another model's
    calibration is named beside it: it does not carry to another file's reads and compute)."""
    res = read(where)
    if not res or res.get("machine") != machine() or device not in res["within"]:
        return UNCALIBRATED
    within = f"within {res['within'][device] * 100:.0f}%"
    if model is not None and res.get("model") not in (None, model):
        return f"{UNCALIBRATED} for {Path(model).name} (calibrated here on {res['model']}, {within})"
    return f"calibrated here ({within})"


def table(res: dict) -> str:
    """The calibration as markdown: A / measured per design x budget x device."""
    L = [f"Calibration on {res['machine']} ({res['when']}, {res['rounds']} alternating rounds, {res['tokens']} tokens, "
         f"load average {res['load_start'][0]:.1f} at the start, {res['load_end'][0]:.1f} at the end); "
         f"median (min-max)", "",
         "| device | design | budget | measured tok/s | A: SIMULATED tok/s | A / measured | A without read_floor / "
         "measured | measured, typical token: tok/s | A / typical | hit measured | hit simulated |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mr = lambda v: f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"
    for r in res["rows"]:
        L.append(f"| {r['device']} | {r['design']} | {r['budget']} | {mr(r['measured_tok_s'])} | "
                 f"{mr(r['simulated_tok_s'])} | {r['a_over_measured']:.2f} | {r['no_floor_over_measured']:.2f} | "
                 f"{mr(r['typical_tok_s'])} | {r['a_over_typical']:.2f} | "
                 f"{r['hit_measured']:.3f} | "
                 f"{r['hit_simulated']:.3f} |")
    L += [""] + [f"- not run: {x['design']} at budget {x['budget']} on {x['device']}: {x['why']}"
                 for x in res.get("skipped", [])]
    L += [f"- {dev}: calibrated here (within {w * 100:.0f}%)" for dev, w in res["within"].items()]
    return "\n".join(L)
