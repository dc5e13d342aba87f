"""Ladders: ordered rungs, each adding one knob, measured in one run with alternating arms.

    python -m workbench ladder les   --model demo --budget 0.25 --json
    python -m workbench ladder smol  --model demo --budget 0.25 --json
    python -m workbench ladder cache --model demo --json
    python -m workbench ladder designs --model demo --json    (every design side by side at one budget)

Rounds run every rung once in order (A B C ... A B C ...), each arm a fresh Session after a
warm-up; reads are O_DIRECT, so no arm inherits another's page cache. Reported per rung: the
median tok/s with min-max over rounds, and the other fields from the median round.
"""
from __future__ import annotations

import statistics

import numpy as np

from experiments.bench import measure, open_session
from workbench.presets import get_preset
from workbench.runs import write_run
from workbench.session import Session
from workbench.errors import WorkbenchError
from workbench.textdata import heldout_ids

BIAS_SWEEP = (0.005, 0.02, 0.05, 0.1, 0.25)


def les_rungs():
    base = get_preset("on_demand").with_(name="on_demand")
    look = base.with_(name="+lookahead", predictor="lookahead:1:k")
    sched = look.with_(name="+ready_first & contiguous", execution="ready_first", layout="contiguous")
    mixed = sched.with_(name="+mixed precision (q3/q4)", experts="q3", rest="q4")
    spec = mixed.with_(name="+speculative verification", speculative=4)
    return [base, look, sched, mixed, spec]


def smol_rungs():
    exact = get_preset("smol").with_(name="pager (exact, no prefetch)", predictor=None)
    pre = exact.with_(name="+prefetch 2 ahead", predictor="lookahead:2:k")
    return [exact, pre] + [pre.with_(name=f"+bias {b}", routing=f"cache_bias:{b}") for b in BIAS_SWEEP]


def cache_rungs(spec_top_k: int, item_bytes: int, layers: int, preset: str = "les"):
    """Window sweep: c extra slots beyond one layer's top-k (c=0 releases after use), up to all-resident."""
    p = get_preset(preset)
    out = []
    for c in (0, spec_top_k, 4 * spec_top_k, 16 * spec_top_k):
        out.append((p.with_(name=f"window c={c}"), str((spec_top_k + c) * item_bytes)))
    for frac in ("0.25", "0.5", "all"):
        out.append((p.with_(name=f"budget {frac}"), frac))
    return out


def decode_nll(session: Session, ids: list[int]) -> np.ndarray:
    """Teacher-forced decode, token by token, so the cache (and a cache-aware bias) evolves as in generation."""
    session.engine.reset()
    nll = []
    logits = session.step(ids[:1], "prefill")
    for i, t in enumerate(ids[1:]):
        z = logits[-1].astype(np.float64)
        nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[t])
        logits = session.step([t], "decode")
    return np.asarray(nll)


def run_ladder(name: str, model: str = "demo", budget: str = "0.25", tokens: int = 48, rounds: int = 3,
               prompt: str = "Once upon a time", quality_tokens: int = 0, progress=None, also_on: dict | None = None) -> dict:
    """Measure every rung `rounds` times in alternating order; returns {"ladder", "rungs": [...]}.
    also_on: {engine: [preset names]}: those rungs again on another engine (rung "<preset> [<engine>]")."""
    if name == "les":
        rungs = [(p, budget) for p in les_rungs()]
    elif name == "smol":
        rungs = [(p, budget) for p in smol_rungs()]
        quality_tokens = quality_tokens or 192
    elif name == "designs":
        rungs = [(get_preset(n), budget) for n in ("on_demand", "shuffled", "history", "les", "smol", "oracle")]
        rungs.append((get_preset("resident"), "all"))
    elif name == "cache":
        with Session(model, "les", budget="all") as s:
            rungs = cache_rungs(s.spec.top_k, s.item_bytes, len(s.spec.moe_layers))
    else:
        raise WorkbenchError(f"ladder {name!r}: choose les, smol, cache or designs (edge0 has its own verb)")
    rungs = [(p, b, None) for p, b in rungs] + [(p, b, engine) for engine, names in (also_on or {}).items()
                                                 for p, b in rungs if p.name in names]
    results = {i: [] for i in range(len(rungs))}
    for r in range(rounds):
        for i, (preset, b, engine) in enumerate(rungs):
            with open_session(model, preset, budget=b, prompt=prompt, tokens=tokens,
                              **({"engine": engine} if engine else {})) as s:
                results[i].append(measure(s, prompt, tokens))
                if progress:
                    progress(f"round {r + 1}/{rounds} {preset.name} [{s.engine.name}]: {results[i][-1]['tok_s']:.1f} tok/s")
                if r == rounds - 1 and quality_tokens:
                    ids = heldout_ids(s.tokenizer, "tinystories", quality_tokens)
                    s.reset_telemetry()
                    nll = decode_nll(s, ids)
                    results[i][-1]["heldout_ppl"] = float(np.exp(nll.mean()))
                    results[i][-1]["heldout_miss_rate"] = 1.0 - s.summary()["hit_rate"]
                if r == rounds - 1:
                    results[i][-1]["_config"] = s.config()
    rows = []
    for i, (preset, b, engine) in enumerate(rungs):
        runs = results[i]
        tps = [x["tok_s"] for x in runs]
        med = sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2]
        row = {k: v for k, v in med.items() if not k.startswith("_")}
        row.update(rung=preset.name + (f" [{engine}]" if engine else ""), budget=b, tok_s=statistics.median(tps), tok_s_min=min(tps), tok_s_max=max(tps),
                   tok_s_rounds=tps, heldout_ppl=runs[-1].get("heldout_ppl"),
                   heldout_miss_rate=runs[-1].get("heldout_miss_rate"))
        cfg = {**runs[-1]["_config"], "ladder": name, "rung": preset.name, "rung_index": i, "rounds": rounds,
               "tokens": tokens, "prompt": prompt}
        row["run"] = str(write_run(preset.name, cfg, row, row["per_layer"], []))
        rows.append(row)
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base if base else None
    return {"ladder": name, "model": model, "budget": budget, "rounds": rounds, "rungs": rows}


def table(res: dict) -> str:
    lines = [f"ladder {res['ladder']} on {res['model']} (budget {res['budget']}, {res['rounds']} alternating rounds)",
             f"{'rung':34} {'tok/s':>7} {'min-max':>13} {'x':>5} {'hit':>5} {'recall':>6} {'wait ms/tok':>11} "
             f"{'KB read/tok':>11} {'/floor':>6}"]
    for r in res["rungs"]:
        rec = "" if r.get("prefetch_recall") is None else f"{r['prefetch_recall']:.2f}"
        lines.append(f"{r['rung'][:34]:34} {r['tok_s']:7.1f} {r['tok_s_min']:6.1f}-{r['tok_s_max']:<6.1f} "
                     f"{r['speedup']:5.2f} {r['hit_rate']:5.2f} {rec:>6} {1e3 * r['flash_wait_per_token_s']:11.2f} "
                     f"{r['bytes_read_per_token'] / 1e3:11.1f} {r['achieved_over_floor']:6.2f}"
                     + (f"  ppl {r['heldout_ppl']:.3f}" if r.get("heldout_ppl") else ""))
    return "\n".join(lines)
