"""lm-eval's own task configs on local copies: `python -m evals.standard_tasks DIR [--data data/benchmarks]` writes
one YAML per benchmark into DIR, each including lm-eval's installed config (its prompt, metrics and version) and
replacing only its dataset with a local file, so nothing is downloaded:

    lm_eval --include_path DIR --tasks arc_easy_disk,piqa_disk ...

The files hold absolute paths (lm-eval's config, the data), so they are written for this machine, not shipped.
HellaSwag is not among them: lm-eval's `hellaswag` reads the hub's rows (ctx_a, ctx_b, endings) and the only copy
here is llama.cpp's text format, so it runs as evals/tasks/hellaswag_local.yaml.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError

BENCHMARKS = Path(__file__).resolve().parents[1] / "data" / "benchmarks"

DISK = {    # lm-eval's task: (its config under lm_eval/tasks, the split it scores, the local copy under data/benchmarks)
    "arc_easy": ("arc/arc_easy.yaml", "test", "arc_easy/test.jsonl"),
    "arc_challenge": ("arc/arc_challenge.yaml", "test", "arc_challenge/test.jsonl"),
    "piqa": ("piqa/piqa.yaml", "validation", "piqa/valid.jsonl"),
    "lambada_openai": ("lambada/lambada_openai.yaml", "test", "lambada_openai/lambada_test.jsonl"),
    "winogrande": ("winogrande/default.yaml", "validation", "winogrande/dev.jsonl"),
    "boolq": ("super_glue/boolq/default.yaml", "validation", "boolq/val.jsonl"),
}


def config(task: str, data: Path = BENCHMARKS) -> dict:
    import lm_eval.tasks
    own, split, rel = DISK[task]
    include, path = Path(lm_eval.tasks.__file__).parent / own, Path(data).resolve() / rel
    for p in (include, path):
        if not p.is_file():
            raise WorkbenchError(f"{p}: not found (lm-eval's config or the local copy of {task})")
    return {"include": str(include), "task": f"{task}_disk", "tag": ["workbench_disk"],
            "dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {split: str(path)}},
            "training_split": None, "validation_split": split if split == "validation" else None,
            "test_split": split if split == "test" else None}


def write(out: Path, data: Path = BENCHMARKS) -> list[Path]:
    configs = {task: config(task, data) for task in DISK}          # all found before any is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for task, cfg in configs.items():
        src, = cfg["dataset_kwargs"]["data_files"].values()
        atomic_write(out / f"{task}_disk.yaml", f"# lm-eval's {task} on {src} (evals/standard_tasks.py)\n"
                     + yaml.safe_dump(cfg, sort_keys=False))
    return [out / f"{task}_disk.yaml" for task in configs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.standard_tasks", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder to write the task YAMLs into (lm_eval --include_path)")
    ap.add_argument("--data", default=str(BENCHMARKS), help="the local copies (default: %(default)s)")
    a = ap.parse_args(argv)
    try:
        for p in write(Path(a.out), Path(a.data)):
            print(p)
    except WorkbenchError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
