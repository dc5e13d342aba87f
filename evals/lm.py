"""lm-eval runs on the engine with the local tasks in evals/tasks (no hub access)."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import NamedTuple

from workbench.errors import WorkbenchError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL = ("lambada_openai", "hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq")
STORIES = ("tinystories_ending", "tinystories_cloze")     # this repository's own tasks (evals/story_tasks.py)


def local_task_names(tasks) -> list[str]:
    """'arc_easy' or 'arc_easy_local' -> 'arc_easy_local' (lm-eval has its own tasks of the plain names);
    the story tasks keep their names."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    out = []
    for t in (x.strip() for x in items):
        if not t:
            continue
        base = t[:-6] if t.endswith("_local") else t
        if t in STORIES or t in ("workbench_local", "workbench_stories"):
            out.append(t)
            continue
        if base not in LOCAL:
            raise WorkbenchError(f"--tasks {t!r}: choose among {', '.join(STORIES + LOCAL)} (or *_local names)")
        out.append(f"{base}_local")
    if not out:
        raise WorkbenchError("--tasks: none given")
    return out


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise WorkbenchError(f"lm-eval is not installed ({e}); pip install -e '.[eval]'") from None


def task_manager():
    require_lm_eval()
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def primary(metrics: dict) -> tuple[str, float | None, float | None]:
    for m in ("acc_mutual_info", "acc", "acc_norm", "exact_match"):
        if f"{m},none" in metrics:
            return m, metrics[f"{m},none"], metrics.get(f"{m}_stderr,none")
    return "", None, None


class Primary(NamedTuple):
    column: str                 # "<task> <metric>", the task named without "_local"
    metric: str
    value: float | None
    stderr: float | None


def primaries(results: dict | None) -> dict[str, Primary]:
    """{task: its primary metric} of `evaluate`'s results (as kept in an `eval lm` record); tasks with none left out."""
    out = {}
    for task, m in (results or {}).items():
        name, v, se = primary({f"{k},none": x for k, x in m.items()})
        if name:
            out[task] = Primary(f"{task.removesuffix('_local')} {name}", name, v, se)
    return out


def evaluate(lm, tasks, limit=None, num_fewshot=None, tm=None, verbose: bool = False, per_item: bool = False) -> dict:
    """Run lm-eval; returns {task: {metric: value}} with lm-eval's "acc,none" keys flattened to "acc".

    per_item: also each task's "items": {"doc_id": [...], <metric>: [...], "ll": [...]} in doc order, one list per
    per-item metric (acc, acc_norm, ...) and "ll" the log-likelihood of the gold continuation: what paired
    comparisons are made of (evals/paired.py).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    if not verbose:
        for name in ("lm-eval", "lm_eval"):
            logging.getLogger(name).setLevel(logging.ERROR)
    names = local_task_names(tasks)
    with contextlib.redirect_stdout(sys.stderr):        # lm-eval prints progress notes; stdout is for --json
        res = lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, num_fewshot=num_fewshot,
                                      task_manager=tm or task_manager(), log_samples=per_item, bootstrap_iters=1000)
    out = {}
    for task, metrics in res["results"].items():
        row = {}
        for k, v in metrics.items():
            if "," in k and isinstance(v, (int, float)):
                name, filt = k.split(",", 1)
                row[name if filt == "none" else f"{name},{filt}"] = v
        row["samples"] = res.get("n-samples", {}).get(task, {}).get("effective")
        if per_item:
            row["items"] = items(res["samples"][task])
        out[task] = row
    return out


def items(samples: list[dict]) -> dict:
    """Per-item metrics and the gold continuation's log-likelihood from lm-eval's logged samples."""
    samples = sorted(samples, key=lambda x: x["doc_id"])
    gold = lambda x: x["filtered_resps"][x["target"] if isinstance(x["target"], int) else 0][0]
    out = {"doc_id": [x["doc_id"] for x in samples]}
    for m in samples[0]["metrics"] if samples else ():
        if m in ("acc", "acc_norm", "acc_mutual_info", "exact_match"):
            out[m] = [float(x[m]) for x in samples]
    out["ll"] = [float(gold(x)) for x in samples]
    return out


def run(model: str, preset: str, budget=None, tasks="lambada_openai,arc_easy,piqa", limit=None, num_fewshot=None,
        record: bool = True, engine: str | None = None, direct: bool = True, progress: bool = True,
        max_length: int | None = None, per_item: bool = False, device: str | None = None) -> dict:
    """per_item: the record keeps each task's per-item scores (evaluate's "items"), for paired comparisons."""
    from evals.common import record as write_record
    from runtime.session import open_session
    require_lm_eval()
    from evals.lm_eval_adapter import WorkbenchLM
    with open_session(model, preset, budget, prompt=None, engine=engine, direct=direct, device=device) as s:
        lm = WorkbenchLM(session=s, model=model, max_length=max_length, progress=progress)
        results = evaluate(lm, tasks, limit, num_fewshot, per_item=per_item)
        out = {"model": model, "preset": s.preset.name, "budget": s.budget_text, "tasks": local_task_names(tasks),
               "limit": limit, "num_fewshot": num_fewshot, "results": results, **s.labels()}
        params = {"tasks": out["tasks"], "limit": limit, "num_fewshot": num_fewshot}
        out["run"] = write_record("lm", s, params, {k: v for k, v in out.items() if k != "run"}, enabled=record)
    return out
