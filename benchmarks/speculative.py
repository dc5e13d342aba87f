"""Drafts while streaming: what verifying drafts in one batch buys and what the batch's experts cost.

    python benchmarks/speculative.py --model demo --budgets 0.25 --rounds 3 --out results/speculative.md
    python benchmarks/speculative.py --model demo --budgets 0.25 --rounds 3 --device ufs22-phone \\
        --out results/speculative_ufs22-phone.md

Three parts, each in FILE.md and FILE.json:
1. The draft model's held-out acceptance: on held-out text (teacher-forced), how often its next token is the target's
   greedy one: the chance a draft token is accepted where the context is the text's.
2. Real drafts, measured: les against les verifying drafts (prompt lookup; the draft model at 2 and 4 tokens a step),
   each arm cold, alternating within a round, the median over rounds with min-max. Per arm: acceptance, tokens a
   target step, the batch's union growth (distinct experts a step's batch routes to over its first token's), bytes read
   per produced token and the draft's own time per token (counted in tok/s).
3. Modelled acceptance on real routing (--routing-trace): les against les verifying 4 drafts a step whose acceptance is
   modelled (runtime.speculative.ModelledAcceptance, swept), the verification batch routing as the trace's next rows:
   measured here, and simulated (experiments.simulate) on this machine and on the device profile, with the acceptance
   above which drafts pay at each budget. Every such number says "modelled acceptance".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench import bench  # noqa: E402
from experiments.compute_profile import measure_compute  # noqa: E402
from experiments.simulate import run as simulate  # noqa: E402
from runtime.session import open_session  # noqa: E402
from runtime.speculative import ReplayedAcceptance  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.presets import get_preset  # noqa: E402
from workbench.registry import resolve_pack, storage_for  # noqa: E402
from workbench.store.pack import Pack  # noqa: E402
from workbench.textdata import heldout_ids  # noqa: E402

ARMS = {                                     # arm -> knobs on les
    "les": {},
    "les + prompt lookup, 4 a step": {"speculative": 4, "draft": "lookup"},
    "les + draft model, 2 a step": {"speculative": 2, "draft": "demo-draft"},
    "les + draft model, 4 a step": {"speculative": 4, "draft": "demo-draft"},
    "les + MTP head, 2 a step": {"speculative": 2, "draft": "mtp"},
    "les + MTP head, 4 a step": {"speculative": 4, "draft": "mtp"},
}
ACCEPTANCE = (0.3, 0.5, 0.7, 0.9)            # modelled, swept
N_DRAFT = 4


def heldout_agreement(target: str, draft: str, n_tokens: int = 1024, data: str = "tinystories") -> dict:
    """Per position of held-out text (teacher-forced): the draft's argmax equals the target's (its pack, all
    resident), and the chance that k drafted tokens in a row all are (from the positions' own runs)."""
    argmax = {}
    for name in (target, draft):
        with open_session(name, "resident", None, prompt=None) as s:
            ids = heldout_ids(s.tokenizer, data, min(n_tokens, s.spec.max_position_embeddings))
            argmax[name] = np.argmax(s.step(ids, "prefill"), -1)
    same = argmax[target] == argmax[draft]
    runs = {str(k): float(np.mean([same[i:i + k].all() for i in range(len(same) - k + 1)])) for k in (1, 2, 4)}
    return {"tokens": len(same), "data": data, "agreement": float(same.mean()), "all_of_k": runs}


def mtp_heldout_agreement(target: str, n_tokens: int = 1024, data: str = "tinystories") -> dict:
    """Per position t of held-out text (teacher-forced): the MTP head's token from (the target's hidden state at t,
    token t+1) equals the target's greedy token after t+1: the chance its first draft is accepted there."""
    from runtime.speculative import MTPDraft
    with open_session(target, "resident", None, prompt=None) as s:
        ids = heldout_ids(s.tokenizer, data, min(n_tokens, s.spec.max_position_embeddings))
        greedy = np.argmax(s.step(ids, "prefill"), -1)
        head = MTPDraft(s).head
        _, logits = head.forward(s.engine.to_numpy(s.engine.hidden)[:-1], ids[1:], 1)
    same = np.argmax(logits, -1) == greedy[1:]
    return {"tokens": int(same.size), "data": data, "agreement": float(same.mean())}


def speed(model, arms, budgets, rounds, tokens, device, log, trace=None, threads=None) -> dict:
    """{(arm, budget): [bench results, a round each]}, arms alternating within each round, every run cold, after one
    run that is not counted (the process's first pays for loading what every later one finds loaded)."""
    bench(model, "les", budgets[0], tokens=8, device=device, record=False, routing_trace=trace, threads=threads)
    out = {(a, b): [] for a in arms for b in budgets}
    for r in range(rounds):
        for b in budgets:
            for a in arms:
                res = bench(model, "les", b, tokens=tokens, device=device, record=False, routing_trace=trace,
                            threads=threads, **arms[a])
                out[(a, b)].append(res)
                log(f"round {r + 1} {a} @{b}: {res['tok_s']:.1f} tok/s, {res['bytes_read_per_token'] / 1e3:.0f} KB/token")
    return out


def row(arm, budget, runs, ref) -> dict:
    tok = [r["tok_s"] for r in runs]
    med = lambda k: statistics.median(r[k] for r in runs) if all(r.get(k) is not None for r in runs) else None
    return {"arm": arm, "budget": budget, "tok_s": statistics.median(tok), "tok_s_min": min(tok), "tok_s_max": max(tok),
            "tok_s_rounds": tok, "over_les": statistics.median(tok) / ref if ref else None,
            "bytes_read_per_token": med("bytes_read_per_token"), "spec_accept_rate": med("spec_accept_rate"),
            "tokens_per_target_step": med("tokens_per_target_step"), "union_growth": med("union_growth"),
            "draft_ms_per_token": statistics.median(1e3 * r["draft_s"] / max(1, r["produced"]) for r in runs),
            "modelled_acceptance": runs[0].get("modelled_acceptance"), "hit_rate": med("hit_rate"),
            "random_weights": runs[0].get("random_weights")}


def rows_of(runs: dict, arms, budgets) -> list[dict]:
    out = []
    for b in budgets:
        ref = statistics.median(r["tok_s"] for r in runs[("les", b)])
        out += [row(a, b, runs[(a, b)], ref) for a in arms]
    return out


def crossover(points: list[tuple[float, float]], ref: float) -> str:
    """The acceptance above which the arm's tok/s passes `ref`, interpolated between the swept points."""
    pts = sorted(points)
    if pts[0][1] >= ref:
        return f"<= {pts[0][0]:g} (every swept acceptance pays)"
    for (a0, t0), (a1, t1) in zip(pts, pts[1:]):
        if t0 < ref <= t1:
            return f"{a0 + (ref - t0) / (t1 - t0) * (a1 - a0):.2f}"
    return f"> {pts[-1][0]:g} (no swept acceptance pays)"


def compute_profile(model, tokens):
    """One profile for every simulated arm, measured on the model's own routing: a trace-driven measurement leaves
    out what each further row of a batch costs (row_s), which a verification step is made of."""
    les = get_preset("les")
    pack = Pack(resolve_pack(model, *storage_for(model, les.storage, (), None)))
    return measure_compute(model, pack.spec, les.storage.experts, preset=les, tokens=tokens)


def chain_acceptance(accepted_per_step: float, n: int) -> float:
    """The per-token acceptance p of runtime.speculative.ModelledAcceptance (each of n drafts accepted with p while
    the ones before it were) whose expected accepted drafts a step, p + p^2 + ... + p^n, is the measured mean."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, n + 1)) < accepted_per_step else (lo, mid)
    return max(lo, 1e-3)


def predicted(rows, runs, arms, trace, tokens, cp, wheres, model) -> None:
    """The simulator's prediction of each real draft's run (rows' `predicted`: tok/s on each of `wheres`, the median
    over the measured rounds, and x les on each): the trace's routing; a draft model's or MTP head's drafts accepted
    as each measured round accepted them, step by step (runtime.speculative.ReplayedAcceptance; the chain acceptance
    of the same mean, `predicted_acceptance`, is the run's label), prompt lookup's drafts those of the trace's own
    text; each draft's measured time a proposed token charged on the compute thread."""
    les = get_preset("les")
    for r in rows:
        knobs = arms[r["arm"]]
        got = runs[(r["arm"], r["budget"])]
        preset, c = les, cp
        if knobs:
            c = dataclasses.replace(cp, draft_s=sum(x["draft_s"] for x in got) / max(1, sum(x["spec_proposed"]
                                                                                         for x in got)))
            preset = les.with_(**knobs)             # prompt lookup: the trace's own text's lookup drafts, replayed
        if knobs and knobs["draft"] != "lookup":
            n, steps = knobs["speculative"], sum(x["spec_steps"] for x in got)
            r["predicted_acceptance"] = p = chain_acceptance(sum(x["spec_accepted"] for x in got) / max(1, steps), n)
            preset = les.with_(speculative=n, draft=f"modelled:{p:.4f}")
        replays = [ReplayedAcceptance(x["spec_accepted_by_step"]) for x in got] \
            if knobs and knobs["draft"] != "lookup" else [None]
        r["predicted"] = {w: statistics.median(simulate(trace, preset, r["budget"], w, tokens=tokens, model=model,
                                                        compute=c, record=False, acceptance=a)["tok_s"]
                                               for a in replays) for w in wheres}
    for r in rows:
        ref = next(x for x in rows if x["budget"] == r["budget"] and not arms[x["arm"]])["predicted"]
        r["predicted_over_les"] = {w: r["predicted"][w] / ref[w] for w in ref}


def modelled(model, trace, budgets, rounds, tokens, device, profile, log, cp, acceptance=ACCEPTANCE,
             threads=None) -> dict:
    """Part 3: measured arms (this machine, or the emulated device) and the simulator's prediction of each."""
    arms = {"les": {}} | {f"les + 4 drafts, modelled acceptance {a:g}": {"speculative": N_DRAFT,
                                                                         "draft": f"modelled:{a:g}"}
                          for a in acceptance}
    rows = rows_of(speed(model, arms, budgets, rounds, tokens, device, log, trace, threads), arms, budgets)
    les = get_preset("les")
    sims = {}
    for b in budgets:
        for where in ("this-machine", profile):
            for a, knobs in arms.items():
                s = simulate(trace, les.with_(**knobs) if knobs else les, b, where, tokens=tokens, model=model,
                             compute=cp, record=False)
                sims[(a, b, where)] = s["tok_s"]
    for r in rows:
        r["simulated"] = {w: sims[(r["arm"], r["budget"], w)] for w in ("this-machine", profile)}
    cross = {}
    for b in budgets:
        by = [r for r in rows if r["budget"] == b and r["modelled_acceptance"] is not None]
        les = next(r for r in rows if r["budget"] == b and r["arm"] == "les")
        cross[b] = {"measured": crossover([(r["modelled_acceptance"], r["tok_s"]) for r in by], les["tok_s"]),
                    **{w: crossover([(r["modelled_acceptance"], r["simulated"][w]) for r in by], les["simulated"][w])
                       for w in ("this-machine", profile)}}
    return {"rows": rows, "crossover": cross, "profile": profile, "compute_profile": cp.__dict__}


def markdown(res: dict) -> str:
    where = f", EMULATED {res['device']} (this machine's reads made to take that device's time)" if res["device"] else ""
    md = [f"# Drafts while streaming\n\n`{res['command']}` ({res['date']})\n"]
    if h := res.get("heldout"):
        md += ["## The draft model's held-out acceptance\n",
               f"{res['draft']} against {res['model']} on {h['tokens']} held-out {h['data']} tokens, teacher-forced: "
               f"its next token is the target's greedy one at {h['agreement']:.3f} of positions; 2 in a row "
               f"{h['all_of_k']['2']:.3f}, 4 in a row {h['all_of_k']['4']:.3f}.\n"]
    if h := res.get("heldout_mtp"):
        md += [f"The MTP head ({res['model']}'s own, mtp/mtp.safetensors) on {h['tokens']} held-out {h['data']} positions, "
               f"teacher-forced: its token from the target's hidden state at t and token t+1 is the target's greedy "
               f"token after t+1 at {h['agreement']:.3f} of positions (its first draft's acceptance there).\n"]
    md += [] if not res["rows"] else ["## Real drafts, measured\n",
           f"{res['model']}, {res['engine'] or 'the default engine'}{where}; {res['rounds']} alternating cold rounds of "
           f"{res['tokens']} tokens (median, min-max). Greedy output is plain greedy decoding's in every arm "
           f"(tests/test_drafts.py). KB read per produced token; the draft's time is in tok/s.\n",
           "| arm | budget | tok/s | min-max | x les | accepted | tokens/step | experts a step (x one token's) | "
           "KB read/token | draft ms/token |" + (f" predicted x les here | predicted x les {res['profile']} |"
                                                 if "profile" in res else ""),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if "profile" in res else "")]
    f = lambda x, fmt: "" if x is None else format(x, fmt)
    for r in res["rows"]:
        md.append(f"| {r['arm']} | {r['budget']} | {r['tok_s']:.1f} | {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} | "
                  f"{r['over_les']:.2f} | {f(r['spec_accept_rate'], '.2f')} | {f(r['tokens_per_target_step'], '.2f')} | "
                  f"{f(r['union_growth'], '.2f')} | {r['bytes_read_per_token'] / 1e3:.0f} | "
                  f"{r['draft_ms_per_token']:.2f} |" + (f" {r['predicted_over_les']['this-machine']:.2f} | "
                                                         f"{r['predicted_over_les'][res['profile']]:.2f} |"
                                                         if "predicted_over_les" in r else ""))
    if res["rows"] and "profile" in res:
        measured = f"measured (EMULATED {res['device']})" if res["device"] else "measured here"
        on = res["device"] or "this-machine"
        md += ["", f"Predicted: experiments.simulate on the routing trace, a draft model's or MTP head's drafts "
               f"accepted as each measured round accepted them, step by step (the median over the rounds), prompt "
               f"lookup as the lookup drafts of the trace's own text, each with its measured draft time a proposed "
               f"token (x les: over les simulated alike). {measured} against predicted on {on}, x les:", ""]
        md += [f"- {r['arm']} @{r['budget']}: {r['over_les']:.2f} measured, {r['predicted_over_les'][on]:.2f} "
               f"predicted ({100 * (r['predicted_over_les'][on] / r['over_les'] - 1):+.0f}%)"
               for r in res["rows"] if r["arm"] != "les"]
    if m := res.get("modelled"):
        prof = m["profile"]
        md += ["", "## Modelled acceptance on real routing (MODELLED ACCEPTANCE: no draft runs)\n",
               *([f"{res['model']}: RANDOM weights ({m['rows'][0]['random_weights']}): only its shape and disk are "
                  f"the model's; what it routes to is the trace's.\n"] if m["rows"][0].get("random_weights") else []),
               f"Routing trace `{res['routing_trace']}`: each verification step of {N_DRAFT} drafts routes as the "
               f"trace's next rows (the union the batch reads is real routing's); each draft token is accepted with "
               f"the stated probability while the ones before it were (seeded: every arm draws the same). Measured "
               f"here{where}, and simulated (experiments.simulate, this machine's compute profile) on this machine and "
               f"on {prof}.\n",
               f"| arm | budget | tok/s measured{' (emulated)' if res['device'] else ''} | min-max | x les | tokens/step | experts a step (x one token's) | "
               f"KB read/token | simulated here | simulated {prof} |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in m["rows"]:
            md.append(f"| {r['arm']} | {r['budget']} | {r['tok_s']:.1f} | {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} | "
                      f"{r['over_les']:.2f} | {f(r['tokens_per_target_step'], '.2f')} | {f(r['union_growth'], '.2f')} | "
                      f"{r['bytes_read_per_token'] / 1e3:.0f} | {r['simulated']['this-machine']:.1f} | "
                      f"{r['simulated'][prof]:.1f} |")
        md += ["", "The modelled acceptance above which 4 drafts a step beat les (interpolated between the swept "
               "points):", ""]
        measured = f"measured (EMULATED {res['device']})" if res["device"] else "measured here"
        md += [f"- {b}: {measured} {c['measured']}; simulated here {c['this-machine']}; simulated on {prof} "
               f"{c[prof]}" for b, c in m["crossover"].items()]
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="demo-draft")
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--device", default=None, help="a device profile whose flash the reads emulate")
    ap.add_argument("--routing-trace", default=None, metavar="T", help="part 3: modelled acceptance on this trace")
    ap.add_argument("--profile", default="ufs22-phone", help="part 3: the device profile simulated beside this machine")
    ap.add_argument("--threads", type=int, default=None, help="the engine's threads (default: its own)")
    ap.add_argument("--acceptance", default=",".join(map(str, ACCEPTANCE)), help="part 3: the modelled acceptances")
    ap.add_argument("--skip-real", action="store_true", help="part 3 only (a made checkpoint: no draft model)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speculative.md")
    a = ap.parse_args(argv)
    budgets = a.budgets.split(",")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    command = "python benchmarks/speculative.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"command": command, "model": a.model, "draft": a.draft, "engine": None, "device": a.device,
           "rounds": a.rounds, "tokens": a.tokens, "budgets": budgets, "routing_trace": a.routing_trace,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    cp = compute_profile(a.model, a.tokens) if a.routing_trace else None
    if not a.skip_real:
        arms = {k: {**v, **({"draft": a.draft} if v.get("draft") == "demo-draft" else {})} for k, v in ARMS.items()}
        res["heldout"] = heldout_agreement(a.model, a.draft)
        res["heldout_mtp"] = mtp_heldout_agreement(a.model)
        log(f"held-out agreement: {res['heldout']}, MTP head's {res['heldout_mtp']}")
        runs = speed(a.model, arms, budgets, a.rounds, a.tokens, a.device, log, threads=a.threads)
        res["rows"] = rows_of(runs, arms, budgets)
        if a.routing_trace:
            wheres = dict.fromkeys(["this-machine", a.profile] + ([a.device] if a.device else []))
            predicted(res["rows"], runs, arms, a.routing_trace, a.tokens, cp, list(wheres), a.model)
    if a.routing_trace:
        res["profile"] = a.profile
        res["modelled"] = modelled(a.model, a.routing_trace, budgets, a.rounds, a.tokens, a.device, a.profile, log, cp,
                                   [float(x) for x in a.acceptance.split(",")], a.threads)
    atomic_write(a.out.with_suffix(".json"), json.dumps(res, indent=1, default=str) + "\n")
    atomic_write(a.out, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
