"""The quality report: teacher vs each preset on held-out perplexity, KL and top-1 against the teacher,
routing agreement, and lm-eval accuracy on the TinyStories ending and cloze tasks (first --limit items), each
preset paired with the teacher item by item (evals/paired.py: bootstrap interval, flips).

    python -m workbench eval report --model demo --out results/quality.md [--limit 200 --chunks 8 --ctx 512]

Writes results/quality.json and results/quality.md (each atomically: a temporary file, fsync, rename),
and one run record per preset and evaluation (eval "teacher" and "lm") for `eval compare`.
"""
from __future__ import annotations

import time
from pathlib import Path

from evals.common import PRESET_ORDER, open_session, record as write_record, text_ids
from workbench.atomic import atomic_write

DEFAULT_TASKS = ("tinystories_ending", "tinystories_cloze")


def build(model: str = "demo", presets=PRESET_ORDER, budget=None, data: str = "tinystories", n_ctx: int = 512,
          chunks: int = 8, tasks=DEFAULT_TASKS, limit: int | None = None, record: bool = True, progress: bool = True,
          engine: str = "numpy", direct: bool = True, log=print) -> dict:
    from evals.lm import evaluate, local_task_names, primary, require_lm_eval, task_manager
    require_lm_eval()
    from evals.lm_eval_adapter import WorkbenchLM
    from evals.paired import paired
    from evals.ppl import tokens_needed
    from evals.teacher import TeacherTrace, compare
    from workbench.runs import environment
    t0 = time.time()
    tasks = local_task_names(tasks)
    presets = sorted(presets, key=lambda p: p != "teacher")       # the teacher first: the others pair with it
    with open_session(model, "teacher", None, engine, direct) as t:
        need = tokens_needed(n_ctx, chunks, None)
        ids = text_ids(t.tokenizer, data, need)[:need]
        log(f"teacher: {chunks} chunks of {n_ctx} tokens of {data}")
        trace = TeacherTrace(t, ids, n_ctx, chunks, None, progress, data)
        teacher_pack = t.pack.content_id()
        spec = t.spec.to_dict()
    tm = task_manager()
    rows, items = [], {}             # items[(preset, task)]: per-item scores (kept in the lm run records, not here)
    for preset in presets:
        log(f"{preset}: teacher comparison and lm-eval ({', '.join(tasks)}, limit {limit})")
        with open_session(model, preset, budget if preset != "teacher" else None, engine, direct) as s:
            cmp = compare(s, trace, progress)
            cmp.update(model=model, preset=s.preset.name, budget=s.budget_text, data=data, teacher_pack=teacher_pack)
            layers = [{"layer": L, "routing_agreement": a, "routing_exact": x}
                      for L, a, x in zip(cmp["routing_layers"], cmp["routing_agreement"], cmp["routing_exact"])]
            run_t = write_record("teacher", s, {"data": data, "ctx": n_ctx, "chunks": chunks, "stride": None}, cmp,
                                 layers, enabled=record)
            lm = WorkbenchLM(session=s, model=model, progress=progress)
            acc = evaluate(lm, tasks, limit, None, tm, per_item=True)
            lm_out = {"model": model, "preset": s.preset.name, "budget": s.budget_text, "tasks": tasks, "limit": limit,
                      "num_fewshot": None, "results": acc}
            run_l = write_record("lm", s, {"tasks": tasks, "limit": limit, "num_fewshot": None}, lm_out, enabled=record)
            row = {"preset": s.preset.name, "budget": s.budget_text, "description": s.preset.description,
                   "experts": s.preset.experts, "rest": s.preset.rest, "routing": s.preset.routing,
                   "ppl": cmp["ppl"], "ppl_stderr": cmp["ppl_stderr"], "ppl_ratio": cmp["ppl_ratio"],
                   "kl": cmp["kl"], "kl_stderr": cmp["kl_stderr"], "top1": cmp["top1"], "top1_stderr": cmp["top1_stderr"],
                   "routing_agreement": cmp["routing_agreement"], "routing_agreement_mean": cmp["routing_agreement_mean"],
                   "tasks": {}, "runs": [r for r in (run_t, run_l) if r]}
            for task in tasks:
                m = acc.get(task, {})
                name, v, se = primary({f"{k},none": x for k, x in m.items()})
                cell = {"metric": name, "value": v, "stderr": se, "samples": m.get("samples"),
                        "acc_norm": m.get("acc_norm"), "acc_mutual_info": m.get("acc_mutual_info")}
                items[(s.preset.name, task)] = m.get("items") or {}
                gold = items.get(("teacher", task))
                if gold and s.preset.name != "teacher":          # the same items in the same order: pair them
                    mine = items[(s.preset.name, task)]
                    assert mine["doc_id"] == gold["doc_id"], task
                    cell["paired"] = paired(gold[name], mine[name])
                    cell["paired_ll"] = paired(gold["ll"], mine["ll"])
                row["tasks"][task.removesuffix("_local")] = cell
            rows.append(row)
    env = environment()
    import math

    import numpy as np
    t_nll = np.concatenate([it[0] for it in trace.items])
    return {"model": model, "teacher_pack": teacher_pack, "spec": spec, "data": data, "ctx": n_ctx, "chunks": chunks,
            "tokens": int(t_nll.size), "ppl_teacher": math.exp(float(t_nll.mean())),
            "tasks": [t.removesuffix("_local") for t in tasks], "limit": limit, "rows": rows,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": time.time() - t0,
            "git_commit": env.get("git_commit"), "packages": env.get("packages")}


def markdown(rep: dict) -> str:
    from evals.paired import mark
    tasks = rep["tasks"]
    metric = lambda t: next((r["tasks"][t]["metric"] for r in rep["rows"] if r["tasks"].get(t, {}).get("metric")), "")
    lines = [f"# Quality: {rep['model']} — teacher vs presets", "",
             f"Model pack `{rep['teacher_pack']}` (teacher), {rep['created']}, commit `{(rep.get('git_commit') or '')[:10]}`.",
             f"Held-out perplexity, KL(teacher‖preset) and top-1 agreement: {rep['data']}, {rep['chunks']} chunks of "
             f"{rep['ctx']} tokens, second half of each scored (llama.cpp's method), {rep['tokens']} tokens. "
             f"lm-eval (0-shot, local data): {'the first %d' % rep['limit'] if rep['limit'] is not None else 'all'} items "
             "of each task; "
             + ", ".join(f"{t} {metric(t)}" for t in tasks) + " (the other metrics in the JSON).", "",
             "| preset | experts/rest | budget | ppl ± se | ppl vs teacher | KL ± se | top-1 | routing | "
             + " | ".join(tasks) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(tasks)]
    if rep.get("note"):
        lines[4:4] = ["", rep["note"]]
    for r in rep["rows"]:
        cells = [f"`{r['preset']}`", f"{r['experts']}/{r['rest']}", r["budget"],
                 f"{r['ppl']:.3f} ± {r['ppl_stderr']:.3f}", f"{r['ppl_ratio'] - 1:+.2%}",
                 f"{r['kl']:.5f} ± {r['kl_stderr']:.5f}", f"{r['top1']:.3f}", f"{r['routing_agreement_mean']:.3f}"]
        for t in tasks:
            m = r["tasks"].get(t, {})
            v, se = m.get("value"), m.get("stderr")
            cells.append("-" if v is None else f"{v:.3f}{' ± %.3f' % se if se is not None else ''}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Routing: mean over MoE layers of |top-k(teacher) ∩ top-k(preset)| / k per token (per layer in the JSON). "
              "The ± are lm-eval's standard errors of each score alone; whether a preset differs from the teacher is "
              "the paired table's question.", ""]
    paired_rows = [r for r in rep["rows"] if any("paired" in m for m in r["tasks"].values())]
    if paired_rows:
        lines += ["## Paired against the teacher", "",
                  "The same items, preset minus teacher: the mean difference with its 95% bootstrap interval (10,000 "
                  "resamples of the items; `*` when it excludes 0 and, for right/wrong scores, the exact sign test on "
                  "the flips agrees, p < 0.05), then the flips `a/b`: a items the teacher got right and the preset wrong, "
                  "b the reverse. `Δ log p` is the mean change of the gold answer's log-likelihood "
                  "(nats), a finer measure on the same items.", "",
                  "| preset | " + " | ".join(f"{t} Δ{metric(t)} [95% CI] flips | {t} Δ log p [95% CI]" for t in tasks)
                  + " |", "|---|" + "---|---|" * len(tasks)]
        needed = []
        for r in paired_rows:
            cells = [f"`{r['preset']}`"]
            for t in tasks:
                m = r["tasks"].get(t, {})
                cells += [mark(m.get("paired")), mark(m.get("paired_ll"))]
                p = m.get("paired")
                if p and not p["significant"]:
                    n = p["items_needed"]
                    needed.append(f"`{r['preset']}` on {t}: " + (f"about {n:,} items (have {p['n']})" if n else
                                  f"no difference at all on these {p['n']} items"))
            lines.append("| " + " | ".join(cells) + " |")
        if needed:
            lines += ["", f"Not significant in {metric(tasks[0]) if len(tasks) == 1 else 'accuracy'}; the items a 95% "
                      "interval would need to exclude 0 if the per-item differences kept their mean and spread: "
                      + "; ".join(needed) + "."]
        lines.append("")
    for r in rep["rows"]:
        lines.append(f"- `{r['preset']}`: {r['description']}")
    return "\n".join(lines) + "\n"


def write(rep: dict, out: Path) -> tuple[Path, Path]:
    import json
    out = Path(out)
    js = out.with_suffix(".json")
    atomic_write(js, json.dumps(rep, indent=1, default=str) + "\n")
    atomic_write(out, markdown(rep))
    return out, js
