"""Full size, one file, side by side: stock llama.cpp and the designs streaming from the same GGUF.

    python -m workbench make-model --shape qwen3-next-80b-a3b --out /tmp/fullsize/qwen3-next-80b-a3b.gguf
    python benchmarks/full_size.py --model /tmp/fullsize/qwen3-next-80b-a3b.gguf --budgets 2GiB,4GiB,8GiB

Every arm is a fresh process measured cold (the file dropped from the page cache first), in alternating order
within a round: stock llama.cpp (mmap: the page cache is its cache; its memory is its peak RSS plus the file's
pages resident after the run), then each design at each budget (`bench`, streaming from the GGUF in place).
Per arm: tok/s, peak RSS, bytes read and hit / late / miss per token; per budget, Belady's MIN over on_demand's
own decode routing (the fewest experts any policy reads with that many slots) as a bound in tok/s (its reads at the
run's disk bandwidth, or on_demand's compute, whichever is slower), and each design's floor. The model's weights
are whatever the file holds (a make-model file is RANDOM, and labelled so). Writes results/full_size.{json,md}.
--routing-trace T drives every design's routing (and its predictions: modelled where T holds no router inputs, at
--set lookahead_recall=R) from a routing trace (a real model's: data/traces/qwen3-30b-a3b-bigmoeonedge.parquet);
llama.cpp, which routes itself, stays on the file's own routing: a reference, not the same work.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.llamacpp_engine import bench_gguf  # noqa: E402
from experiments.simulate import belady_of  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.disk_probe import bandwidth_at, probe  # noqa: E402
from workbench.commands import flags  # noqa: E402
from workbench.presets import Router, get_preset  # noqa: E402
from workbench.edge0.artifacts import FILES, edge0_dir_of  # noqa: E402
from experiments.cli import knobs_of  # noqa: E402

PROMPT = "Once upon a time"


def verb(*args) -> dict:
    cmd = [sys.executable, "-m", "workbench", *map(str, args), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return json.loads(p.stdout)


def preset_of(design: str) -> str:
    """A design is a preset and the knobs it sets: edge0@routing=prerouter:nolora."""
    return design.split("@")[0]


def knobs_for(model: str, design: str) -> list[str]:
    """The knobs a design sets. Edge0 serves its recovery LoRA where one was trained for the file (beside it,
    edge0/lora.safetensors), and routes with its prerouter alone where none was (training/edge0_lora.py trains
    one)."""
    preset, *knobs = design.split("@")
    if preset == "edge0" and not any(k.startswith("routing=") for k in knobs) and not (
            edge0_dir_of(model) / FILES["lora"]).exists():
        knobs.append("routing=prerouter:nolora")
    return knobs


def bench_arm(model: str, design: str, budget: str, tokens: int, threads: int | None, trace: str | None = None,
              text: tuple = ()) -> dict:
    """One design in a fresh process, and what `info` said it would hold (run_bytes, for --tokens of context); a
    design that fails or is refused is recorded with its one-line reason, and the others go on."""
    preset, knobs = preset_of(design), knobs_for(model, design)
    try:
        res = verb("bench", "--model", model, "--preset", preset, "--budget", budget, "--tokens", tokens, "--prompt",
                   PROMPT, *(["--threads", threads] if threads else []), *(a for k in knobs for a in ("--set", k)),
                   *(["--routing-trace", trace] if trace else []), *text)
        res["info_run_bytes"] = verb("info", "--model", model, "--preset", preset, "--budget", budget)["memory"]["run_bytes"]
    except SystemExit as e:
        return {"error": str(e), "tok_s": None}
    return {**res, "knobs": knobs}


def accesses(run: str) -> dict:
    """{phase: (layer, expert) in the order the run's steps of that phase asked for them} (its record's events)."""
    import pyarrow.parquet as pq
    ev = sorted(pq.read_table(Path(run) / "events.parquet").to_pylist(), key=lambda e: (e["token"], e["layer"]))
    return {phase: [(e["layer"], int(x)) for e in ev if e["phase"] == phase for x in e["routed"]]
            for phase in ("prefill", "decode")}


def bound(od: dict, disk: dict, seen_bw: float, compute_s: float, routing: dict | None = None) -> dict:
    """Belady's MIN over on_demand's decode routing with its slots (or over `routing`'s, a run of a design that
    routes otherwise: Edge0's prediction is its routing), as tok/s: its reads at the best bandwidth the disk probe
    found at the run's read size (any queue depth) or the most any run drew from the disk (its bytes over its decode
    time: a virtualised disk may serve a file's blocks faster than a fresh probe's), each read on_demand's bytes per
    expert, or `compute_s` a token where that is slower (the least any arm at the budget computed and routed: reads
    slow the compute thread that waits on them, so on_demand's own is not the least); from the cache every cold
    run starts decoding with (the prompt's experts, the most recent first, as many as fit), and from the best start
    any policy could have (the first experts decoding asks for, preloaded free: a bound no cold run can reach)."""
    seen = accesses((routing or od)["run"])
    seq, prompt = seen["decode"], list(dict.fromkeys(reversed(seen["prefill"])))
    expert = od["bytes_read"] / max(1, od["misses"])              # bytes one demand read brings in
    slots, steps = int(od["cache_slots"]), max(1, od["decode_steps"])
    bw = max(bandwidth_at(disk, od["floor_read_size"]), seen_bw)

    def as_tok_s(b):
        read_s = b["belady_misses"] / steps * expert / bw
        return read_s, 1 / max(read_s, compute_s)
    b, best = belady_of(seq, slots, initial=prompt), belady_of(seq, slots, initial=None)
    (read_s, tok_s), (_, best_tok_s) = as_tok_s(b), as_tok_s(best)
    return {**b, "slots": slots, "belady_tok_s": tok_s, "belady_read_s_per_token": read_s, "disk_bw": bw,
            "compute_s_per_token": compute_s,
            "best_start_misses": best["belady_misses"], "best_start_tok_s": best_tok_s}


def routes_otherwise(design: str, knobs: list[str]) -> bool:
    """The design's routing is not the model's exact router (Edge0's prerouter, a cache-aware bias): its accesses
    are its own, and so is its bound."""
    return get_preset(preset_of(design)).with_(**knobs_of(knobs)).routing.router is not Router.EXACT


def _trace_note(rows: list) -> str:
    """What the routing trace's drive said of its mapping and predictions, from a design's run."""
    src = next((r["median_run"].get("routing_trace") for r in rows[1:] if r["median_run"].get("routing_trace")), None)
    if not src:
        return "no design ran"
    preds = sorted({r["median_run"]["routing_trace"]["prediction"] for r in rows[1:]
                    if (r["median_run"].get("routing_trace") or {}).get("prediction")})
    return "; ".join([src["mapping"].split("; tokens")[0], f"mixing weights: {src.get('mixing_weights', 'uniform')}",
                      *preds, *([f"warm sets' usage: {src['warm_usage']}"] if src.get("warm_usage") else [])])


def label(row: dict) -> str:
    """The design, and the knobs its arms changed."""
    return preset_of(row["design"]) + "".join(f" ({k})" for k in row["median_run"].get("knobs", []))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags("model", model={"default": None, "required": True, "help": "a GGUF"})(ap)
    ap.add_argument("--budgets", default="2GiB,4GiB,8GiB")
    ap.add_argument("--designs", default="on_demand,les,smol")
    flags("tokens", tokens=16)(ap)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--design-threads", type=int, default=None, help="the designs' (default: the engine's)")
    ap.add_argument("--llama", default="cold", choices=["cold", "warm"],
                    help="llama.cpp's start: cold, or warm (the whole file read into the page cache first)")
    ap.add_argument("--routing-trace", default=None, metavar="T", help="drive every design's routing from this trace")
    flags("text", "free")(ap)           # a made file decodes forced text unless --free (runtime/text.py)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--tag", default="", help="written to results/full_size_<file's stem>[-TAG].{json,md}")
    ap.add_argument("--tables-from", type=Path, default=None, metavar="JSON",
                    help="write the tables again from a results JSON this script wrote (its runs), measuring nothing")
    a = ap.parse_args(argv)
    budgets, designs = a.budgets.split(","), a.designs.split(",")
    arms = {("llama.cpp", f"mmap, {a.llama}"): []} | {(d, b): [] for b in budgets for d in designs}
    if a.tables_from:
        old = json.loads(a.tables_from.read_text())
        for d, b, got in old.get("arms") or [(r["design"], r["budget"], [r["median_run"]]) for r in old["rows"]]:
            arms[(d, b)] = got
    disk = old["disk"] if a.tables_from and "disk" in old else probe(Path(a.model).parent, refresh=not a.tables_from)
    command = f"python benchmarks/full_size.py --model {a.model} --budgets {a.budgets} --designs {a.designs} " \
              f"--tokens {a.tokens} --rounds {a.rounds} --threads {a.threads} --llama {a.llama}" + \
              (f" --design-threads {a.design_threads}" if a.design_threads else "") + \
              (f" --routing-trace {a.routing_trace}" if a.routing_trace else "") + \
              (" --free" if a.free else f" --text {a.text}" if a.text else "")
    text = ("--free",) if a.free else ("--text", a.text) if a.text else ()
    run = {"command": command, "model": a.model, "disk": disk,
           "file_size": old["file_size"] if a.tables_from else os.path.getsize(a.model),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}}
    now = lambda: {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0]}
    name = Path(a.model).stem + (f"-{a.tag}" if a.tag else "")
    partial = a.out / f"full_size_{name}.partial.json"     # a long run's arms so far: --tables-from it if cut off
    for r in range(0 if a.tables_from else a.rounds):
        for (d, b), got in arms.items():
            t0 = time.time()
            got.append(bench_gguf(a.model, tokens=a.tokens, prompt=PROMPT, mode=a.llama, threads=a.threads, warmup=0)
                       if d == "llama.cpp" else bench_arm(a.model, d, b, a.tokens, a.design_threads, a.routing_trace, text))
            print(f"round {r + 1}: {d} @{b}: {got[-1].get('error') or format(got[-1]['tok_s'], '.3f') + ' tok/s'} "
                  f"({time.time() - t0:.0f} s)", flush=True)
            atomic_write(partial, json.dumps({**run, "arms": [[d, b, got] for (d, b), got in arms.items()], **now()},
                                             default=str))
    rows, failed = [], []
    for (d, b), got in arms.items():
        failed += [f"- {d} @{b}: {g['error']}" for g in got if g.get("error")]
        got = [g for g in got if not g.get("error")]
        if not got:
            continue
        tok = [g["tok_s"] for g in got]
        med = sorted(got, key=lambda g: g["tok_s"])[len(got) // 2]
        row = {"design": d, "budget": b, "tok_s": statistics.median(tok), "tok_s_min": min(tok), "tok_s_max": max(tok),
               "peak_rss_bytes": med["peak_rss_bytes"], "median_run": med}
        if d == "llama.cpp":      # its own memory and the file's pages it brought into the page cache
            row["memory_bytes"] = med["rss_anon_bytes"] + med["file_resident_after_bytes"]
        else:
            row["memory_bytes"] = med["peak_rss_bytes"]
        rows.append(row)
    llama = rows[0]
    for row in rows[1:]:
        row["over_llama_cpp"] = row["tok_s"] / llama["tok_s"]
        row["memory_over_llama_cpp"] = row["memory_bytes"] / llama["memory_bytes"]
    seen_bw = max((g["bytes_read"] / g["decode_s"] for (d, _), got in arms.items() if d != "llama.cpp" for g in got
                   if g.get("decode_s")), default=0.0)
    od = {r["budget"]: r["median_run"] for r in rows if r["design"] == "on_demand"}
    least = {b: min(r["median_run"]["floor_compute_s_per_token"] for r in rows[1:] if r["budget"] == b) for b in od}
    bounds = {b: bound(od[b], disk, seen_bw, least[b]) for b in budgets if b in od}
    for row in rows[1:]:
        if row["budget"] not in od:
            continue
        if routes_otherwise(row["design"], row["median_run"].get("knobs", [])):
            row["own_bound"] = bound(od[row["budget"]], disk, seen_bw, least[row["budget"]], routing=row["median_run"])
        b = row.get("own_bound") or bounds[row["budget"]]
        row["over_belady"] = row["tok_s"] / b["belady_tok_s"]
        row["over_belady_best_start"] = row["tok_s"] / b["best_start_tok_s"]
    res = {**run, "rows": rows, "arms": [[d, b, got] for (d, b), got in arms.items()], "failed": failed,
           "bounds": bounds, "random_weights": rows[1]["median_run"].get("random_weights") if len(rows) > 1 else None,
           **now()}
    if a.tables_from:               # measured then: said as it was
        res.update({k: old[k] for k in ("command", "date", "machine") if k in old}, load=old.get("load"))
    gib = lambda n: n / 2 ** 30
    md = [f"# Full size: {Path(a.model).name} ({gib(res['file_size']):.1f} GiB), stock llama.cpp and the designs\n",
          f"`{res['command']}` ({res['date']}, {res['machine']['cores']} cores, load "
          f"{'?' if res['load'] is None else format(res['load'], '.1f')}). "
          f"{res['random_weights'] or ''}\n",
          *([f"Every design routes as the trace `{a.routing_trace}` recorded ({_trace_note(rows)}); llama.cpp "
             f"routes itself, on the file's own routing: a reference, not the same work.\n"] if a.routing_trace else []),
          "Each arm a fresh process, cold (file out of the page cache), alternating within a round; tok/s median "
          "(min-max). llama.cpp's memory is its anonymous RSS plus the file's pages in the page cache after the run "
          "(what its mmap holds of the machine's memory); a design's is its peak RSS.\n",
          "| design | budget | tok/s | min-max | x llama.cpp | peak RSS GiB | memory GiB | / llama.cpp's | MB read/tok "
          "| hit | late | miss | recall | / floor | / Belady | threads | RSS / info's |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["median_run"]
        f = lambda k, fmt=".3f", scale=1: "" if m.get(k) is None else format(m[k] * scale, fmt)
        md.append(f"| {label(r)} | {r['budget']} | {r['tok_s']:.3f} | {r['tok_s_min']:.3f}-{r['tok_s_max']:.3f} | "
                  f"{r.get('over_llama_cpp', 1.0):.2f} | {gib(r['peak_rss_bytes']):.2f} | {gib(r['memory_bytes']):.2f} | "
                  f"{r.get('memory_over_llama_cpp', 1.0):.2f} | "
                  f"{f('bytes_read_per_token', '.0f', 1e-6)} | "
                  f"{f('hit_rate')} | {f('late_rate')} | {f('miss_rate')} | {f('prefetch_recall', '.2f')} | "
                  f"{f('achieved_over_floor', '.2f')} | {'' if 'over_belady' not in r else format(r['over_belady'], '.2f')} | "
                  f"{m.get('threads', '')} | "
                  f"{format(m['peak_rss_bytes'] / m['info_run_bytes'], '.2f') if m.get('info_run_bytes') else ''} |")
    spec = [r for r in rows[1:] if r["median_run"].get("spec_steps")]
    md += [] if not spec else [
        "", "Speculative arms (median run): drafts verified per step in one batch; the batch routes to more experts "
        "than its first token (union growth), and bytes and tok/s count produced tokens. A modelled acceptance "
        "(MODELLED: no draft runs) drafts the run's own next tokens, each accepted with that probability while the "
        "ones before it were.", "",
        "| design | budget | draft | accepted | tokens/step | union growth | MB read/produced token | tok/s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *(f"| {label(r)} | {r['budget']} | {r['median_run']['draft']} | {r['median_run']['spec_accept_rate']:.2f} | "
          f"{r['median_run']['tokens_per_target_step']:.2f} | {r['median_run']['union_growth']:.2f} | "
          f"{r['median_run']['bytes_read_per_token'] / 1e6:.0f} | {r['tok_s']:.3f} |" for r in spec)]
    md += [] if not failed else ["", "Arms that did not run (their one-line reason):", "", *failed]
    md += [] if not bounds else [
        "", "Belady's bound per budget (MIN over on_demand's decode routing, its slots; reads at the best bandwidth "
        "the disk probe found at the run's read size or the most a run drew from the disk, whichever is more; "
        "or the least compute and routing any arm at the budget took a token, where that is slower), from the cache "
        "a cold run starts decoding with (the prompt's experts): "
        "`/ Belady`; and from the best start any policy could have (the first experts decoding asks for, preloaded "
        "free):", ""]
    md += [f"- {b}: {v['slots']} slots, {v['belady_misses']} misses of {v['accesses']} accesses "
           f"(hit {v['belady_hit_rate']:.3f}), {1e3 * v['belady_read_s_per_token']:.0f} ms of reads a token at "
           f"{v['disk_bw'] / 1e6:.0f} MB/s against {1e3 * v['compute_s_per_token']:.0f} ms of compute: "
           f"{v['belady_tok_s']:.3f} tok/s; "
           f"from the best start "
           f"{v['best_start_misses']} misses, {v['best_start_tok_s']:.3f} tok/s" for b, v in bounds.items()]
    md += [f"- {r['design']} @{r['budget']}: its own routing's bound (it routes otherwise): "
           f"{r['own_bound']['belady_misses']} misses of {r['own_bound']['accesses']}, "
           f"{r['own_bound']['belady_tok_s']:.3f} tok/s" for r in rows[1:] if "own_bound" in r]
    md += [f"- {r['design']} @{r['budget']}: {r['over_belady']:.2f} of the bound, {r['over_belady_best_start']:.2f} "
           f"of the best-start one" for r in rows[1:] if "over_belady" in r]
    md += ["", "Where a design's token goes (median run, ms per token):", "",
           "| design | budget | compute | router | flash wait | other | floor: compute | floor: reads |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows[1:]:
        m = r["median_run"]
        n = max(1, m.get("produced") or m["decode_steps"])          # per produced token (a speculative step makes more)
        md.append(f"| {label(r)} | {r['budget']} | {1e3 * m['compute_s'] / n:.0f} | {1e3 * m['router_s'] / n:.0f} | "
                  f"{1e3 * m['flash_wait_s'] / n:.0f} | {1e3 * m['other_s'] / n:.0f} | "
                  f"{1e3 * m['floor_compute_s_per_token']:.0f} | {1e3 * m['floor_read_s_per_token']:.0f} |")
    atomic_write(a.out / f"full_size_{name}.json", json.dumps(res, indent=1, default=str) + "\n")
    atomic_write(a.out / f"full_size_{name}.md", "\n".join(md) + "\n")
    partial.unlink(missing_ok=True)
    print("\n".join(md))


if __name__ == "__main__":
    main()
