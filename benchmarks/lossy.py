"""What each lossy lever buys and costs: speed against the teacher's quality, on one model, disk and budget.

    python benchmarks/lossy.py --model demo --budgets 0.1,0.25,0.5 --rounds 3 --out results/lossy.md

Every arm is a design with a lever set (workbench.designs.lossy: drop_misses, top_k, low_on_miss, low_by_hotness;
smol's cache bias and q2 experts as they ship) beside its lossless design (les). A low tier's resident q2 copies are
memory beside the budget: their MiB are in the table. Speed: `bench`, each arm cold, the arms alternating within a round,
the median over rounds with min-max. Quality, on the same tokens for every arm: KL(teacher || arm), top-1
agreement and perplexity on held-out text (`eval teacher`'s method, the teacher computed once), and at one budget
(--lm-budget) lm-eval tasks scored item by item and paired with the teacher (bootstrap intervals). The held-out
text is decoded a token a step (evals.teacher.compare's decode), as the levers act while decoding; lm-eval scores
by batched forwards, where a lever that acts only while decoding (drop_misses) does nothing: its cells say so.
Writes FILE.md and FILE.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evals.lm import local_task_names, primaries, run as lm_run  # noqa: E402
from evals.paired import paired  # noqa: E402
from evals.teacher import run as teacher_run, teacher_trace  # noqa: E402
from experiments.bench import bench  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.presets import get_preset  # noqa: E402

# arm -> (design, its knobs): the lossless reference first
ARMS = {
    "les": ("les", {}),
    "les + drop_misses": ("les", {"routing": "drop_misses"}),
    "les + drop_misses keep=2": ("les", {"routing": "drop_misses", "keep": "2"}),
    "les + top_k k=3": ("les", {"routing": "top_k", "k": "3"}),
    "les + top_k k=2": ("les", {"routing": "top_k", "k": "2"}),
    "les + top_k mass=0.8": ("les", {"routing": "top_k", "mass": "0.8"}),
    "les + top_k k=4 first half then 2": ("les", {"routing": "top_k", "k": "4,4,4,4,2,2,2,2"}),
    "les + low_on_miss (q2 tier)": ("les", {"routing": "low_on_miss"}),
    "les + low_by_hotness hottest=0.5 (q2 tier)": ("les", {"routing": "low_by_hotness", "hottest": "0.5"}),
    "smol_bias (q2 experts + cache bias)": ("smol_bias", {}),
    "smol (q2 experts)": ("smol", {}),
}


DECODE_ONLY = {"drop_misses", "low_on_miss"}      # routers that act on decode steps only (workbench.designs.lossy)


def preset_of(arm: str):
    design, knobs = ARMS[arm]
    return get_preset(design).with_(**knobs) if knobs else get_preset(design)


def speed(model, arms, budgets, rounds, tokens, log, device=None) -> dict:
    """{(arm, budget): [bench results, a round each]}, arms alternating within each round, every run cold."""
    out = {(a, b): [] for a in arms for b in budgets}
    for r in range(rounds):
        for b in budgets:
            for a in arms:
                design, knobs = ARMS[a]
                if isinstance(out[(a, b)], str):
                    continue
                try:
                    res = bench(model, design, b, tokens=tokens, device=device, **knobs)
                except WorkbenchError as e:         # a per-layer pool below a layer's top-k at a small budget
                    out[(a, b)] = str(e)
                    log(f"{a} @{b}: not run: {e}")
                    continue
                out[(a, b)].append(res)
                log(f"round {r + 1} {a} @{b}: {res['tok_s']:.1f} tok/s, {res['bytes_read_per_token'] / 1e3:.0f} KB/token")
    return out


def row(arm, budget, runs, quality, ref) -> dict:
    tok = [r["tok_s"] for r in runs]
    steps = sum(r["decode_steps"] for r in runs) / len(runs)
    computed = statistics.median(sum(x["routed"] + x["low"] for x in r["per_layer"]) / max(1, r["decode_steps"]) for r in runs)
    return {"arm": arm, "budget": budget, "tok_s": statistics.median(tok), "tok_s_min": min(tok), "tok_s_max": max(tok),
            "tok_s_rounds": tok, "over_les": statistics.median(tok) / ref if ref else None,
            "bytes_read_per_token": statistics.median(r["bytes_read_per_token"] for r in runs),
            "hit_rate": statistics.median(r["hit_rate"] for r in runs), "experts_computed_per_token": computed,
            "decode_steps": steps, "runs": [r.get("run") for r in runs],
            "random_weights": runs[0].get("random_weights"),
            "dropped_fraction": statistics.median(r["dropped_fraction"] for r in runs),
            "low_fraction": statistics.median(r["low_fraction"] for r in runs), "low_tier_bytes": runs[0]["low_tier_bytes"],
            "dropped_by_layer": {x["layer"]: statistics.median(y["dropped_fraction"] for r in runs for y in r["per_layer"]
                                                               if y["layer"] == x["layer"]) for x in runs[0]["per_layer"]},
            **{k: quality[k] if quality else None for k in ("kl", "kl_stderr", "top1", "top1_stderr", "ppl", "ppl_ratio")}}


def pareto(rows: list[dict]) -> list[str]:
    """The arms no other arm beats on both tok/s and KL."""
    rows = [r for r in rows if "not_run" not in r and r["kl"] is not None]
    return [r["arm"] for r in rows if not any(o["tok_s"] > r["tok_s"] and o["kl"] < r["kl"] for o in rows)]


def markdown(res: dict) -> str:
    where = f", EMULATED {res['device']} (this machine's reads made to take that device's time)" if res.get("device") \
        else ""
    unscored = res.get("random_weights")
    md = [f"# What each lossy lever buys and costs\n\n`{res['command']}`\n",
          f"{res['model']}{f' (RANDOM weights: {unscored})' if unscored else ''}, {res['engine'] or 'the default engine'}"
          f"{where}; speed over {res['rounds']} alternating cold "
          f"rounds of {res['tokens']} tokens (median, min-max); " + (
              "quality not measured: a made checkpoint's random weights have no teacher whose output means anything, so "
              "only the speed is; the demo's table (results/lossy.md) prices the same levers in quality.\n" if unscored
              else f"quality against the full-precision teacher on "
          f"{res['quality_tokens']} held-out tokens of {res['data']} (KL(teacher || arm) and top-1 agreement per "
          f"token, with standard errors; the arm decodes the text a token a step). les is the lossless design: its KL is "
          f"its quantized experts' alone.\n")]
    for b in res["budgets"]:
        md += [f"## Budget {b}\n", "| arm | tok/s | min-max | x les | KB read/token | experts computed/token | from q2 tier "
               "(MiB held) | KL | top-1 | ppl (x teacher) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in res["rows"] if r["budget"] == b):
            if "not_run" in r:
                md.append(f"| {r['arm']} | not run: {r['not_run']} |||||||||")
                continue
            quality = "not measured (random weights) | | |" if r["kl"] is None else (
                f"{r['kl']:.4f} ± {r['kl_stderr']:.4f} | {r['top1']:.3f} ± {r['top1_stderr']:.3f} | {r['ppl']:.3f} "
                f"({r['ppl_ratio']:.3f}) |")
            md.append(f"| {r['arm']} | {r['tok_s']:.2f} | {r['tok_s_min']:.2f}-{r['tok_s_max']:.2f} | "
                      f"{r['over_les']:.2f} | {r['bytes_read_per_token'] / 1e3:.0f} | "
                      f"{r['experts_computed_per_token']:.1f} | " + (
                          f"{r['low_fraction']:.2f} ({r['low_tier_bytes'] / 2**20:.1f}) | " if r.get("low_tier_bytes")
                          else "| ") + quality)
        if not unscored:
            md += ["", f"Pareto front (tok/s against KL): {', '.join(res['pareto'][b])}."]
        md.append("")
        lossy = [r for r in res["rows"] if r["budget"] == b and r.get("dropped_fraction")]
        if lossy:
            layers = list(lossy[0]["dropped_by_layer"])
            md += [f"Of the model's top-k choices, the fraction each lever left out, by MoE layer (median over the "
                   f"rounds), at budget {b}:\n", "| arm | all | " + " | ".join(f"L{L}" for L in layers) + " |",
                   "|---|---:|" + "---:|" * len(layers)]
            md += [f"| {r['arm']} | {r['dropped_fraction']:.3f} | " + " | ".join(
                f"{r['dropped_by_layer'][L]:.3f}" for L in layers) + " |" for r in lossy]
            md.append("")
    if res["tasks"]:
        md += [f"## lm-eval at budget {res['lm_budget']}, paired with the teacher item by item\n",
               f"Tasks {', '.join(res['task_names'])}, limit {res['limit']} items each; each cell: the arm's score, "
               "its difference from the teacher's on the same items and the 95% bootstrap interval of that "
               "difference.\n",
               "| arm | " + " | ".join(res["task_names"]) + " |", "|---|" + "---:|" * len(res["task_names"])]
        for arm, cells in res["tasks"].items():
            if cells is None:
                md.append(f"| {arm} | " + " | ".join("not measured: it acts while decoding, lm-eval scores by "
                                                    "batched forwards" for _ in res["task_names"]) + " |")
                continue
            md.append(f"| {arm} | " + " | ".join(
                f"{c['value']:.3f} ({c['paired']['diff']:+.3f}, [{c['paired']['ci'][0]:+.3f}, "
                f"{c['paired']['ci'][1]:+.3f}])" for c in cells.values()) + " |")
        md.append("")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of: {', '.join(ARMS)}")
    ap.add_argument("--budgets", default="0.1,0.25,0.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--data", default="tinystories")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tasks", default="tinystories_ending,tinystories_cloze", help="'' for none")
    ap.add_argument("--limit", type=int, default=200, help="lm-eval items per task")
    ap.add_argument("--lm-budget", default="0.25")
    ap.add_argument("--engine", default=None)
    ap.add_argument("--device", default=None, help="a device profile to emulate (data/devices: ufs22-phone)")
    ap.add_argument("--out", required=True, help="FILE.md (and FILE.json beside it)")
    a = ap.parse_args()
    arms, budgets = a.arms.split(","), a.budgets.split(",")
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"error: --arms: {arm!r} is not one of {', '.join(ARMS)}")
    t0 = time.time()
    runs = speed(a.model, arms, budgets, a.rounds, a.tokens, print, a.device)
    unscored = next((r[0].get("random_weights") for r in runs.values() if not isinstance(r, str)), None)
    trace = None if unscored else teacher_trace(a.model, a.data, a.ctx, a.chunks, progress=False, engine=a.engine)
    rows = []
    for b in budgets:
        ref = statistics.median(r["tok_s"] for r in runs[("les", b)]) if ("les", b) in runs else None
        for arm in arms:
            if isinstance(runs[(arm, b)], str):
                rows.append({"arm": arm, "budget": b, "not_run": runs[(arm, b)]})
                continue
            q = None if unscored else teacher_run(a.model, preset_of(arm), b, trace=trace, progress=False,
                                                  record=False, engine=a.engine, decode=True)
            rows.append(row(arm, b, runs[(arm, b)], q, ref))
    tasks, names = {}, []
    if a.tasks and not unscored:
        names = [t.removesuffix("_local") for t in local_task_names(a.tasks.split(","))]
        scored = lambda p: lm_run(a.model, p, a.lm_budget, a.tasks, a.limit, record=False, engine=a.engine,
                                  progress=False, per_item=True)["results"]
        gold = scored("teacher")
        for arm in arms:
            if ARMS[arm][1].get("routing") in DECODE_ONLY:
                tasks[arm] = None
                continue
            mine, cells = scored(preset_of(arm)), {}
            for task, pm in primaries(mine).items():
                m, metric, value = mine[task], pm.metric, pm.value
                if m["items"]["doc_id"] != gold[task]["items"]["doc_id"]:
                    raise SystemExit(f"error: {arm} and the teacher scored different items of {task}")
                cells[task.removesuffix("_local")] = {"metric": metric, "value": value,
                                                     "paired": paired(gold[task]["items"][metric], m["items"][metric])}
            tasks[arm] = cells
    command = " ".join(["python", "benchmarks/lossy.py"] + sys.argv[1:])
    res = {"command": command, "model": a.model, "engine": a.engine, "device": a.device, "random_weights": unscored,
           "budgets": budgets, "rounds": a.rounds, "tokens": a.tokens, "data": a.data,
           "quality_tokens": None if unscored else q["tokens"],
           "rows": rows, "pareto": {b: pareto([r for r in rows if r["budget"] == b]) for b in budgets},
           "tasks": tasks, "task_names": names, "limit": a.limit, "lm_budget": a.lm_budget,
           "arms": {arm: ARMS[arm] for arm in arms}, "seconds": time.time() - t0,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(a.out)
    atomic_write(out.with_suffix(".json"), json.dumps(res, indent=1, default=str))
    atomic_write(out, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
