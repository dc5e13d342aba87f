"""simulate --calibrate: A / measured per design, budget and device, stored for this machine; a simulated number is
labelled "calibrated here (within X%)" only after it, "uncalibrated" otherwise. Shapes and labels only: no speed
is asserted (the machine is shared)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from experiments import calibration as C
from experiments.compute_profile import ComputeProfile, _per_read_rest, _read_floor
from workbench.errors import WorkbenchError

REPO = Path(__file__).resolve().parents[1]
TRACE = str(REPO / "data/traces/demo-tinystories-256.parquet")
CPU = ComputeProfile(dense_s=1e-4, router_s=2e-5, expert_s=5e-5, dequant_s=1e-5, other_s=1e-4, engine="packed",
                     reader_holds_gil=False)


@pytest.fixture()
def where(tmp_path, monkeypatch):
    path = tmp_path / "profiles" / "calibration.json"
    monkeypatch.setattr(C, "path", lambda: path)
    return path


def calibration(within: dict, machine: str | None = None) -> dict:
    rows = [{"device": d, "design": "les", "budget": "0.25", "a_over_measured": 1 + w} for d, w in within.items()]
    return {"machine": machine or C.machine(), "devices": list(within), "rows": rows, "within": within}


def test_a_simulated_number_is_uncalibrated_until_this_machine_is_calibrated(where):
    assert C.label("this-machine") == "uncalibrated"
    C.store(calibration({"this-machine": 0.123}))
    assert C.label("this-machine") == "calibrated here (within 12%)"
    assert C.label("ufs22-phone") == "uncalibrated"                # a device not calibrated here
    C.store(calibration({"ufs22-phone": 0.07}))                    # another device: kept beside the first
    assert (C.label("this-machine"), C.label("ufs22-phone")) == ("calibrated here (within 12%)",
                                                                  "calibrated here (within 7%)")
    assert {r["device"] for r in json.loads(where.read_text())["rows"]} == {"this-machine", "ufs22-phone"}
    C.store(calibration({"this-machine": 0.3}, machine="another host · another CPU · 64 cores"))
    assert C.label("this-machine") == "uncalibrated"               # a cache copied from elsewhere does not count


def test_a_broken_calibration_file_is_a_one_line_error_naming_it(where):
    where.parent.mkdir(parents=True)
    where.write_text("{not json")
    with pytest.raises(WorkbenchError, match=str(where)):
        C.label("this-machine")


def test_simulate_labels_its_number_by_what_was_calibrated_here(where):
    """this-machine, and a device emulated here (--here), carry the calibration's label; a device's own run (not
    checkable here) and another expert shape stay uncalibrated."""
    from experiments.simulate import run
    kw = dict(tokens=4, compute=CPU, record=False)
    assert run(TRACE, "les", "0.25", "this-machine", **kw)["calibration"] == "uncalibrated"
    C.store(calibration({"this-machine": 0.05, "ufs22-phone": 0.11}))
    assert run(TRACE, "les", "0.25", "this-machine", **kw)["calibration"] == "calibrated here (within 5%)"
    assert run(TRACE, "les", "0.25", "ufs22-phone", **kw)["calibration"] == "uncalibrated"
    here = run(TRACE, "les", "0.25", "ufs22-phone", here=True, **kw)
    assert here["calibration"] == "calibrated here (within 11%)" and here["emulated_here"]
    assert run(TRACE, "les", "0.25", "this-machine", shape="minicpm-v-4.7", **kw)["calibration"] == "uncalibrated"


def test_a_calibration_on_one_model_does_not_label_another(where):
    """Calibrated on the demo, a simulated number of another model's file reads uncalibrated, naming what was."""
    C.store({**calibration({"this-machine": 0.2}), "model": "demo"})
    assert C.label("this-machine", "demo") == "calibrated here (within 20%)"
    assert C.label("this-machine", "/tmp/big.gguf") == "uncalibrated for big.gguf (calibrated here on demo, within 20%)"


def test_reads_here_take_at_least_the_compute_profiles_read_floor():
    """A read floor of 2 ms a read (this machine's readers, measured in a streaming run) slows the runs predicted
    here and not another device's."""
    from experiments.simulate import run
    slow = dataclasses.replace(CPU, read_floor={"latency_s": 2e-3, "read_bw": 1e9, "peak_bw": 2e9, "queue_depth": 2})
    kw = dict(tokens=6, record=False)
    fast = run(TRACE, "on_demand", "0.25", "this-machine", compute=CPU, **kw)
    floored = run(TRACE, "on_demand", "0.25", "this-machine", compute=slow, **kw)
    assert floored["flash_wait_s"] > fast["flash_wait_s"] + 2e-3 and floored["tok_s"] < fast["tok_s"]
    phone = lambda cp, here: run(TRACE, "on_demand", "0.25", "ufs22-phone", compute=cp, here=here, **kw)["tok_s"]
    assert phone(slow, False) == phone(CPU, False) > phone(slow, True)


def test_read_floor_and_per_read_rest_come_from_the_streaming_runs_own_stamps():
    class Reads:       # submits: (submitted ns, [(bytes, started ns, landed ns)])
        calls = [(0, [(40_000, 100_000, 300_000), (40_000, 300_000, 500_000)]),    # one after the other: alone
                 (1_000_000, [(80_000, 1_300_000, 1_700_000)]),
                 (2_000_000, [(40_000, 2_100_000, 2_300_000)] * 2),                   # one preadv of two experts
                 (4_000_000, [(40_000, 4_100_000, 4_200_000), (40_000, 4_150_000, 4_250_000)])]   # overlapping
    fl = _read_floor(Reads(), workers=2)
    assert fl["latency_s"] == pytest.approx(100e-6)                # median of the submits' first waits
    assert fl["read_bw"] == pytest.approx(2e8)                     # alone: 200, 200, 200 MB/s, and 80 kB in 200 us
    assert fl["peak_bw"] == pytest.approx(80_000 / 150e-6)         # overlapping: 80 kB in the 150 us they covered
    assert fl["queue_depth"] == 2
    assert _read_floor(None, 2) is None

    @dataclasses.dataclass
    class Tok:
        token: int
        compute_s: float
        router_s: float = 0.0
        other_s: float = 0.0

    @dataclasses.dataclass
    class Ev:
        token: int
        taken: int
        issues: int = 1
        issued: int = 2
    resident = [Tok(i, 1.0e-3) for i in range(3)]
    stream = [Tok(0, 1.5e-3), Tok(1, 1.6e-3), Tok(2, 9.0), Tok(3, 1.2e-3)]     # token 2: a stall; token 3: no reads
    events = [Ev(0, 2), Ev(1, 2), Ev(2, 2), Ev(3, 0, 0, 0)]
    # beyond the resident token's 1 ms, less 0.1 ms of issues (1 of 20 us + 2 of 40 us), per read: 0.2, 0.25 ms
    # and the stall's; the median of the three
    got = _per_read_rest(resident, stream, events, issue_call=20e-6, issue=40e-6)
    assert got == pytest.approx((1.6e-3 - 1.0e-3 - 0.1e-3) / 2)
    assert _per_read_rest([], stream, events, 20e-6, 40e-6) == 0.0


def test_calibrate_command_reports_a_over_measured_per_design_budget_and_device(where, capsys):
    """The command at a tiny setting: one round, two designs, one budget, this machine; its JSON and its table."""
    from cli import main
    assert main(["simulate", "--calibrate", "--designs", "on_demand,resident", "--budgets", "0.25", "--rounds", "1",
                 "--tokens", "3", "--device", "this-machine", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [(r["device"], r["design"], r["budget"]) for r in res["rows"]] == [("this-machine", "on_demand", "0.25"),
                                                                             ("this-machine", "resident", "all")]
    for r in res["rows"]:
        assert r["a_over_measured"] == pytest.approx(r["simulated_tok_s"]["median"] / r["measured_tok_s"]["median"])
        assert len(r["measured_tok_s"]["all"]) == 1 and r["measured_tok_s"]["min"] <= r["measured_tok_s"]["max"]
    assert res["within"]["this-machine"] == pytest.approx(max(abs(r["a_over_measured"] - 1) for r in res["rows"]))
    assert res["stored"] == str(where) and len(res["load_start"]) == 3 and res["machine"] == C.machine()
    assert C.label("this-machine") == f"calibrated here (within {res['within']['this-machine'] * 100:.0f}%)"
    md = C.table(res)
    assert "| this-machine | on_demand | 0.25 |" in md and "calibrated here (within" in md


def test_calibrate_bad_input_is_a_one_line_error(where, capsys):
    from cli import main
    assert main(["simulate", "--calibrate", "--designs", "smol_bias", "--rounds", "1"]) == 2
    assert "changes routing" in capsys.readouterr().err
    assert main(["simulate", "--calibrate", "--budgets", "lots", "--rounds", "1"]) == 2
    assert "--budget 'lots'" in capsys.readouterr().err
    assert main(["simulate", "--calibrate", "--device", "toaster", "--rounds", "1"]) == 2
    assert "--device 'toaster'" in capsys.readouterr().err
    assert main(["simulate"]) == 2
    assert "--trace FILE is needed" in capsys.readouterr().err
    assert not where.exists()
