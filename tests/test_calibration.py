"""simulate --calibrate: A / measured per design, budget and device, stored for this machine; a simulated number is
labelled "calibrated here (within X%)" only after it, "uncalibrated" otherwise. Shapes and labels only: no speed
is asserted (the machine is shared)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from experiments import calibration as C
from experiments.compute_profile import ComputeProfile, _reading_costs, _read_floor
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
    slow = dataclasses.replace(CPU, read_floor={"wake_s": 0.0, "latency_s": [2e-3, 2e-3], "read_bw": [1e9, 1e9]})
    kw = dict(tokens=6, record=False)
    fast = run(TRACE, "on_demand", "0.25", "this-machine", compute=CPU, **kw)
    floored = run(TRACE, "on_demand", "0.25", "this-machine", compute=slow, **kw)
    assert floored["flash_wait_s"] > fast["flash_wait_s"] + 2e-3 and floored["tok_s"] < fast["tok_s"]
    phone = lambda cp, here: run(TRACE, "on_demand", "0.25", "ufs22-phone", compute=cp, here=here, **kw)["tok_s"]
    assert phone(slow, False) == phone(CPU, False) > phone(slow, True)


def test_here_the_slot_readers_check_is_inside_a_reads_time():
    """The packed engine's readers check an expert's crc before they stamp its read landed (and an emulated read
    waits out the device's time after both): a run predicted here, whose reads the floor times, pays no check
    after them; a device's own run does."""
    from experiments.simulate import run
    fl = {"wake_s": 0.0, "latency_s": [1e-4, 1e-4], "read_bw": [1e9, 1e9]}
    cp = lambda check: dataclasses.replace(CPU, read_floor=fl, dequant_s=check, dequant_busy_s=check)
    tok_s = lambda check, here: run(TRACE, "on_demand", "0.25", "ufs22-phone", compute=cp(check), here=here,
                                    tokens=6, record=False)["tok_s"]
    assert tok_s(1e-3, True) == tok_s(0.0, True)
    assert tok_s(1e-3, False) < tok_s(0.0, False)


class Reads:
    """What _timed_reads gives: per submit (called ns, returned ns, [(bytes, started ns, landed ns)] per key), and
    per preadv (bytes, started ns, landed ns): a read alone takes 50 us + bytes at 1 GB/s, one beside another 20 us +
    bytes at 0.5 GB/s; each call takes 10 us."""
    calls = [(0, 10_000, [(40_000, 100_000, 190_000)]),            # a sleeping reader's wake-up: 90 us after the call
             (1_000_000, 1_010_000, [(80_000, 1_100_000, 1_230_000)]),
             (1_250_000, 1_260_000, [(40_000, 1_280_000, 1_370_000)]),     # 20 us after a read landed: a polling reader
             (3_000_000, 3_010_000, [(40_000, 3_100_000, 3_190_000), (40_000, 3_120_000, 3_220_000)])]   # 2nd beside
    jobs = [(40_000, 100_000, 190_000), (80_000, 1_100_000, 1_230_000), (40_000, 1_280_000, 1_370_000),
            (40_000, 3_100_000, 3_190_000), (40_000, 3_120_000, 3_220_000), (80_000, 5_000_000, 5_180_000),
            (80_000, 5_000_000, 5_180_000)]


def test_read_floor_comes_from_the_streaming_runs_own_stamps():
    fl = _read_floor(Reads(), poll_ns=200_000)
    # the submits that found a sleeping reader, from the call's return (the simulator's pool starts the wake there)
    assert fl["wake_s"] == pytest.approx(90e-6)
    assert fl["wake_polling_s"] == pytest.approx(20e-6) and fl["poll_s"] == pytest.approx(200e-6)
    assert fl["latency_s"][0] == pytest.approx(50e-6) and fl["read_bw"][0] == pytest.approx(1e9)   # reads alone
    # beside another: 40 kB in 100 us, 80 kB in 180 us twice
    assert fl["read_bw"][1] == pytest.approx(40_000 / 80e-6) and fl["latency_s"][1] == pytest.approx(20e-6)
    fl = _read_floor(Reads(), poll_ns=0)                         # readers that never poll: every idle one sleeps
    assert fl["wake_s"] == pytest.approx((90e-6 + 90e-6 + 20e-6 + 90e-6) / 4)     # a run's time is their sum
    assert _read_floor(None) is None


def test_without_the_readers_log_a_preadv_of_several_experts_is_one_read():
    class Keys(Reads):
        jobs = []
        calls = [c for c in Reads.calls if c[0] != 1_000_000] + [(2_000_000, 2_010_000, [(40_000, 2_100_000, 2_230_000)] * 2)]
    fl = _read_floor(Keys(), poll_ns=0)           # the last: one preadv of two experts, 80 kB in 130 us
    assert fl["read_bw"][0] == pytest.approx(1e9) and fl["latency_s"][0] == pytest.approx(50e-6)


def test_what_reading_costs_the_compute_thread_is_fitted_per_issue_and_per_read_over_tokens():
    @dataclasses.dataclass
    class Tok:
        token: int
        compute_s: float
        router_s: float = 0.0
        other_s: float = 0.0

    @dataclasses.dataclass
    class Ev:
        token: int
        issues: int
        taken: int
        issued: int = 0
    resident = [Tok(i, 1.0e-3) for i in range(3)]
    # each issue costs 100 us after its call, each read taken in 10 us; token 4 a stall; token 5 no reads
    counts = [(1, 2), (2, 2), (3, 8), (1, 6), (2, 4), (0, 0)]
    stream = [Tok(i, 1e-3 + 100e-6 * n + 10e-6 * k + (9.0 if i == 4 else 0.0)) for i, (n, k) in enumerate(counts)]
    events = [Ev(i, n, k) for i, (n, k) in enumerate(counts)]
    after, land = _reading_costs(resident, [(stream[:3], events[:3]), (stream[3:], events[3:])], 0.0, 0.0)
    assert (after, land) == (pytest.approx(100e-6), pytest.approx(10e-6))
    # runs whose token indices repeat (each starts from the prompt): a token's events are its own run's
    assert _reading_costs(resident, [(stream, events)] * 2, 0.0, 0.0) == (pytest.approx(after), pytest.approx(land))
    # the submit calls' own time (20 us an issue, 5 us an expert issued) is not counted twice
    timed = [Tok(t.token, t.compute_s + 20e-6 * e.issues + 5e-6 * 3 * e.issues) for t, e in zip(stream, events)]
    events3 = [Ev(e.token, e.issues, e.taken, 3 * e.issues) for e in events]
    assert _reading_costs(resident, [(timed, events3)], 20e-6, 5e-6) == (pytest.approx(100e-6), pytest.approx(10e-6))
    assert _reading_costs([], [(stream, events)], 0.0, 0.0) == (0.0, 0.0)


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
