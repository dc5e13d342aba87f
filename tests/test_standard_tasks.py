"""evals/standard_tasks.py: lm-eval's own task configs, reading the local copies, ask what our hand-written
*_local copies of the same tasks ask (the same documents, prompts, choices and answers)."""
import pytest

from evals.standard_tasks import DISK, write

pytest.importorskip("lm_eval")


def _requests(task, n=5):
    docs = list(task.eval_docs)
    picked = docs[:n] + docs[-n:]
    return len(docs), [(task.doc_to_text(d), task.doc_to_choice(d) if task.OUTPUT_TYPE == "multiple_choice" else None,
                        task.doc_to_target(d)) for d in picked]


def test_lm_evals_own_configs_read_the_local_copies_as_the_local_tasks_do(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager, get_task_dict

    from evals.lm import TASKS_DIR
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{t}_disk.yaml" for t in DISK)
    tm = TaskManager(include_path=[str(tmp_path), str(TASKS_DIR)], include_defaults=False)
    tasks = get_task_dict([f"{t}_{s}" for t in DISK for s in ("disk", "local")], tm)
    for t in DISK:
        disk, local = _requests(tasks[f"{t}_disk"]), _requests(tasks[f"{t}_local"])
        assert disk[0] == local[0] > 100, t
        assert disk == local, t


def test_a_missing_local_copy_is_named(tmp_path):
    from workbench.errors import WorkbenchError
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "test.jsonl").write_text("{}\n")
    with pytest.raises(WorkbenchError, match="arc_challenge/test.jsonl: not found"):
        write(tmp_path / "tasks", data=tmp_path)
    assert not (tmp_path / "tasks").exists()                       # nothing half-written
