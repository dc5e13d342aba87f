"""Ladders: ordered rungs, each adding one knob, measured in one run with alternating arms.

    python -m workbench ladder les   --model demo --budget 0.25 --json
    python -m workbench ladder smol  --model demo --budget 0.25 --json
    python -m workbench ladder cache --model demo --json
    python -m workbench ladder designs --model demo --json    (every design side by side at one budget)
    python -m workbench ladder budgets --model demo --json    (on_demand, les, smol at budgets 0.05-0.5)

Rounds run every rung once in order (A B C ... A B C ...), each arm a fresh `bench` (a new Session, a
warm-up on other text, then the measured tokens from a cold start). The rungs
are one timing group of a sweep (experiments.sweep) on a local Ray. Reported per rung: the median tok/s
with min-max over rounds, and the other fields from the median round's bench record.
"""
from __future__ import annotations

import json
from pathlib import Path

import engines
from engines import DEFAULT
from workbench.presets import get_preset, with_each
from workbench.registry import resolve_pack, storage_for
from workbench.store.pack import Pack
from runtime.session import trace_cannot_drive
from workbench.errors import WorkbenchError

BIAS_SWEEP = (0.005, 0.02, 0.05, 0.1, 0.25)
BUDGETS = ("0.05", "0.1", "0.25", "0.5")


def les_rungs(draft: str = "lookup"):
    """LES's ladder; its last rung verifies 4 drafts a step from `draft` (runtime.speculative: lookup, a draft model,
    or on a routing trace modelled:A)."""
    base = get_preset("on_demand").with_(name="on_demand")
    look = base.with_(name="+lookahead", predictor="lookahead:1:k")
    sched = look.with_(name="+ready_first & contiguous", execution="ready_first", layout="contiguous")
    mixed = sched.with_(name="+mixed precision (q3/q4)", experts="q3", rest="q4")
    spec = mixed.with_(name="+speculative verification", speculative=4, draft=draft)
    return [base, look, sched, mixed, spec]


def smol_rungs():
    exact = get_preset("smol").with_(name="pager (exact, no prefetch)", predictor=None)
    pre = exact.with_(name="+prefetch 2 ahead", predictor="lookahead:2:k")
    return [exact, pre] + [pre.with_(name=f"+bias {b}", routing=f"cache_bias:{b}") for b in BIAS_SWEEP]


def top_k_and_slot_bytes(model: str, preset: str) -> tuple[int, int]:
    """(top-k, bytes a Session of the preset counts per expert) of the model's pack: the pack's numbers only, no
    session, no experts loaded."""
    st = get_preset(preset).storage
    pack = Pack(resolve_pack(model, *storage_for(model, st)))
    return pack.spec.top_k, engines.slot_bytes(None, pack)


def cache_rungs(spec_top_k: int, slot_bytes: int, preset: str = "les"):
    """Window sweep: c extra slots beyond one layer's top-k (c=0 releases after use), up to all-resident."""
    p = get_preset(preset)
    out = []
    for c in (0, spec_top_k, 4 * spec_top_k, 16 * spec_top_k):
        out.append((p.with_(name=f"window c={c}"), str((spec_top_k + c) * slot_bytes)))
    for frac in ("0.25", "0.5", "all"):
        out.append((p.with_(name=f"budget {frac}"), frac))
    return out


def run_ladder(name: str, model: str = "demo", budget: str = "0.25", tokens: int = 48, rounds: int = 3,
               prompt: str = "Once upon a time", quality_tokens: int = 0, progress=None, device: str | None = None,
               engine: str = DEFAULT, also_on: dict | None = None, routing_trace: str | None = None,
               knobs: dict | None = None, designs: list | None = None) -> dict:
    """Measure every rung `rounds` times in alternating order; returns {"ladder", "rungs": [...]}. device: a
    device profile whose flash every rung's reads emulate (workbench.devices).
    also_on: {engine: [preset names]}: those rungs again on another engine (rung "<preset> [<engine>]").
    routing_trace: every rung routes and predicts as this trace recorded (experiments/routing_trace.py).
    knobs: preset knobs set on every rung (`--set`, as bench takes them). designs: further rungs of the designs and
    budgets ladders, designs of your own by reference (workbench.designs).

    The rungs are the arms of one timing group of a sweep (experiments.sweep, on a local Ray): one task, holding
    the machine's CPUs, runs them round by round, and one run record per rung comes back."""
    from experiments.grid import AXES, Cell, Grid
    from experiments.sweep import run_grid
    if name == "les":                   # the demo's drafts come from its draft model, shipped beside it
        rungs = [(p, budget) for p in les_rungs("demo-draft" if model == "demo" else "lookup")]
    elif name == "smol":
        rungs = [(p, budget) for p in smol_rungs()]
        quality_tokens = quality_tokens or 192
    elif name == "designs":
        rungs = [(get_preset(n), budget) for n in ("on_demand", "les_no_prefetch", "shuffled", "history", "les", "smol",
                                                     "oracle")]
        rungs += [(get_preset(d), budget) for d in designs or ()]
        rungs.append((get_preset("resident"), "all"))
        # DESIGN.md's on-demand control keeps no cache: one layer's top-k slots, each released after use (c=0)
        k, item = top_k_and_slot_bytes(model, "on_demand")
        rungs.append((get_preset("on_demand").with_(name="on_demand c=0"), str(k * item)))
    elif name == "cache":
        rungs = cache_rungs(*top_k_and_slot_bytes(model, "les"))
    elif name == "budgets":             # does prediction pay at every budget? each design against on_demand
        spec = Pack(resolve_pack(model, *storage_for(model, get_preset("smol").storage))).spec
        pager_fits = lambda b: int(float(b) * spec.num_experts) >= spec.top_k      # a layer's pool holds its top-k
        rungs = [(p.with_(name=f"{p.name} @{b}"), b) for b in BUDGETS
                 for p in map(get_preset, ("on_demand", "les", "smol", *(designs or ())))
                 if p.name != "smol" or pager_fits(b)]
    else:
        raise WorkbenchError(f"ladder {name!r}: choose les, smol, cache, designs or budgets (edge0 has its own verb)")
    if designs and name not in ("designs", "budgets"):
        raise WorkbenchError(f"ladder {name}: --design adds rungs to the designs and budgets ladders only")
    rungs = list(zip(with_each([p for p, _ in rungs], knobs), [b for _, b in rungs])) if knobs else rungs
    why = {p.name: trace_cannot_drive(p) for p, _ in rungs} if routing_trace else {}
    not_run = [{"rung": n, "why": w} for n, w in why.items() if w]
    rungs = [(p, b) for p, b in rungs if not why.get(p.name)]
    base = {"les": "on_demand", "smol": "smol", "cache": "les"}.get(name)
    variant_of = {"on_demand c=0": "on_demand"}         # a designs rung that is not a preset of its own
    rungs = [(p, b, engine) for p, b in rungs] + [(p, b, e) for e, names in (also_on or {}).items()
                                                   for p, b in rungs if p.name in names]
    rung_name = {i: preset.name + (f" [{e}]" if e != engine else "") for i, (preset, _, e) in enumerate(rungs)}
    cells, labels = [], {}
    for i, (preset, b, e) in enumerate(rungs):
        of = base or variant_of.get(preset.name, preset.name.split(" @")[0])
        c = Cell.of("bench", model, preset, of, budget=b, engine=e,
                    tokens=tokens, rounds=rounds, prompt=prompt, heldout_tokens=quality_tokens,
                    routing_trace=routing_trace or "", **({"device": device} if device else {}))
        cells.append(c)
        labels[c.id] = {"ladder": name, "rung": rung_name[i], "rung_index": i, "rounds": rounds, "tokens": tokens,
                        "prompt": prompt}
    res = run_grid(Grid(f"ladder_{name}", cells, arms=AXES, labels=labels), resume=False, progress=bool(progress))
    rows = []
    for i, ((preset, b, _), r) in enumerate(zip(rungs, res["rows"])):
        if r["status"] != "ok":
            raise WorkbenchError(f"ladder {name}, rung {rung_name[i]!r}: {r['error']}")
        row = json.loads((Path(r["run"]) / "summary.json").read_text())
        row.update(rung=rung_name[i], budget=b, heldout_ppl=row.get("heldout_ppl"),
                   heldout_miss_rate=row.get("heldout_miss_rate"), run=r["run"])
        rows.append(row)
    base = rows[0]["tok_s"]
    for row in rows:
        row["speedup"] = row["tok_s"] / base if base else None
    return {"ladder": name, "model": model, "budget": budget, "rounds": rounds, "rungs": rows, "device": device,
            "emulated": bool(device), "routing_trace": routing_trace, "not_run": not_run}


def table(res: dict) -> str:
    dev = f", EMULATED {res['device']}" if res.get("device") else ""
    lines = [f"ladder {res['ladder']} on {res['model']} (budget {res['budget']}, {res['rounds']} alternating rounds{dev})",
             f"{'rung':34} {'tok/s':>7} {'min-max':>13} {'x':>5} {'hit':>5} {'recall':>6} {'wait ms/tok':>11} "
             f"{'KB read/tok':>11} {'/floor':>6}"]
    for r in res["rungs"]:
        rec = "" if r.get("prefetch_recall") is None else f"{r['prefetch_recall']:.2f}"
        lines.append(f"{r['rung'][:34]:34} {r['tok_s']:7.1f} {r['tok_s_min']:6.1f}-{r['tok_s_max']:<6.1f} "
                     f"{r['speedup']:5.2f} {r['hit_rate']:5.2f} {rec:>6} {1e3 * r['flash_wait_per_token_s']:11.2f} "
                     f"{r['bytes_read_per_token'] / 1e3:11.1f} {r['achieved_over_floor']:6.2f}"
                     + (f"  ppl {r['heldout_ppl']:.3f}" if r.get("heldout_ppl") else ""))
    lines += [f"{r['rung'][:34]:34} not run: the routing trace {r['why']}" for r in res.get("not_run", [])]
    return "\n".join(lines)
