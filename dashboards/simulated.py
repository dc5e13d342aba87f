"""The SIMULATED LES ladder (results/regimes.json, written by benchmarks/regimes.py) as the ladders page shows it.

Each rung is `simulate` on the iPhone profile at MiniCPM-V 4.7's expert size, driven by the demo trace, with this
engine's compute measured here: no model ran on a phone. The paper's numbers for the same rungs sit beside it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.calibration import UNCALIBRATED
from workbench.errors import WorkbenchError

REPO = Path(__file__).resolve().parents[1]
REGIMES = REPO / "results" / "regimes.json"
COMMAND = "python benchmarks/regimes.py --rounds 3 --tokens 32"   # --only les would drop the other parts
COLUMNS = {"rung": "rung", "paper_rung": "paper's rung", "paper_tok_s": "paper tok/s", "paper_speedup": "paper ×",
           "tok_s": "SIMULATED tok/s", "speedup": "SIMULATED ×", "hit_rate": "SIMULATED hit rate",
           "belady_tok_s": "SIMULATED Belady tok/s"}


def calibration(result: dict) -> str:
    """A simulated result's label: "calibrated here (within X%)" as simulate found it (after simulate --calibrate on
    this machine, for a run here), else "uncalibrated" (results made before the label, or not checkable here)."""
    return result.get("calibration") or UNCALIBRATED


def les_ladder(path=None) -> tuple[dict, pd.DataFrame] | None:
    """(the ladder's settings, one row per rung), or None when the file has no LES ladder yet; a one-line error
    naming the file when it cannot be read."""
    path = Path(path or REGIMES)
    if not path.is_file():
        return None
    try:
        res = json.loads(path.read_text())
        les = res.get("les")
        if les is None:
            return None
        rows = pd.DataFrame([{v: r.get(k) for k, v in COLUMNS.items()} for r in les["rows"]], columns=list(COLUMNS.values()))
        settings = {k: les[k] for k in ("device", "shape", "budget", "tokens")}
        settings["shape_note"] = les["rows"][0].get("shape_note", "") if les["rows"] else ""
        settings["calibration"] = calibration(les["rows"][0] if les["rows"] else {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WorkbenchError(f"{path}: not a regimes result with an LES ladder ({type(e).__name__}: {e})") from None
    return {**settings, "when": res.get("when", "?")}, rows
