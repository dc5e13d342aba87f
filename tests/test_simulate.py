"""The virtual-clock simulator reproduces schedules computed by hand, and the Belady bound is optimal replacement."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from workbench.devices import DeviceProfile
from workbench.presets import get_preset
from experiments.compute_profile import ComputeProfile
from experiments.simulate import ReadPlan, belady, simulate_run
from workbench.spec import MoESpec

REPO = Path(__file__).resolve().parents[1]
MS = 1e-3
KB = 4096                                            # one aligned expert read in the plans below


def sim(*a, **kw) -> dict:
    """simulate_run's record (workbench.summary.RunSummary.record), with its drafts' counts."""
    r = simulate_run(*a, **kw)
    return {**r.summary.record(), "spec_steps": r.spec_steps, "spec_accepted": r.spec_accepted}


class Drive:
    """A routing trace in miniature: rows of {layer: experts}, and what a predictor named per (row, layer)."""

    def __init__(self, rows, named=None, depth=1):
        self.rows, self.named, self.usage = rows, named, {}
        self.prompt = 0

    def row(self, ctx, n):
        ti = ctx["engine"].token_index
        if ti == 0:
            self.prompt = n
            return list(range(n))
        return [self.prompt - 1 + ti]

    def route(self, layer, logits, ctx):
        idx = np.array([self.rows[r][layer] for r in self.row(ctx, len(logits))])
        return idx, np.ones(idx.shape, np.float32)

    def predictor(self):
        if self.named is None:
            return None
        drive = self

        class P:
            def predict(self, layer, ctx):
                r = drive.row(ctx, 1)[0]
                return {layer + 1: drive.named[r][layer + 1]} if layer + 1 in drive.named[r] else {}
        return P()


def spec(layers=1, experts=4, k=2):
    return MoESpec(family="qwen3_moe", vocab_size=8, hidden_size=64, num_layers=layers, num_heads=1, num_kv_heads=1,
                   head_dim=64, num_experts=experts, top_k=k, moe_intermediate_size=64)


DEV = DeviceProfile("hand", "hand", latency_s=1 * MS, read_bw=KB / (1 * MS), peak_bw=KB / (1 * MS), queue_depth=2)
CPU = ComputeProfile(dense_s=0.0, router_s=0.5 * MS, expert_s=0.25 * MS, dequant_s=0.0)
PLAN = ReadPlan("contiguous", (1000, 1000, 1000))    # 3000 bytes: one 4096-byte aligned read per expert


def test_one_layer_two_reads_on_demand_wait_all():
    """Token 1 routes experts 0 and 2 (not adjacent: two reads), none cached. Both reads start at 0.5 ms (after the
    router) on two reader threads: the first alone takes 1 ms latency + 1 ms transfer = 2 ms; the second starts
    with one in flight, so shares the 1 ms/KB peak: 1 + 2 = 3 ms. wait_all waits to 3.5 ms, then computes 2 x 0.25."""
    drive = Drive([{0: [1, 3]}, {0: [0, 2]}])              # row 0 is the prompt (read before the clock starts)
    p = get_preset("on_demand").with_(layout="contiguous")
    res = sim(drive, spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, CPU, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(0.5 * MS + 3 * MS + 0.5 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(3 * MS, abs=1e-12)
    assert (res["hits"], res["misses"], res["bytes_read"]) == (0, 2, 2 * KB)


@pytest.mark.parametrize("split, ms", [(False, 3.0), (True, 2.0)])
def test_a_large_read_goes_to_the_readers_in_pieces_as_reads_into_slots_do(split, ms):
    """One expert of 1 MiB on two reader threads; the device streams 512 KiB/ms for one read, 1024 KiB/ms shared
    by reads in flight, after 1 ms of latency. Whole, the read takes 1 + 1024/512 = 3 ms; in two pieces of 512 KiB
    (workbench.io.split_sizes), the first alone takes 1 + 1 ms and the second, with one in flight, shares the peak:
    1 + 512/(1024/2) = 2 ms, so the expert lands at 2 ms. Then router 0.5 ms before, expert 0.25 ms after."""
    dev = DeviceProfile("hand", "hand", latency_s=1 * MS, read_bw=512 * 1024 / MS, peak_bw=1024 * 1024 / MS,
                        queue_depth=2)
    big = ReadPlan("contiguous", (349525, 349525, 349526))          # 1 MiB aligned: one read
    res = sim(Drive([{0: [1]}, {0: [0]}]), spec(k=1), get_preset("on_demand").with_(layout="contiguous"),
                       str(2 * 4 * 3 * 64 * 64), dev, CPU, tokens=2, prompt=1, workers=2, plan=big, split=split)
    assert res["flash_wait_s"] == pytest.approx(ms * MS, abs=1e-12)
    assert res["decode_s"] == pytest.approx(0.5 * MS + ms * MS + 0.25 * MS, abs=1e-12)
    assert res["bytes_read"] == 1024 * 1024


def test_an_issue_costs_its_call_before_its_reads_start_and_slows_the_compute_after():
    """The first schedule with a 0.1 ms submit call and 0.3 ms lost after it (the readers it woke, on the cores the
    compute thread shares): the reads start at 0.6 ms and land at 3.6; the compute thread waits 3 ms for them (the
    readers' cost is in its compute, not in a wait), then computes its 0.5 ms 0.3 ms slower."""
    cpu = dataclasses.replace(CPU, issue_call_s=0.1 * MS, after_issue_s=0.3 * MS)
    drive = Drive([{0: [1, 3]}, {0: [0, 2]}])
    p = get_preset("on_demand").with_(layout="contiguous")
    res = sim(drive, spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(0.5 * MS + 0.1 * MS + 3 * MS + 0.5 * MS + 0.3 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(3 * MS, abs=1e-12)


def test_what_an_issue_costs_after_its_call_falls_once_its_reads_have_landed():
    """ready_first, expert 0 in memory and expert 2 a miss: the submit (0.1 ms call) starts the read at 0.6 ms, which
    lands at 2.6. Expert 0's compute (0.25 ms) runs while the read flies and is not slowed; the 0.3 ms the readers
    take falls on the compute after the read landed (expert 2's), so it is not hidden behind the read: the wait is
    2.6 - 0.85 ms and the token ends at 2.6 + 0.25 + 0.3."""
    cpu = dataclasses.replace(CPU, issue_call_s=0.1 * MS, after_issue_s=0.3 * MS)
    p = get_preset("on_demand").with_(layout="contiguous", execution="ready_first")
    res = sim(Drive([{0: [0, 1]}, {0: [0, 2]}]), spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2,
                       prompt=1, workers=2, plan=PLAN)
    assert (res["hits"], res["misses"]) == (1, 1)
    assert res["flash_wait_s"] == pytest.approx(2.6 * MS - 0.85 * MS, abs=1e-12)
    assert res["decode_s"] == pytest.approx(2.6 * MS + 0.25 * MS + 0.3 * MS, abs=1e-12)


def test_submits_follow_each_other_and_only_the_compute_after_them_is_slowed():
    """Oracle over two layers: layer 0 reads its miss (expert 1) and then expert 3 for layer 1, two submits of
    0.1 ms each, each slowing the compute after it by 0.3 ms; the second read starts 0.1 ms after the first, not
    0.4 ms."""
    from experiments.simulate import _Simulation
    cpu = dataclasses.replace(CPU, router_s=1 * MS, issue_call_s=0.1 * MS, after_issue_s=0.3 * MS)
    starts = []
    submit = _Simulation.submit

    def issue(self, keys, counted):
        starts.append(self.clock.now + cpu.issue_call_s)
        return submit(self, keys, counted)
    drive = Drive([{0: [0, 2], 1: [2, 0]}, {0: [0, 1], 1: [2, 3]}], named=[{}, {1: [3]}])
    _Simulation.submit = issue
    try:
        sim(drive, spec(layers=2), get_preset("oracle").with_(budget="all"), str(8 * 4 * 3 * 64 * 64 - 1),
                     DEV, cpu, tokens=2, prompt=1, workers=2, plan=PLAN)
    finally:
        _Simulation.submit = submit
    assert starts[-1] - starts[-2] == pytest.approx(0.1 * MS, abs=1e-12)


def test_a_reader_that_landed_a_read_moments_ago_polls_and_starts_the_next_sooner():
    """Two readers that sleep after 0.2 ms of polling: a sleeping one starts a read 0.3 ms after its submit, the
    polling one 0.05 ms after (one read a submit: the other reader is asleep). A read alone takes 2 ms, one beside
    another 3 ms (DEV)."""
    from experiments.simulate import _Pool
    pool = _Pool(2, DEV, 0.0, wake_s=0.3 * MS, polling=(0.2 * MS, 0.05 * MS))
    one = lambda e: [([(0, e)], KB)]
    assert pool.submit(0.0, one(0))[(0, 0)][0] == pytest.approx(2.3 * MS)      # asleep: 0.3 + 2
    assert pool.submit(2.4 * MS, one(1))[(0, 1)][0] == pytest.approx(4.45 * MS)     # 0.1 ms after a landing: polls
    assert pool.submit(5.0 * MS, one(2))[(0, 2)][0] == pytest.approx(7.3 * MS)      # 0.55 ms after: asleep again
    both = pool.submit(7.4 * MS, one(3) + one(5))
    assert both[(0, 3)][0] == pytest.approx(9.45 * MS)                            # the polling reader: 7.45 + 2
    assert both[(0, 5)][0] == pytest.approx(10.7 * MS)                           # the sleeping one: 7.7 + 3


def test_a_wait_that_blocks_costs_one_wake_up_and_a_landed_read_none():
    """The two schedules above and below with a 0.2 ms wake-up: wait_all sleeps once for its two reads and runs
    again 0.2 ms after the second lands (3.7 ms); ready_first sleeps once in layer 0 (its miss) and not in layer 1,
    whose experts had landed: each pays one wake-up, not one per read."""
    cpu = dataclasses.replace(CPU, wake_s=0.2 * MS)
    drive = Drive([{0: [1, 3]}, {0: [0, 2]}])
    p = get_preset("on_demand").with_(layout="contiguous")
    res = sim(drive, spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(0.5 * MS + 3.2 * MS + 0.5 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(3.2 * MS, abs=1e-12)
    cpu = dataclasses.replace(cpu, router_s=1 * MS)
    drive = Drive([{0: [0, 2], 1: [2, 0]}, {0: [0, 1], 1: [2, 3]}], named=[{}, {1: [3]}])
    res = sim(drive, spec(layers=2), get_preset("oracle").with_(budget="all"), str(8 * 4 * 3 * 64 * 64 - 1),
                       DEV, cpu, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(4.95 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(1.95 * MS, abs=1e-12)


def test_each_read_costs_the_compute_thread_its_take_in_once_and_a_cached_expert_none():
    """As the first schedule, with a 0.1 ms take-in per read (ComputeProfile.land_s): both reads land by 3.5 ms and
    are taken in then, one after the other (3.5 -> 3.7), then computed (-> 4.2). Token 2 routes the same experts,
    now cached: no take-in, router and compute only (0.5 + 0.5 ms)."""
    cpu = dataclasses.replace(CPU, land_s=0.1 * MS)
    drive = Drive([{0: [1, 3]}, {0: [0, 2]}, {0: [0, 2]}])
    p = get_preset("on_demand").with_(layout="contiguous")
    res = sim(drive, spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, cpu, tokens=3, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(0.5 * MS + 3 * MS + 0.2 * MS + 0.5 * MS + 1.0 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(3 * MS, abs=1e-12)
    assert (res["hits"], res["misses"]) == (2, 2)


def test_adjacent_experts_merge_into_one_read_as_the_reader_merges_them():
    """Experts 0 and 1 are adjacent in the pack: one 8 KB read, alone: 1 + 2 ms, from 0.5 ms."""
    drive = Drive([{0: [2, 3]}, {0: [0, 1]}])
    p = get_preset("on_demand").with_(layout="contiguous")
    res = sim(drive, spec(), p, str(2 * 4 * 3 * 64 * 64), DEV, CPU, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(0.5 * MS + 3 * MS + 0.5 * MS, abs=1e-12)
    assert res["bytes_read"] == 2 * KB


def test_ready_first_computes_the_hit_while_the_miss_arrives_and_a_prefetch_hides_a_read():
    """Two layers, two reader threads, room for everything, a 1 ms router. Token 1, layer 0: router 0 -> 1 ms; it
    routes [0, 1]: 0 is cached (prompt), 1 is read 1 -> 3 ms (alone: 1 ms + 1 ms), and behind it the predictor's
    layer-1 expert 3 on the other thread, sharing the peak: 1 -> 4 ms (1 + 2). ready_first computes
    the hit 1 -> 1.25, waits 1.75 ms, computes 1: 3 -> 3.25. Layer 1: router -> 4.25; it routes [2, 3]: 2 from the
    prompt, 3 landed at 4: both hits; compute -> 4.75. With one reader thread the prefetch waits behind the demand
    read (3 -> 5 ms) and layer 1 waits for it: 4.5 -> 5 (as the streamer reads demand first): a late prefetch."""
    s = spec(layers=2)
    cpu = dataclasses.replace(CPU, router_s=1 * MS)
    drive = Drive([{0: [0, 2], 1: [2, 0]}, {0: [0, 1], 1: [2, 3]}], named=[{}, {1: [3]}])
    p = get_preset("oracle").with_(budget="all")
    res = sim(drive, s, p, str(8 * 4 * 3 * 64 * 64 - 1), DEV, cpu, tokens=2, prompt=1, workers=2, plan=PLAN)
    assert res["decode_s"] == pytest.approx(4.75 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(1.75 * MS, abs=1e-12)
    assert res["prefetch_issued"] == 1 and res["prefetch_used"] == 1
    assert [(r["hits"], r["late"], r["misses"]) for r in res["per_layer"]] == [(1, 0, 1), (2, 0, 0)]
    res = sim(drive, s, p, str(8 * 4 * 3 * 64 * 64 - 1), DEV, cpu, tokens=2, prompt=1, workers=1, plan=PLAN)
    assert res["decode_s"] == pytest.approx(5.25 * MS, abs=1e-12)
    assert res["flash_wait_s"] == pytest.approx(2.25 * MS, abs=1e-12)
    assert [(r["hits"], r["late"], r["misses"]) for r in res["per_layer"]] == [(1, 0, 1), (1, 1, 0)]   # 3 is late


def test_a_read_that_lands_while_the_compute_thread_works_waits_for_the_gil():
    """One layer routes [0, 1]: 0 cached, 1 read 0.5 -> 2.5 ms while the hit computes (3 ms, 0.5 -> 3.5). The read's
    1 ms dequant needs the GIL: CPython hands it over after the 5 ms switch interval or when the work ends, here
    at 3.5; 1 is ready at 4.5, a 1 ms wait, computed 4.5 -> 7.5. Ignoring the GIL (switch 0) the dequant preempts
    the work at once (0.5 -> 4.5) and 1 is ready at 3.5: no wait, same 7.5 ms. With 10 ms experts the switch
    interval passes mid-work: the dequant preempts it at 7.5 (work ends 11.5), 1 is ready at 8.5: no wait, 21.5 ms."""
    drive = Drive([{0: [0, 2]}, {0: [0, 1]}])
    p = get_preset("les")
    cpu = dataclasses.replace(CPU, expert_s=3 * MS, dequant_s=1 * MS)
    budget = str(3 * 4 * 3 * 64 * 64)
    run = lambda c, switch: sim(Drive(drive.rows), spec(), p, budget, DEV, c, tokens=2, prompt=1, workers=1,
                                         plan=PLAN, switch_s=switch)
    gil = run(cpu, 5 * MS)
    assert (gil["decode_s"], gil["flash_wait_s"]) == (pytest.approx(7.5 * MS, abs=1e-12), pytest.approx(1 * MS, abs=1e-12))
    free = run(cpu, 0.0)
    assert (free["decode_s"], free["flash_wait_s"]) == (pytest.approx(7.5 * MS, abs=1e-12), pytest.approx(0, abs=1e-12))
    long = run(dataclasses.replace(cpu, expert_s=10 * MS), 5 * MS)
    assert long["decode_s"] == pytest.approx(21.5 * MS, abs=1e-12) and long["flash_wait_s"] == pytest.approx(0, abs=1e-12)


def test_a_read_landing_mid_compute_dequantizes_at_the_measured_contended_speed():
    """As above, with the contended dequant time measured (dequant_busy_s): the read of 1 ends at 2.5 ms while the
    hit computes, so its dequant takes 3 ms (not 1): ready at 5.5. The dequant's own 1 ms of CPU delays the work to
    4.5; the compute thread waits 1 ms, computes 1 -> 8.5. A read that lands while the thread waits is unaffected."""
    drive = Drive([{0: [0, 2]}, {0: [0, 1]}])
    cpu = dataclasses.replace(CPU, expert_s=3 * MS, dequant_s=1 * MS, dequant_busy_s=3 * MS)
    res = sim(drive, spec(), get_preset("les"), str(3 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2, prompt=1,
                       workers=1, plan=PLAN)
    assert res["decode_s"] == pytest.approx(8.5 * MS, abs=1e-12) and res["flash_wait_s"] == pytest.approx(1 * MS, abs=1e-12)
    idle = sim(Drive(drive.rows), spec(), get_preset("on_demand").with_(layout="contiguous"),
                        str(3 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2, prompt=1, workers=1, plan=PLAN)
    assert idle["decode_s"] == pytest.approx(0.5 * MS + 3 * MS + 2 * 3 * MS, abs=1e-12)   # wait_all: read 2 + dequant 1


def test_belady_is_optimal_replacement_with_foresight():
    """Accesses a b c a b d a (one per token, top-1, 2 slots). MIN: a b miss, c miss evicts b (next use 4, a's is 3)
    ... a hit, b miss evicts c (never again), d miss evicts b, a hit: 5 misses of 7 (LRU misses all 7)."""
    seq = "abcabda"
    drive = Drive([{0: [0]}] + [{0: ["abcd".index(c)]} for c in seq])
    res = belady(drive, spec(experts=4, k=1), get_preset("on_demand"), str(2 * 4 * 3 * 64 * 64), prompt=1,
                 tokens=len(seq) + 1)
    assert (res["accesses"], res["belady_misses"]) == (7, 5)


def test_belady_from_the_best_start_holds_the_first_experts_asked_for():
    """The same accesses from the best start any policy could have (initial=None): a and b already in the 2 slots,
    so only c and d miss, and from either start MIN needs no more reads than from an empty cache."""
    seq = "abcabda"
    drive = Drive([{0: [0]}] + [{0: ["abcd".index(c)]} for c in seq])
    kw = dict(spec=spec(experts=4, k=1), preset=get_preset("on_demand"), budget=str(2 * 4 * 3 * 64 * 64), prompt=1,
              tokens=len(seq) + 1)
    best = belady(drive, initial=None, **kw)
    assert (best["accesses"], best["belady_misses"]) == (7, 3)
    assert best["belady_misses"] <= belady(drive, initial=[(0, 3), (0, 2)], **kw)["belady_misses"]


def test_simulate_on_the_demo_trace_is_marked_simulated_and_never_beats_belady(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path))
    from workbench.runs import read_run
    from experiments.simulate import run
    cpu = dataclasses.replace(CPU, dense_s=0.1 * MS, dequant_s=0.05 * MS)
    res = run(str(REPO / "data/traces/demo-tinystories-256.parquet"), "les", "0.25", "ufs22-phone", tokens=24,
              compute=cpu)
    assert res["simulated"] and not res["emulated"] and res["device"]["simulated"]
    assert res["experts_read"] >= res["belady_misses"]
    od = run(str(REPO / "data/traces/demo-tinystories-256.parquet"), "on_demand", "0.25", "ufs22-phone", tokens=24,
             compute=cpu, record=False)
    assert od["hit_rate"] <= od["belady_hit_rate"] + 1e-12          # demand fetching: Belady bounds the hit rate
    assert res["tok_s"] <= res["belady_tok_s"] + 1e-9
    rec = read_run(res["run"])
    assert rec["config"]["simulated"] and rec["summary"]["simulated"]


def test_bad_simulate_input_is_a_one_line_error(tmp_path, capsys):
    from cli import main
    trace = str(REPO / "data/traces/demo-tinystories-256.parquet")
    assert main(["simulate", "--trace", str(tmp_path / "none.parquet"), "--no-record"]) == 2
    assert "no such trace file" in capsys.readouterr().err
    assert main(["simulate", "--trace", trace, "--device", "toaster", "--no-record"]) == 2
    assert "--device 'toaster'" in capsys.readouterr().err
    assert main(["simulate", "--trace", trace, "--preset", "smol_bias", "--no-record"]) == 2
    assert "changes routing" in capsys.readouterr().err
    assert main(["simulate", "--trace", trace, "--shape", "qwen3-next-80b-a3b", "--no-record"]) == 2
    assert "top-10 is not a multiple" in capsys.readouterr().err


def test_compute_profile_is_measured_on_the_engine_that_runs():
    """The packed engine computes from the bytes read: its profile times its compiled kernel and, per expert read,
    the crc its reader checks (nothing is dequantized); the numpy engine's times its codec. Both are positive
    measurements labelled with the engine, with what an issue of reads costs measured in a streaming run."""
    from experiments.compute_profile import measure_compute
    from workbench.store.pack import Pack
    from workbench.registry import resolve_pack
    spec = Pack(resolve_pack("demo", "contiguous", "q4", "q4")).spec
    packed = measure_compute("demo", spec, "q4", tokens=3, engine="packed")
    numpy_ = measure_compute("demo", spec, "q4", tokens=3, engine="numpy")
    assert "packed engine" in packed.source and "crc check" in packed.source
    assert "numpy engine" in numpy_.source and "dequant" in numpy_.source
    for cp in (packed, numpy_):
        assert cp.expert_s > 0 and cp.dequant_s > 0 and cp.dense_s > 0
        assert cp.issue_call_s + cp.issue_s > 0 and "budget 0.5" in cp.source     # its reads, in a streaming run


def _one_drafted_step(cpu) -> dict:
    """The schedule of the tests below: one layer, step 1 verifying its input token (experts 0, 2) and a one-token
    draft (experts 0, 1) that is accepted, expert 1 cached by the prompt, room for 3 experts, two reader threads."""
    class Speculative(Drive):
        def draft(self, token_index, n):
            return [99], 1
    drive = Speculative([{0: [1, 3]}, {0: [0, 2]}, {0: [0, 1]}])
    p = get_preset("on_demand").with_(layout="contiguous", speculative=1)
    return sim(drive, spec(), p, str(3 * 4 * 3 * 64 * 64), DEV, cpu, tokens=3, prompt=1, workers=2, plan=PLAN)


def test_speculative_verification_reads_the_batchs_union_once_and_computes_each_token_expert_pair():
    """LES's speculative rung, one layer: step 1 verifies its input token (row 1: experts 0, 2) and a one-token draft
    (row 2: experts 0, 1) in one batch, and the draft is accepted: 2 tokens in one step. The router runs per row:
    0 -> 1 ms. The union {0, 1, 2}: 1 is cached (prompt), 0 and 2 are read once each from 1 ms on two threads:
    1 -> 3 and (one in flight) 1 -> 4 ms (room for 3 experts: 2 evicts 3). wait_all waits to 4 ms, then computes
    4 (token, expert) pairs: -> 5 ms."""
    res = _one_drafted_step(CPU)
    assert res["decode_s"] == pytest.approx(5 * MS, abs=1e-12)
    assert res["tok_s"] == pytest.approx(2 / (5 * MS))
    assert res["flash_wait_s"] == pytest.approx(3 * MS, abs=1e-12)
    assert (res["hits"], res["misses"], res["bytes_read"]) == (1, 2, 2 * KB)
    assert (res["spec_steps"], res["spec_accepted"]) == (1, 1)


def test_a_batchs_further_rows_cost_what_the_engine_measures_for_them():
    """The schedule above with each row after the first costing 0.2 ms of dense and router time (ComputeProfile.row_s,
    measured on the engine) instead of a whole token's 0.5 ms: the reads start at 0.7 ms, land at 2.7 and 3.7, and
    the 4 pairs are computed 3.7 -> 4.7 ms."""
    res = _one_drafted_step(dataclasses.replace(CPU, row_s=0.2 * MS))
    assert res["decode_s"] == pytest.approx(4.7 * MS, abs=1e-12)


def test_a_real_drafts_own_time_is_charged_before_its_batch_is_verified():
    """The schedule above with a draft that takes 0.3 ms a proposed token (ComputeProfile.draft_s, measured in the
    draft's run): the step starts 0.3 ms later, every event after it with it: 5.3 ms."""
    res = _one_drafted_step(dataclasses.replace(CPU, draft_s=0.3 * MS))
    assert res["decode_s"] == pytest.approx(5.3 * MS, abs=1e-12)


def test_an_expert_two_rows_route_to_computes_its_second_row_at_the_measured_cost_of_a_further_row():
    """As above, with expert 0's second row costing 0.05 ms (ComputeProfile.expert_row_s: one kernel call computes
    an expert's rows) instead of a whole 0.25 ms: the union's 3 experts and one further row, 3.7 -> 4.5 ms."""
    res = _one_drafted_step(dataclasses.replace(CPU, row_s=0.2 * MS, expert_row_s=0.05 * MS))
    assert res["decode_s"] == pytest.approx(4.5 * MS, abs=1e-12)


def test_gil_free_readers_check_a_read_beside_the_work_without_taking_its_time():
    """As above, with the packed engine's GIL-free readers (shared_cpu=False, ComputeProfile.reader_holds_gil): the
    read of 1 ends at 2.5 ms while the hit computes (0.5 -> 3.5) and its 1 ms check runs on the reader's core, at
    its own speed: ready at 3.5, exactly when the hit is done. No wait, no delay: 1 computes 3.5 -> 6.5."""
    drive = Drive([{0: [0, 2]}, {0: [0, 1]}])
    cpu = dataclasses.replace(CPU, expert_s=3 * MS, dequant_s=1 * MS, dequant_busy_s=3 * MS, reader_holds_gil=False)
    res = sim(drive, spec(), get_preset("les"), str(3 * 4 * 3 * 64 * 64), DEV, cpu, tokens=2, prompt=1,
                       workers=1, plan=PLAN, shared_cpu=cpu.reader_holds_gil)
    assert res["decode_s"] == pytest.approx(6.5 * MS, abs=1e-12) and res["flash_wait_s"] == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("preset", ["on_demand", "les"])
def test_the_streamers_timers_see_every_read_it_issues_and_takes_in(preset):
    """What the simulator's profile measures (ComputeProfile issue and land costs) comes from the streamer's own
    counts: every expert it reads is issued once (the reader's bytes are the issued experts' reads) and taken in
    at most once; on_demand, which waits for its reads in the layer, takes in each one it issued. With every
    expert in memory nothing is issued."""
    from workbench.io import ALIGN
    from runtime.session import open_session
    with open_session("demo", preset, budget="0.25") as s:
        s.generate([1, 2, 3, 4], tokens=6)
        dec = [e for e in s.tel.events if e.phase == "decode"]
        toks = [t for t in s.tel.tokens if t.phase == "decode"]
        read = sum(-(-n // ALIGN) * ALIGN for _, n in s.pack.expert_reads(s.spec.moe_layers[0], 0))     # as read
        issued, taken = sum(e.issued for e in dec), sum(e.taken for e in dec)
        assert issued > 0 and sum(e.issue_s for e in dec) > 0 and sum(e.take_s for e in dec) > 0
        assert taken <= issued
        if preset == "on_demand":
            assert taken == issued and sum(t.bytes_read for t in toks) == issued * read
    with open_session("demo", preset, budget="all") as s:
        s.generate([1, 2, 3, 4], tokens=4)
        assert sum(e.issued + e.taken for e in s.tel.events if e.phase == "decode") == 0


@pytest.mark.parametrize("preset", ["on_demand", "les", "smol"])
def test_a_byte_budget_holds_the_experts_the_packed_engines_cache_holds(preset):
    """The packed engine's cache counts an expert as its slot (the aligned bytes of its reads), so the simulator
    counts a budget in bytes the same way: 6 slots' bytes hold 6 experts, as a Session of the demo holds."""
    from engines import slot_bytes
    from engines.packed_engine import PackedEngine
    from experiments.simulate import read_plan
    from workbench.registry import resolve_pack
    from workbench.store.pack import Pack
    from workbench.registry import experts_for
    st = get_preset(preset).storage
    experts = experts_for(st.experts, "packed")          # the packed engine's pack of the preset's precision
    pack = Pack(resolve_pack("demo", st.layout.value, experts, st.rest))
    slot = PackedEngine.slot_bytes(pack)
    plan = read_plan(pack.spec, st.layout.value, experts)
    assert slot_bytes("packed", pack.spec, st) == slot
    p = get_preset(preset).with_(predictor=None, cache_scope="global", warm=False)
    drive = Drive([{L: [0, 1, 2, 3] for L in pack.spec.moe_layers}] * 3)
    res = sim(drive, pack.spec, p, str(6 * slot), DEV, dataclasses.replace(CPU, engine="packed"), tokens=2,
                       prompt=1, workers=2, plan=plan)
    assert res["cache_slots"] == 6


def test_belady_evicts_the_expert_used_farthest_ahead_as_a_plain_scan_does():
    """belady_of keeps a heap of next uses (a full-size trace, 48 layers x 512 experts, in well under a second):
    the same misses as scanning the pool for the farthest next use, on random traces, global and per layer."""
    import random
    from experiments.simulate import belady_of

    def scan(seq, cap, per_layer):
        pools, misses = {}, 0
        for i, k in enumerate(seq):
            pool = pools.setdefault(k[0] if per_layer else 0, set())
            if k not in pool:
                misses += 1
                if len(pool) >= cap:
                    ahead = lambda x: next((j for j in range(i + 1, len(seq)) if seq[j] == x), len(seq))
                    pool.remove(max(pool, key=ahead))
                pool.add(k)
        return misses

    rng = random.Random(3)
    for _ in range(100):
        layers, experts, cap = rng.randint(1, 3), rng.randint(2, 24), rng.randint(1, 12)
        seq = [(rng.randrange(layers), min(experts - 1, int(rng.expovariate(0.25)))) for _ in range(rng.randint(1, 200))]
        for per_layer in (False, True):
            assert belady_of(seq, cap, per_layer, initial=())["belady_misses"] == scan(seq, cap, per_layer)


def test_the_reads_in_flight_a_read_sees_are_those_a_plain_scan_counts():
    """The reader pool keeps the reads in flight in a heap by their end (a full-size trace issues tens of thousands):
    on random submits, every read lands when counting the reads in flight over every one issued says it does."""
    import heapq
    import random
    from experiments.simulate import _Pool
    from workbench.io import split_sizes

    def scan(pool, t, groups):             # the pool as it counted before: every read since the submit, scanned
        ready, busy = {}, pool.scanned
        for experts, nbytes in groups:
            end = 0.0
            pieces = split_sizes(nbytes, pool.workers)
            for i, piece in enumerate(pieces):
                free = heapq.heappop(pool.free)
                start = max(t, free) + (pool.wake_s if free <= t else 0.0)
                done = start + pool.device.read_s(piece, 1 + sum(1 for s, e in busy if s <= start < e))
                busy.append((start, done))
                end = max(end, done)
                if i < len(pieces) - 1:
                    heapq.heappush(pool.free, done)
            offset = 0.0
            for k, e in enumerate(experts, 1):
                ready[e] = (end, k)
                offset += pool.dequant_s
            heapq.heappush(pool.free, end + offset)
        pool.scanned = [(s, e) for s, e in busy if e > t]
        return ready

    rng = random.Random(5)
    for _ in range(30):
        workers = rng.randint(1, 4)
        kw = dict(dequant_s=rng.choice([0.0, 0.1 * MS]), wake_s=rng.choice([0.0, 0.3 * MS]))
        heap, plain = _Pool(workers, DEV, **kw), _Pool(workers, DEV, **kw)
        plain.scanned = []
        t = 0.0
        for _ in range(40):
            t += rng.random() * 2 * MS
            groups = [([(0, rng.randrange(99))], rng.choice([KB, 3 * KB, 64 * KB])) for _ in range(rng.randint(1, 6))]
            assert heap.submit(t, groups) == scan(plain, t, groups)


def test_a_full_size_trace_simulates_every_access_once():
    """48 MoE layers of 512 experts, top-10, 128 tokens (the Qwen3-Next-80B shape): the simulator replays it (in
    seconds: the reads in flight are kept in a heap, belady_of's victims in another), every access a hit, a late
    prefetch or a miss, and no design reads fewer experts than Belady's bound."""
    rng = np.random.default_rng(0)
    layers, experts, k, tokens = 48, 512, 10, 128
    p = 1 / np.arange(1, experts + 1) ** 0.8
    rows = [{L: rng.choice(experts, k, replace=False, p=p / p.sum()).tolist() for L in range(layers)}
            for _ in range(tokens + 1)]
    big = MoESpec(family="qwen3_moe", vocab_size=8, hidden_size=2048, num_layers=layers, num_heads=16, num_kv_heads=2,
                  head_dim=256, num_experts=experts, top_k=k, moe_intermediate_size=512)
    plan = ReadPlan("native", (344064, 344064, 589824), item=1290240)     # the 80B GGUF's Q2_K_S slot
    dev = DeviceProfile("phone", "phone", latency_s=0.1 * MS, read_bw=1e9, peak_bw=2e9, queue_depth=4)
    cpu = dataclasses.replace(CPU, dense_s=1 * MS, router_s=0.05 * MS, expert_s=0.1 * MS, land_s=0.02 * MS)
    pre = get_preset("on_demand").with_(layout="native")
    budget = str(4 * 2**30)
    run = simulate_run(Drive(rows), big, pre, budget, dev, cpu, tokens=tokens, prompt=1, workers=4, plan=plan)
    res = run.summary.record()
    steps = tokens - 1
    assert res["hits"] + res["late"] + res["misses"] == steps * layers * k
    assert 0 < res["hit_rate"] < 1 and res["bytes_read"] > 0
    bound = belady(Drive(rows), big, pre, budget, prompt=1, tokens=tokens, initial=run.at_decode, item=plan.item)
    assert bound["accesses"] == steps * layers * k
    assert res["experts_read"] >= bound["belady_misses"] and res["hit_rate"] <= bound["belady_hit_rate"] + 1e-12


def _packed_sizes(model: str, preset):
    """(resident bytes, every expert's slot bytes) of `model` as the packed engine holds it at `preset`."""
    from engines import engine_class, slot_bytes
    from workbench.registry import resolve_pack, storage_for
    from workbench.store.pack import Pack
    pack = Pack(resolve_pack(model, *storage_for(model, get_preset(preset).storage, (), "packed")))
    return engine_class("packed").resident_bytes(pack), slot_bytes("packed", pack) * pack.num_expert_total


def test_a_model_bigger_than_memory_is_profiled_at_the_largest_budget_that_fits(monkeypatch, capsys):
    """With a byte less available than every expert beside the weights needs, the memory guard refuses budget "all"
    (as it does the 80B GGUF here), yet simulate measures its compute profile and runs: its first run at the
    largest budget that fits (named in the profile), after the same tokens ran once, so that it counts decode
    tokens no read touched. With every expert in memory, no read touches any token: the rule changes nothing."""
    import json
    import re
    from cli import main
    from experiments.compute_profile import _untouched
    from runtime.session import open_session
    from workbench import host, memory
    from workbench.errors import WorkbenchError
    with open_session("demo", "les", "all") as s:
        s.generate([1, 2, 3, 4], tokens=4)
        dec, evs = [t for t in s.tel.tokens if t.phase == "decode"], [e for e in s.tel.events if e.phase == "decode"]
        assert _untouched(dec, evs) == (dec, evs)
    resident, experts = _packed_sizes("demo", "les")
    monkeypatch.setattr(memory, "available_bytes", lambda: resident + experts - 1)
    monkeypatch.setattr(host, "peak_rss_bytes", lambda: 0)         # this process's own size: not the test's point
    with pytest.raises(WorkbenchError, match="choose a smaller --budget"):
        open_session("demo", "les", "all")
    trace = str(REPO / "data/traces/demo-tinystories-256.parquet")
    assert main(["simulate", "--trace", trace, "--tokens", "8", "--no-record", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    src = res["compute_profile"]["source"]
    m = re.search(r"at budget (0\.\d\d), the largest that fits here .* the (\d+) of (\d+) decode tokens no read "
                  r"touched", src)
    assert m, src
    assert 0.5 < float(m[1]) < 1 and 0 < int(m[2]) <= int(m[3])
    assert res["tok_s"] > 0 and res["compute_profile"]["expert_s"] > 0 and res["compute_profile"]["dense_s"] > 0


@pytest.fixture(scope="module")
def next_gguf(tmp_path_factory):
    """The Qwen3-Next architecture in llama.cpp's Q4_K_M mix, 4 layers of 16 experts (280 MB): layers 2 and 3 keep
    their experts' down projections in Q6_K, the others in Q4_K."""
    pytest.importorskip("llama_cpp", reason="ggml's kernels come with llama-cpp-python")
    from engines.gguf_random import make_gguf
    g = make_gguf("qwen3-next-80b-a3b", tmp_path_factory.mktemp("next") / "next.gguf", layers=4, experts=16,
                  qtype="q4_k_m")
    yield g
    g.unlink()


def test_a_gguf_is_profiled_on_ggmls_kernels_and_simulated_on_its_own_blocks(next_gguf, tmp_path):
    """A GGUF streams in place (its blocks, native layout): the compute profile times ggml's kernels and the crc on
    each layer's own blocks (the bytes a read of that layer brings), not the preset's q4; the simulator reads each
    layer's experts at their size in the file and its budget buys the slots a Session of the file holds."""
    from experiments.compute_profile import _encoded, _formats, measure_compute
    from experiments.simulate import run
    from experiments.traces import write_trace
    from runtime.session import open_session
    from workbench.registry import GGUF_STORAGE, resolve_pack
    from workbench.store.pack import PARTS, Pack
    pack = Pack(resolve_pack(str(next_gguf), *GGUF_STORAGE))
    sp = pack.spec
    formats = _formats(pack)
    assert set(formats) == {("gguf:Q4_K",) * 3, ("gguf:Q4_K", "gguf:Q4_K", "gguf:Q6_K")}
    for f, layers in formats.items():
        enc = _encoded(f, sp.hidden_size, sp.moe_intermediate_size)
        assert [enc[p].nbytes for p in PARTS] == [n for _, n in pack.expert_reads(layers[0], 0)]
    cp = measure_compute(str(next_gguf), sp, "q4", tokens=3, engine="packed")
    assert "crc check on its gguf:Q4_K/gguf:Q6_K experts" in cp.source and "native layout" in cp.source
    assert cp.expert_s > 0 and cp.dequant_s > 0

    rng = np.random.default_rng(1)
    T, NL = 24, len(sp.moe_layers)
    topk = np.stack([[rng.choice(sp.num_experts, sp.top_k, replace=False) for _ in range(NL)] for _ in range(T)])
    trace = write_trace(tmp_path / "t.parquet", {"topk": topk, "logits": np.zeros((T, NL, sp.num_experts)),
                                                 "router_input": np.zeros((T, NL, 1)), "moe_layers": sp.moe_layers},
                        list(range(T)), {"engine": "test", "model": str(next_gguf), "spec": sp.to_dict()})
    res = run(str(trace), "on_demand", "0.5", "ufs22-phone", tokens=16, compute=cp, model=str(next_gguf),
              record=False)
    per_layer = [sum(n for _, n in pack.expert_reads(L, 0)) for L in sp.moe_layers]
    assert res["expert_disk_bytes"] == pytest.approx(np.mean(per_layer))
    with open_session(str(next_gguf), "on_demand", "0.5") as s:
        assert res["pool_slots"] == s.cache.capacity[sp.moe_layers[0]]
        assert s.summary()["expert_disk_bytes"] == pytest.approx(res["expert_disk_bytes"])   # one meaning


def test_below_every_expert_the_streaming_run_holds_less_than_the_first_and_no_room_is_refused(monkeypatch):
    """The profile's first run holds the largest budget that fits, but no more than its tokens' experts need; its
    streaming run (budget 0.5) must read: where the first holds no more than it, it streams at half that budget. Where not even the weights leave room for an expert, a one-line error."""
    from experiments.compute_profile import _budgets
    from workbench import host, memory
    from workbench.errors import WorkbenchError
    resident, experts = _packed_sizes("demo", "les")
    monkeypatch.setattr(host, "peak_rss_bytes", lambda: 0)
    p = get_preset("les")
    monkeypatch.setattr(memory, "available_bytes", lambda: resident + experts)
    assert _budgets("demo", p, "packed", 16, "0.5") == ("all", "0.5")
    monkeypatch.setattr(memory, "available_bytes", lambda: resident + experts * 3 // 4)
    fits, stream = _budgets("demo", p, "packed", 16, "0.5")
    assert 0.5 < float(fits) < 0.75 and stream == "0.5"
    fits, stream = _budgets("demo", p, "packed", 1, "0.5")      # 5 tokens x top-4 x 8 layers: 0.625 of 256 experts
    assert fits == "0.63" and stream == "0.5"                   # no more than the run's own experts need
    monkeypatch.setattr(memory, "available_bytes", lambda: resident + experts * 2 // 5)
    fits, stream = _budgets("demo", p, "packed", 16, "0.5")
    assert 0.2 < float(fits) < 0.4 and stream == f"{float(fits) / 2:.2f}"
    monkeypatch.setattr(memory, "available_bytes", lambda: resident // 2)
    with pytest.raises(WorkbenchError, match="hold none beside its weights"):
        _budgets("demo", p, "packed", 16, "0.5")


def test_a_measured_runs_acceptance_replayed_is_what_the_simulated_steps_accept():
    """A modelled draft (2 a step) with a measured run's accepted drafts a step, 2, 0, 1, replayed in place of the
    modelled draws: 7 decoded tokens take 4 steps, 2 + 0 + 1 drafts accepted, then 1 (only one is left to make: the
    replay's 2, capped)."""
    from runtime.speculative import ReplayedAcceptance
    a = ReplayedAcceptance([2, 0, 4])
    assert [a.draw(4), a.draw(4), a.draw(3), a.draw(4)] == [2, 0, 3, 2]       # capped at 3; again from the start
    p = get_preset("on_demand").with_(layout="contiguous", speculative=2, draft="modelled:0.5")
    res = sim(Drive([{0: [i % 4, 4 + i % 3]} for i in range(12)]), spec(), p, str(3 * 4 * 3 * 64 * 64), DEV, CPU,
              tokens=8, prompt=1, workers=2, plan=PLAN, acceptance=ReplayedAcceptance([2, 0, 1]))
    assert (res["spec_steps"], res["spec_accepted"]) == (4, 4)
