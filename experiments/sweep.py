"""Sweeps: a grid of cells run as Ray tasks, locally by default, on a cluster when given one.

    python -m workbench sweep benchmarks/grids/demo_budgets.yaml [--address ADDR] [--json]   (verb: evals.sweep)

`ray.init()` starts Ray on this machine; `--address` (or RAY_ADDRESS) joins a running cluster, whose every node
has the project installed (`pip install -e ".[sweep]"`). Timing groups (experiments.grid) run one per node at a
time, each pinned to its node and asking for all of its CPUs (or the grid's timing_cpus), so no two timing
cells share a machine; quality cells (each run by its kind's Runner) ask for one CPU each and pack, after the
timing groups. A failed cell is retried once, then reported with its error; the others finish. Each cell's run
record comes back to this process and is written under runs/ (atomically, its config marked with the sweep and
the cell), and the sweep table (one row per cell: its axes, status, error, node, times and headline numbers) goes to
runs/sweeps/<name>.parquet. Re-running a grid skips the cells whose records are already there.

Ray is imported only here (the `sweep` extra).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from experiments.grid import Cell, Grid, Runner, describe, run_quality, run_timing
from workbench.errors import WorkbenchError
from workbench.runs import list_runs, place_run, runs_dir, write_table

METRICS = ("tok_s", "tok_s_min", "tok_s_max", "hit_rate", "prefetch_recall", "bytes_read_per_token",
           "achieved_over_floor", "belady_hit_rate", "belady_tok_s", "ppl", "kl", "top1", "routing_agreement_mean")


def require_ray():
    try:
        import ray
    except ImportError as e:
        raise WorkbenchError(f"sweep needs Ray ({e}); pip install -e '.[sweep]'") from None
    return ray


def finished_cells(root: Path | None = None) -> dict:
    """{cell id: record path} of the sweep cells whose run records are under runs/ (the newest wins)."""
    out = {}
    for p in list_runs(root):
        try:
            cell = json.loads((p / "config.json").read_text()).get("sweep", {}).get("cell")
        except (OSError, ValueError, AttributeError):
            continue
        if cell:
            out[cell] = p
    return out


def headline(summary: dict, runner: Runner | None) -> dict:
    row = {k: summary.get(k) for k in METRICS}
    if runner and runner.columns:
        row.update(runner.columns(summary))
    return {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
            for k, v in row.items()}


def bring_home(grid: Grid, cell: Cell, res: dict, root: Path) -> Path:
    """Write a cell's returned run record under this machine's runs/, its config marked with the sweep."""
    name, files = res["record"]
    cfg = json.loads(files["config.json"])
    cfg.update(grid.labels.get(cell.id, {}))
    cfg["sweep"] = {"name": grid.name, "grid": grid.source, "cell": cell.id, "kind": cell.kind, "design": cell.name,
                    "node": res["node"], "intervals": res["intervals"]}
    return place_run(name, {**files, "config.json": (json.dumps(cfg, indent=1, default=str) + "\n").encode()}, root)


def _node() -> str:
    import ray
    return f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:8]}"


def _timing_task(cells):
    return [{**r, "node": _node()} for r in run_timing(cells)]


def _quality_task(cell, runner):
    return [{**run_quality(cell, runner), "node": _node()}]


def _failed(cells, e, node="?") -> list[dict]:
    return [{"cell": c.id, "status": "failed", "error": describe(e), "intervals": [], "node": node} for c in cells]


def run_grid(grid: Grid, runners: dict[str, Runner] | None = None, address: str | None = None, resume: bool = True,
             progress: bool = True, root: Path | None = None) -> dict:
    """Run every cell of `grid` not already finished; returns {"sweep", "table", "rows", "counts"}.
    `runners`: {kind: Runner} for the grid's quality cells (evals.sweep.RUNNERS for the eval kinds).
    Records and the sweep table go under `root` (default: runs/)."""
    from tqdm import tqdm
    runners = runners or {}
    missing = sorted({c.kind for c in grid.cells if not c.timing and c.kind not in runners})
    if missing:
        raise WorkbenchError(f"sweep {grid.name}: no runner for the cells {', '.join(missing)} "
                             f"(the eval kinds' are evals.sweep.RUNNERS)")
    ray = require_ray()
    root = root or runs_dir()
    by_id = {c.id: c for c in grid.cells}
    rows = {c.id: {**c.row(), "status": "pending", "error": None, "attempts": 0, "resumed": False, "node": None,
                   "t_start": None, "t_end": None, "intervals": [], "run": None} for c in grid.cells}
    bar = tqdm(total=len(grid.cells), desc=f"sweep {grid.name}", unit="cell", file=sys.stderr, disable=not progress)
    done = finished_cells(root) if resume else {}
    for cid, path in done.items():
        if cid in rows:
            cfg = json.loads((path / "config.json").read_text())["sweep"]
            summary = json.loads((path / "summary.json").read_text())
            iv = [tuple(i) for i in cfg.get("intervals", [])]
            rows[cid].update(status="ok", resumed=True, node=cfg.get("node"), run=str(path), intervals=iv,
                             t_start=iv[0][0] if iv else None, t_end=iv[-1][1] if iv else None,
                             **headline(summary, runners.get(by_id[cid].kind)))
            bar.update(1)

    def land(results) -> list[Cell]:
        """Record what came back; returns the cells to try once more."""
        retry = []
        for res in results:
            cell, row = by_id[res["cell"]], rows[res["cell"]]
            iv = [tuple(map(float, i)) for i in res["intervals"]]
            row.update(attempts=row["attempts"] + 1, node=res["node"], intervals=row["intervals"] + iv)
            if iv:
                row.update(t_start=row["t_start"] or iv[0][0], t_end=iv[-1][1])
            if res["status"] == "ok":
                row.update(status="ok", error=None, run=str(bring_home(grid, cell, res, root)),
                           **headline(res["summary"], runners.get(cell.kind)))
            elif row["attempts"] < 2:
                retry.append(cell)
                continue
            else:
                row.update(status="failed", error=res["error"])
                if res.get("record"):        # the failed run's record, home; its error names it there
                    run = bring_home(grid, cell, res, root)
                    row.update(run=str(run), error=re.sub(r"\S*" + re.escape(res["record"][0]), str(run), res["error"]))
            bar.update(1)
        return retry

    todo = [c for c in grid.cells if c.id not in done]
    started = bool(todo) and not ray.is_initialized()
    if started:
        address = address or os.environ.get("RAY_ADDRESS") or "local"   # never an instance some other run left behind
        ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        if todo:
            timing_phase(ray, grid, grid.groups(todo), land)
            quality_phase(ray, [c for c in todo if not c.timing], runners, land)
    finally:
        bar.close()
        if started:
            ray.shutdown()
    table = write_sweep_table(grid, list(rows.values()), root)
    counts = {s: sum(r["status"] == s for r in rows.values()) for s in ("ok", "failed")}
    counts["resumed"] = sum(r["resumed"] for r in rows.values())
    return {"sweep": grid.name, "grid": grid.source, "table": str(table), "rows": list(rows.values()), "counts": counts}


def timing_phase(ray, grid: Grid, queue: list[list[Cell]], land):
    """Timing groups one at a time per node, pinned to it and holding its CPUs (or the grid's timing_cpus)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = [(n["NodeID"], int(n["Resources"].get("CPU", 0))) for n in ray.nodes()
             if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
    if not nodes:
        raise WorkbenchError("the Ray cluster has no node with a CPU to run cells on")
    task, busy = ray.remote(_timing_task), {}             # busy: {task: (node, group)}
    while queue or busy:
        for node_id, cpus in nodes:
            if queue and node_id not in {n for n, _ in busy.values()}:
                group = queue.pop(0)
                run = task.options(num_cpus=min(grid.timing_cpus or cpus, cpus),
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
                busy[run.remote(group)] = (node_id, group)
        ready, _ = ray.wait(list(busy), num_returns=1)
        _, group = busy.pop(ready[0])
        try:
            retry = land(ray.get(ready[0]))
        except Exception as e:  # noqa: BLE001 - the task itself died (a worker crash, a lost node)
            retry = land(_failed(group, e))
        if retry:
            queue.append(retry)


def quality_phase(ray, cells: list[Cell], runners: dict, land):
    """Quality cells pack: one CPU each, placed by Ray."""
    task = ray.remote(_quality_task).options(num_cpus=1)
    pending = {task.remote(c, runners[c.kind]): c for c in cells}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        cell = pending.pop(ready[0])
        try:
            retry = land(ray.get(ready[0]))
        except Exception as e:  # noqa: BLE001
            retry = land(_failed([cell], e))
        pending.update({task.remote(c, runners[c.kind]): c for c in retry})


def write_sweep_table(grid: Grid, rows: list[dict], root: Path | None = None) -> Path:
    import pyarrow as pa
    cols = sorted({k for r in rows for k in r})
    first = [k for k in next(iter(rows), {}) if k in cols]
    order = first + [k for k in cols if k not in first]
    table = pa.Table.from_pylist([{k: r.get(k) for k in order} for r in rows])
    table = table.replace_schema_metadata({"sweep": grid.name, "grid": grid.source,
                                           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return write_table(table, (root or runs_dir()) / "sweeps" / f"{grid.name}.parquet")


def text(res: dict) -> str:
    lines = [f"sweep {res['sweep']}: {res['counts']['ok']} ok ({res['counts']['resumed']} from earlier records), "
             f"{res['counts']['failed']} failed; table {res['table']}",
             f"{'kind':13} {'design':22} {'budget':>7} {'device':14} {'status':7} {'tok/s':>7} {'KL':>9} {'ppl':>8}  node"]
    fmt = lambda v, f: "" if v is None else format(v, f)
    for r in res["rows"]:
        lines.append(f"{r['kind']:13} {r['design'][:22]:22} {str(r['budget']):>7} {_device(r)[:14]:14} {r['status']:7} "
                     f"{fmt(r.get('tok_s'), '7.2f'):>7} {fmt(r.get('kl'), '9.5f'):>9} {fmt(r.get('ppl'), '8.3f'):>8}  "
                     f"{r['node'] or ''}" + (f"\n    error: {r['error']}" if r["error"] else ""))
    return "\n".join(lines)


def _device(row: dict) -> str:
    """The device a cell's times are for, and how they were taken (SIMULATED, EMULATED), as the verbs label them."""
    clock = row.get("clock") or "measured"
    return (row.get("device") or "this machine") + ("" if clock == "measured" else f" ({clock.upper()})")


def markdown(res: dict, command: str) -> str:
    from workbench.runs import environment
    env = environment()
    fmt = lambda v, f: "" if v is None else format(v, f)
    lines = [f"# Sweep {res['sweep']}", "", f"`{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit `{env['git_commit'][:10]}`, driver on "
             f"{env['cpu']} ({env['cores']} cores). Timings were taken on a shared, loaded machine. tok/s: median over "
             "the alternating rounds (min-max); KL(teacher ‖ design) per token and top-1 agreement on held-out text. "
             "SIMULATED: a virtual clock over a routing trace (`simulate`; Belady: the optimal-replacement bound); "
             "EMULATED: real reads made to wait as the device profile's flash would (`bench --device`).",
             "", f"{res['counts']['ok']} cells ok, {res['counts']['failed']} failed. Table: `{Path(res['table']).name}`.",
             "", "| kind | design | budget | device | status | tok/s | min-max | hit rate | Belady hit | KL | top-1 | ppl | node |",
             "|---|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        mm = f"{r['tok_s_min']:.2f}-{r['tok_s_max']:.2f}" if r.get("tok_s_min") is not None else ""
        lines.append(f"| {r['kind']} | {r['design']} | {r['budget']} | {_device(r)} | {r['status']} | "
                     f"{fmt(r.get('tok_s'), '.2f')} | {mm} | {fmt(r.get('hit_rate'), '.3f')} | "
                     f"{fmt(r.get('belady_hit_rate'), '.3f')} | {fmt(r.get('kl'), '.5f')} | {fmt(r.get('top1'), '.3f')} | "
                     f"{fmt(r.get('ppl'), '.3f')} | {r['node'] or ''} |")
    lines += [""] + [f"- {r['design']} at {r['budget']} failed: {r['error']}" for r in res["rows"] if r["error"]]
    return "\n".join(lines) + "\n"
