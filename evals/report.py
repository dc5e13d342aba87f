"""The quality report: teacher vs each preset on held-out perplexity, KL and top-1 against the teacher,
routing agreement, and lm-eval accuracy on the TinyStories ending and cloze tasks (first --limit items), each
preset paired with the teacher item by item (evals/paired.py: bootstrap interval, flips).

    python -m workbench eval report --model demo --out results/quality.md [--limit 200 --chunks 8 --ctx 512]

Writes results/quality.json and results/quality.md (each atomically: a temporary file, fsync, rename),
and one run record per preset and evaluation (eval "teacher" and "lm") for `eval compare`. The evaluations
are the cells of one sweep (experiments.sweep) on a local Ray: they pack onto the machine's cores.
"""
from __future__ import annotations

import time
from pathlib import Path

from evals.common import PRESET_ORDER
from workbench.atomic import atomic_write

DEFAULT_TASKS = ("tinystories_ending", "tinystories_cloze")


def build(model: str = "demo", presets=PRESET_ORDER, budget=None, data: str = "tinystories", n_ctx: int = 512,
          chunks: int = 8, tasks=DEFAULT_TASKS, limit: int | None = None, record: bool = True, progress: bool = True,
          engine: str | None = None, direct: bool = True, log=print) -> dict:
    """Every preset's `eval teacher` and `eval lm` as the cells of one sweep (experiments.sweep, a local Ray), then
    the rows from their run records. Each teacher cell computes the teacher's side on the same tokens; each lm cell
    keeps its per-item scores, by which every preset is paired with the teacher item by item."""
    import json
    import tempfile

    from evals.lm import local_task_names, primaries, require_lm_eval
    from evals.paired import paired
    from evals.sweep import RUNNERS
    from engines import DEFAULT
    from experiments.grid import Cell, Grid
    from experiments.sweep import run_grid
    from workbench.errors import WorkbenchError
    from workbench.presets import budget_for, get_preset
    from workbench.runs import environment, runs_dir
    require_lm_eval()
    engine = engine or DEFAULT           # a cell names its engine (its id and table row)
    t0 = time.time()
    tasks = local_task_names(tasks)
    cells = []
    for preset in presets:
        p = get_preset(preset)
        b = budget_for(p, budget)
        cells.append(Cell.of("eval teacher", model, p, preset, b, engine, data=data, ctx=n_ctx, chunks=chunks,
                             page_cache=not direct))
        cells.append(Cell.of("eval lm", model, p, preset, b, engine, ",".join(tasks), limit=limit,
                             page_cache=not direct))
    log(f"{len(presets)} presets: teacher comparison on {chunks} chunks of {n_ctx} tokens of {data}, lm-eval "
        f"({', '.join(tasks)}, limit {limit})")
    with tempfile.TemporaryDirectory(prefix="wb-report-") as scratch:
        res = run_grid(Grid(f"report_{Path(model).name}", cells), RUNNERS, resume=False, progress=progress,
                       root=runs_dir() if record else Path(scratch))
        failed = [r for r in res["rows"] if r["status"] != "ok"]
        if failed:
            raise WorkbenchError(f"eval report: {failed[0]['kind']} {failed[0]['design']} failed: {failed[0]['error']}")
        recs = {(r["kind"], r["preset"]): {k: json.loads((Path(r["run"]) / f"{k}.json").read_text())
                                          for k in ("config", "summary")}
                | {"run": r["run"], "seconds": sum(b - a for a, b in r["intervals"])} for r in res["rows"]}
    rows = []
    teacher_lm = recs.get(("eval lm", "teacher"))    # per-item scores (kept in the lm run records, not here)
    teacher_items = {t: m.get("items") for t, m in teacher_lm["summary"]["results"].items()} if teacher_lm else {}
    for preset in presets:
        t, lm = recs[("eval teacher", preset)], recs[("eval lm", preset)]
        cmp, p = t["summary"], t["config"]["preset"]
        row = {"preset": preset, "budget": cmp["budget"], "description": p["description"], "experts": p["experts"],
               "rest": p["rest"], "routing": p["routing"],
               "ppl": cmp["ppl"], "ppl_stderr": cmp["ppl_stderr"], "ppl_ratio": cmp["ppl_ratio"],
               "kl": cmp["kl"], "kl_stderr": cmp["kl_stderr"], "top1": cmp["top1"], "top1_stderr": cmp["top1_stderr"],
               "routing_agreement": cmp["routing_agreement"], "routing_agreement_mean": cmp["routing_agreement_mean"],
               "tasks": {}, "runs": [t["run"], lm["run"]] if record else [],
               "seconds": {"teacher": t["seconds"], "lm": lm["seconds"]}}
        acc = lm["summary"]["results"]
        scores = primaries(acc)
        for task in tasks:
            m = acc.get(task, {})
            p = scores.get(task)
            name, v, se = (p.metric, p.value, p.stderr) if p else ("", None, None)
            cell = {"metric": name, "value": v, "stderr": se, "samples": m.get("samples"),
                    "acc_norm": m.get("acc_norm"), "acc_mutual_info": m.get("acc_mutual_info")}
            gold = teacher_items.get(task)
            mine = m.get("items")
            if gold and mine and preset != "teacher":          # the same items in the same order: pair them
                if mine["doc_id"] != gold["doc_id"]:
                    raise WorkbenchError(f"eval report: {preset} and the teacher scored different items of {task}")
                cell["paired"] = paired(gold[name], mine[name])
                cell["paired_ll"] = paired(gold["ll"], mine["ll"])
            row["tasks"][task.removesuffix("_local")] = cell
        rows.append(row)
    env = environment()
    first = recs[("eval teacher", presets[0])]
    return {"model": model, "teacher_pack": first["summary"]["teacher_pack"], "spec": first["config"]["spec"],
            "data": data, "ctx": n_ctx, "chunks": chunks, "tokens": first["summary"]["tokens"],
            "ppl_teacher": first["summary"]["ppl_teacher"],
            "tasks": [t.removesuffix("_local") for t in tasks], "limit": limit, "rows": rows,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": time.time() - t0,
            "git_commit": env.get("git_commit"), "packages": env.get("packages")}


def markdown(rep: dict) -> str:
    from evals.paired import mark
    tasks = rep["tasks"]
    metric = lambda t: next((r["tasks"][t]["metric"] for r in rep["rows"] if r["tasks"].get(t, {}).get("metric")), "")
    lines = [f"# Quality: {rep['model']} — teacher vs presets", "",
             *([f"Made by `{rep['command']}` in {rep['seconds'] / 60:.1f} minutes of wall time on the machine "
                "that ran it, under whatever else ran there (each preset's cells at the end).", ""]
               if rep.get("command") else []),
             f"Model pack `{rep['teacher_pack']}` (teacher), {rep['created']}, commit `{(rep.get('git_commit') or '')[:10]}`.",
             f"Held-out perplexity, KL(teacher‖preset) and top-1 agreement: {rep['data']}, {rep['chunks']} chunks of "
             f"{rep['ctx']} tokens, second half of each scored (llama.cpp's method), {rep['tokens']} tokens. "
             f"lm-eval (0-shot, local data): {'the first %d' % rep['limit'] if rep['limit'] is not None else 'all'} items "
             "of each task; "
             + ", ".join(f"{t} {metric(t)}" for t in tasks) + " (the other metrics in the JSON).", "",
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
        t = r.get("seconds")
        lines.append(f"- `{r['preset']}`: {r['description']}"
                     + (f" (cells: teacher comparison {t['teacher'] / 60:.1f} min, lm-eval {t['lm'] / 60:.1f} min)"
                        if t else ""))
    return "\n".join(lines) + "\n"


def write(rep: dict, out: Path) -> tuple[Path, Path]:
    import json
    out = Path(out)
    js = out.with_suffix(".json")
    atomic_write(js, json.dumps(rep, indent=1, default=str) + "\n")
    atomic_write(out, markdown(rep))
    return out, js
