"""The quality report: teacher vs each preset on held-out perplexity, KL and top-1 against the teacher,
routing agreement, and lm-eval accuracy on lambada_openai, arc_easy and piqa (first --limit items).

    python -m workbench eval report --model demo --out results/quality.md [--limit 50 --chunks 8 --ctx 512]

Writes results/quality.json and results/quality.md (each atomically: a temporary file, fsync, rename),
and one run record per preset and evaluation (eval "teacher" and "lm") for `eval compare`.
"""
from __future__ import annotations

import time
from pathlib import Path

from evals.common import PRESET_ORDER, open_session, record as write_record, text_ids
from workbench.presets import budget_for, get_preset
from workbench.atomic import atomic_write

DEFAULT_TASKS = ("lambada_openai", "arc_easy", "piqa")


def build(model: str = "demo", presets=PRESET_ORDER, budget=None, data: str = "tinystories", n_ctx: int = 512,
          chunks: int = 8, tasks=DEFAULT_TASKS, limit: int | None = 50, record: bool = True, progress: bool = True,
          engine: str = "numpy", direct: bool = True, log=print) -> dict:
    from evals.lm import evaluate, local_task_names, primary, require_lm_eval, task_manager
    require_lm_eval()
    from evals.lm_eval_adapter import WorkbenchLM
    from evals.ppl import tokens_needed
    from evals.teacher import TeacherTrace, compare
    from workbench.runs import environment
    t0 = time.time()
    tasks = local_task_names(tasks)
    with open_session(model, "teacher", None, engine, direct) as t:
        need = tokens_needed(n_ctx, chunks, None)
        ids = text_ids(t.tokenizer, data, need)[:need]
        log(f"teacher: {chunks} chunks of {n_ctx} tokens of {data}")
        trace = TeacherTrace(t, ids, n_ctx, chunks, None, progress, data)
        teacher_pack = t.pack.content_id()
        spec = t.spec.to_dict()
    tm = task_manager()
    rows = []
    for preset in presets:
        log(f"{preset}: teacher comparison and lm-eval ({', '.join(tasks)}, limit {limit})")
        with open_session(model, preset, budget_for(get_preset(preset), budget), engine, direct) as s:
            cmp = compare(s, trace, progress)
            cmp.update(model=model, preset=s.preset.name, budget=s.budget_text, data=data, teacher_pack=teacher_pack)
            layers = [{"layer": L, "routing_agreement": a, "routing_exact": x}
                      for L, a, x in zip(cmp["routing_layers"], cmp["routing_agreement"], cmp["routing_exact"])]
            run_t = write_record("teacher", s, {"data": data, "ctx": n_ctx, "chunks": chunks, "stride": None}, cmp,
                                 layers, enabled=record)
            lm = WorkbenchLM(session=s, model=model, progress=progress)
            acc = evaluate(lm, tasks, limit, None, tm)
            lm_out = {"model": model, "preset": s.preset.name, "budget": s.budget_text, "tasks": tasks, "limit": limit,
                      "num_fewshot": None, "results": acc}
            run_l = write_record("lm", s, {"tasks": tasks, "limit": limit, "num_fewshot": None}, lm_out, enabled=record)
            row = {"preset": s.preset.name, "budget": s.budget_text, "description": s.preset.description,
                   "experts": s.preset.storage.experts, "rest": s.preset.storage.rest, "routing": str(s.preset.routing),
                   "ppl": cmp["ppl"], "ppl_stderr": cmp["ppl_stderr"], "ppl_ratio": cmp["ppl_ratio"],
                   "kl": cmp["kl"], "kl_stderr": cmp["kl_stderr"], "top1": cmp["top1"], "top1_stderr": cmp["top1_stderr"],
                   "routing_agreement": cmp["routing_agreement"], "routing_agreement_mean": cmp["routing_agreement_mean"],
                   "tasks": {}, "runs": [r for r in (run_t, run_l) if r]}
            for task in tasks:
                m = acc.get(task, {})
                name, v, se = primary({f"{k},none": x for k, x in m.items()})
                row["tasks"][task.removesuffix("_local")] = {"metric": name, "value": v, "stderr": se,
                                                            "samples": m.get("samples"),
                                                            "acc_norm": m.get("acc_norm")}
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
    tasks = rep["tasks"]
    teacher = next((r for r in rep["rows"] if r["preset"] == "teacher"), None)
    lines = [f"# Quality: {rep['model']} — teacher vs presets", "",
             f"Model pack `{rep['teacher_pack']}` (teacher), {rep['created']}, commit `{(rep.get('git_commit') or '')[:10]}`.",
             f"Held-out perplexity, KL(teacher‖preset) and top-1 agreement: {rep['data']}, {rep['chunks']} chunks of "
             f"{rep['ctx']} tokens, second half of each scored (llama.cpp's method), {rep['tokens']} tokens. "
             f"lm-eval (0-shot, local data): first {rep['limit'] if rep['limit'] is not None else 'all'} items of each task; "
             "lambada_openai acc, arc_easy and piqa acc (acc_norm in the JSON).", "",
             "| preset | experts/rest | budget | ppl ± se | ppl vs teacher | KL ± se | top-1 | routing | "
             + " | ".join(tasks) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(tasks)]
    for r in rep["rows"]:
        cells = [f"`{r['preset']}`", f"{r['experts']}/{r['rest']}", r["budget"],
                 f"{r['ppl']:.3f} ± {r['ppl_stderr']:.3f}", f"{r['ppl_ratio'] - 1:+.2%}",
                 f"{r['kl']:.5f} ± {r['kl_stderr']:.5f}", f"{r['top1']:.3f}", f"{r['routing_agreement_mean']:.3f}"]
        for t in tasks:
            m = r["tasks"].get(t, {})
            v, se = m.get("value"), m.get("stderr")
            d = ""
            if teacher is not None and r is not teacher and v is not None:
                tv = teacher["tasks"].get(t, {}).get("value")
                d = f" ({v - tv:+.3f})" if tv is not None else ""
            cells.append("-" if v is None else f"{v:.3f}{' ± %.3f' % se if se is not None else ''}{d}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Routing: mean over MoE layers of |top-k(teacher) ∩ top-k(preset)| / k per token (per layer in the JSON). "
              "Accuracy deltas in brackets are against the teacher row; with small --limit they are mostly noise "
              "(see the ± standard errors).", ""]
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
