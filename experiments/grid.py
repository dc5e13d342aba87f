"""Grids: the cells of a sweep, read from a YAML file, and the code that runs them as their CLI verbs do.

    name: budgets                    # optional (default: the file's stem)
    models: [demo]                   # or `model: demo`
    cells: [bench, eval teacher]     # kinds: bench | simulate | eval ppl | eval teacher | eval lm
    axes:                            # lists; the cells are their product (for each model and kind)
      preset: [on_demand, les, smol]
      budget: ["0.125", "0.25", "0.5"]
      experts: [q4, q3]              # the preset's expert precision, overridden
      engine: [numpy]
      device: [iphone-les, ufs22-phone]   # a profile in data/devices: bench cells emulate its flash, simulate cells time by it
      task: [arc_easy, piqa]         # eval lm cells only
    bench: {tokens: 32, rounds: 3, prompt: "Once upon a time", page_cache: false, heldout_tokens: 0}
    simulate: {trace: data/traces/demo-tinystories-256.parquet, tokens: 64, prompt_tokens: 4, shape: "", rounds: 1,
               compute: ""}          # a compute profile JSON (simulate --compute), {preset} its design, {experts} its
                                     # precision; "": measured
    eval: {data: tinystories, ctx: 512, chunks: 4, limit: 50, page_cache: false}
    arms: [preset, experts]          # axes alternated inside one timing group (the default)
    timing_cpus: 8                   # CPUs a timing group asks for (default: the whole node's)

A bench cell is a timing cell: the bench cells that differ only in their arms form one timing group, run
on one node as a ladder is (rounds of A B C ..., each arm a fresh session warmed up before it is measured;
heldout_tokens > 0 adds held-out perplexity and miss rate, decoded token by token as in generation). With a
device axis a bench cell emulates that device's flash, as `bench --device` does (its record says emulated).
A simulate cell is `python -m workbench simulate` (its record says simulated): a timing cell too, because it
measures this machine's compute profile before it runs the virtual clock (unless the grid gives one: then the
cells differ only in what they simulate). Its trace and compute profile are paths relative to the repository, so
that every node finds them in its own checkout; its device is "this-machine" unless the axis says.
The other kinds are quality cells, one task each. Every cell runs the verb's own function and returns the run
record it wrote as files, so that the driver can write it under its own runs/: a bench cell experiments.bench.bench,
a simulate cell experiments.simulate.run,
a quality cell the Runner of its kind, given by the caller (the eval kinds' are evals.sweep.RUNNERS: the evals sit
above the experiments). No Ray here: experiments.sweep schedules cells on Ray.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from engines import DEFAULT
from workbench.errors import WorkbenchError
from workbench.presets import Budget, Preset, get_preset
from workbench.registry import REPO

KINDS = ("bench", "simulate", "eval ppl", "eval teacher", "eval lm")
TIMING = ("bench", "simulate")
AXES = ("preset", "budget", "experts", "engine", "device", "task")
SETTINGS = {   # per kind: the settings that make a cell (defaults as the verbs', but a bounded ppl/KL text)
    "bench": {"tokens": 64, "rounds": 3, "prompt": "Once upon a time", "page_cache": False, "heldout_tokens": 0,
              "routing_trace": ""},
    "simulate": {"trace": "data/traces/demo-tinystories-256.parquet", "tokens": 64, "prompt_tokens": 4, "shape": "",
                 "rounds": 1, "compute": ""},
    "eval ppl": {"data": "tinystories", "ctx": 512, "chunks": 4, "page_cache": False},
    "eval teacher": {"data": "tinystories", "ctx": 512, "chunks": 4, "page_cache": False},
    "eval lm": {"limit": 50, "page_cache": False},
}
SECTION = {"bench": "bench", "simulate": "simulate", "eval ppl": "eval", "eval teacher": "eval", "eval lm": "eval"}
TOP = {"name", "model", "models", "cells", "axes", "bench", "simulate", "eval", "arms", "timing_cpus"}


@dataclass(frozen=True)
class Cell:
    kind: str
    model: str
    preset: str                      # the preset the cell starts from
    design: str = ""                 # its name in tables and records (default: the preset's)
    overrides: tuple = ()            # (knob, value) pairs set on the preset
    budget: str | None = None        # None: the preset's own
    engine: str = DEFAULT            # the engine bench and the CLI default to (engines.DEFAULT), as the ladders'
    task: str | None = None          # eval lm: comma list of tasks
    settings: tuple = ()             # the kind's settings, and the device profile if the cell has one

    @property
    def id(self) -> str:
        """The cell's identity: a re-run of the same grid finds its record by this."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True, default=str).encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        return self.design or self.preset

    @property
    def timing(self) -> bool:
        return self.kind in TIMING

    @property
    def device(self) -> str | None:
        return dict(self.settings).get("device")

    @property
    def clock(self) -> str:
        """What its times are: simulated (a virtual clock), emulated (a device's flash), or measured."""
        return "simulated" if self.kind == "simulate" else "emulated" if self.device else "measured"

    def get(self, key):
        return dict(self.settings)[key]

    def preset_obj(self) -> Preset:
        return get_preset(self.preset).with_(name=self.name, **dict(self.overrides))

    @property
    def named_storage(self) -> dict:
        """The storage knobs the cell changes from its base preset: named, so a checkpoint read in place (a GGUF, MLX's
        layout) is converted to them (registry.storage_for), as bench's --set would, not run at its own bits;
        experts in the format the engine computes them in (registry.experts_for), as the preset's own precision is."""
        from workbench.registry import experts_for
        return {k: experts_for(v, self.engine) if k == "experts" else v for k, v in self.overrides
                if k in ("layout", "experts", "rest")}

    def row(self) -> dict:
        """The cell's columns in the sweep table."""
        p = self.preset_obj()
        return {"cell": self.id, "kind": self.kind, "model": self.model, "preset": self.preset, "design": self.name,
                "budget": self.budget or str(p.cache.budget), "experts": p.storage.experts, "engine": self.engine,
                "device": self.device, "clock": self.clock, "task": self.task}

    @classmethod
    def of(cls, kind: str, model: str, preset: Preset, base: str, budget=None, engine: str = DEFAULT,
           task: str | None = None, **settings) -> "Cell":
        """A cell running `preset`, a variant of the named preset `base` (e.g. a ladder's rung)."""
        ref = get_preset(base).to_dict()
        over = tuple(sorted((k, v) for k, v in preset.to_dict().items()
                            if k not in ("name", "description") and v != ref[k]))
        return cls(kind, model, base, preset.name, over, None if budget is None else str(budget), engine, task,
                   tuple(sorted({**SETTINGS[kind], **settings}.items())))


ARM_FIELDS = {"preset": ("preset", "design", "overrides"), "experts": ("design", "overrides"), "budget": ("budget",),
              "engine": ("engine",), "device": (), "task": ("task",)}    # a device is a setting: its own group


def group_key(cell: Cell, arms=("preset", "experts")) -> tuple:
    """Timing cells with the same key are the arms of one group (alternated on one node)."""
    skip = {f for a in arms for f in ARM_FIELDS[a]}
    return tuple((k, str(v)) for k, v in sorted(asdict(cell).items()) if k not in skip)


@dataclass
class Grid:
    name: str
    cells: list
    arms: tuple = ("preset", "experts")
    timing_cpus: int | None = None
    source: str = ""
    labels: dict = field(default_factory=dict)    # {cell id: fields added to its record's config} (a ladder's rung)

    def groups(self, cells=None) -> list[list[Cell]]:
        out = {}
        for c in cells if cells is not None else self.cells:
            if c.timing:
                out.setdefault(group_key(c, self.arms), []).append(c)
        return list(out.values())


def _list(path, key, v) -> list:
    v = v if isinstance(v, list) else [v]
    if not v:
        raise WorkbenchError(f"{path}: {key} is empty")
    return v


def load_grid(path) -> Grid:
    """Read and check a grid file; every mistake is one WorkbenchError naming the file."""
    import yaml
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise WorkbenchError(f"{path}: cannot read the grid file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise WorkbenchError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_grid(doc, path)


def parse_grid(doc: dict, path) -> Grid:
    """A grid from its mapping (a parsed grid file); `path` names it in errors and in the records."""
    from workbench.registry import model_dir
    path = Path(path)
    if not isinstance(doc, dict):
        raise WorkbenchError(f"{path}: a grid is a mapping with models, cells and axes")
    if set(doc) - TOP:
        raise WorkbenchError(f"{path}: unknown key(s) {', '.join(sorted(set(doc) - TOP))}; expected {', '.join(sorted(TOP))}")
    models = _list(path, "models", doc.get("models", doc.get("model", "demo")))
    for m in models:
        try:
            model_dir(str(m))
        except WorkbenchError as e:
            raise WorkbenchError(f"{path}: {e}") from None
    kinds = _list(path, "cells", doc.get("cells", "bench"))
    for k in kinds:
        if k not in KINDS:
            raise WorkbenchError(f"{path}: cells {k!r}: unknown kind; choose among {', '.join(KINDS)}")
    axes = doc.get("axes") or {}
    if not isinstance(axes, dict):
        raise WorkbenchError(f"{path}: axes is a mapping of axis name to a list of values")
    for a in axes:
        if a not in AXES:
            raise WorkbenchError(f"{path}: axis {a!r}: unknown; axes are {', '.join(AXES)}")
    values = {a: [str(v) for v in _list(path, f"axes.{a}", axes[a])] for a in axes}
    for p in values.get("preset", ["on_demand"]):
        try:
            preset = get_preset(p)
            if "simulate" in kinds:
                from experiments.simulate import simulable
                simulable(preset)
        except WorkbenchError as e:
            raise WorkbenchError(f"{path}: {e}") from None
    for d in values.get("device", []):
        from workbench import devices
        try:
            devices.load(d)
        except WorkbenchError as e:
            raise WorkbenchError(f"{path}: axes.device: {e}") from None
    for b in values.get("budget", []):
        try:
            Budget(b)
        except WorkbenchError as e:
            raise WorkbenchError(f"{path}: {e}") from None
    for x in values.get("experts", []):
        if x not in ("q2", "q3", "q4", "q8", "bf16"):
            raise WorkbenchError(f"{path}: axes.experts {x!r}: choose among q2, q3, q4, q8, bf16")
    sections = {}
    for sec in ("bench", "simulate", "eval"):
        s = doc.get(sec) or {}
        known = set().union(*(SETTINGS[k] for k in KINDS if SECTION[k] == sec))
        if not isinstance(s, dict) or set(s) - known:
            raise WorkbenchError(f"{path}: {sec}: expected a mapping with some of {', '.join(sorted(known))}")
        for k, v in s.items():
            want = next(type(SETTINGS[kind][k]) for kind in KINDS if k in SETTINGS[kind])
            number = want is int and not isinstance(v, bool) and isinstance(v, (int, float) if k == "limit" else int)
            if not (number and v >= 0 if want is int else isinstance(v, want)):
                raise WorkbenchError(f"{path}: {sec}.{k}: {v!r} is not a {'number' if want is int else want.__name__}")
        sections[sec] = s
    sim = {**SETTINGS["simulate"], **sections["simulate"]}
    presets = values.get("preset", ["on_demand"])
    precisions = values.get("experts") or {get_preset(p).storage.experts for p in presets}
    profiles = {sim["compute"].format(experts=x, preset=p) for x in precisions for p in presets}
    for key, files in (("trace", [sim["trace"]]), ("compute", profiles)):
        for f in sorted(files):
            if "simulate" in kinds and f and not (REPO / f).is_file():
                raise WorkbenchError(f"{path}: simulate.{key}: no file {f} in {REPO} (its path is relative to the repository)")
    arms = tuple(_list(path, "arms", doc.get("arms", ["preset", "experts"])))
    if set(arms) - set(AXES):
        raise WorkbenchError(f"{path}: arms: axes among {', '.join(AXES)}")
    cpus = doc.get("timing_cpus")
    if cpus is not None and (not isinstance(cpus, int) or cpus < 1):
        raise WorkbenchError(f"{path}: timing_cpus: a whole number of CPUs, at least 1")
    cells = []
    for model, kind in itertools.product(models, kinds):
        names = [a for a in AXES if a in values and (a != "task" or kind == "eval lm")
                 and (a != "device" or kind in TIMING) and (a != "engine" or kind != "simulate")]
        own = {k: v for k, v in {**SETTINGS[kind], **sections[SECTION[kind]]}.items() if k in SETTINGS[kind]}
        for combo in itertools.product(*(values[a] for a in names)):
            v = dict(zip(names, combo))
            device = v.get("device", "this-machine" if kind == "simulate" else None)
            settings = tuple(sorted({**own, **({"device": device} if device else {})}.items()))
            preset = v.get("preset", "on_demand")
            stored = get_preset(preset).storage.experts
            over = (("experts", v["experts"]),) if "experts" in v and v["experts"] != stored else ()
            design = preset + (f" experts {v['experts']}" if "experts" in values else "")
            cells.append(Cell(kind, str(model), preset, design, over, v.get("budget"), v.get("engine", DEFAULT),
                              v.get("task", "lambada_openai,arc_easy,piqa") if kind == "eval lm" else None, settings))
    return Grid(str(doc.get("name") or path.stem), cells, arms, cpus, str(path))


# ---------------------------------------------------------------- running cells (on whichever machine)

@contextmanager
def captured_records():
    """Run records written inside the block go to a temporary runs/; yields a list filled on exit with
    (record name, {file: bytes}) of each, oldest first (a failed run's record too: its failed.json)."""
    old = os.environ.get("WORKBENCH_RUNS")
    out = []
    with tempfile.TemporaryDirectory(prefix="wb-cell-") as d:
        os.environ["WORKBENCH_RUNS"] = d
        try:
            yield out
        finally:
            if old is None:
                os.environ.pop("WORKBENCH_RUNS", None)
            else:
                os.environ["WORKBENCH_RUNS"] = old
            for p in sorted(Path(d).iterdir()):
                if p.is_dir() and not p.name.startswith("."):
                    out.append((p.name, {f.name: f.read_bytes() for f in sorted(p.iterdir()) if f.is_file()}))


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, WorkbenchError) else f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class Runner:
    """How the quality cells of one kind run: `run(cell)` calls the verb's own function, which writes its run
    record and returns the verb's result; `columns(summary)` gives the kind's own sweep-table columns."""
    run: Callable
    columns: Callable | None = None


def run_bench(cell: Cell) -> dict:
    """A bench cell: `bench` as the CLI runs it (run record included); returns its result."""
    from experiments.bench import bench
    return bench(cell.model, cell.preset_obj(), budget=cell.budget, tokens=cell.get("tokens"), prompt=cell.get("prompt"),
                 engine=cell.engine, direct=not cell.get("page_cache"), device=cell.device,
                 routing_trace=cell.get("routing_trace") or None, **cell.named_storage)


def run_simulate(cell: Cell) -> dict:
    """A simulate cell: `python -m workbench simulate` (run record included), on the grid's compute profile for
    the cell's design or expert precision, else one measured on the cell's model; returns its result."""
    from experiments.compute_profile import load_compute
    from experiments.simulate import run
    p = cell.preset_obj()
    compute = cell.get("compute").format(experts=p.storage.experts, preset=p.name)
    return run(str(REPO / cell.get("trace")), p, cell.budget, cell.device, shape=cell.get("shape") or None,
               tokens=cell.get("tokens"), prompt=cell.get("prompt_tokens"), model=cell.model,
               compute=load_compute(REPO / compute) if compute else None)


TIMED = {"bench": run_bench, "simulate": run_simulate}


def run_quality(cell: Cell, runner: Runner) -> dict:
    """One quality cell: {"cell", "status", "error", "record", "summary", "intervals"}; a failed cell's record is
    the failed run's, if its verb wrote one."""
    t0 = time.time()
    try:
        with captured_records() as recs:
            runner.run(cell)
    except Exception as e:  # noqa: BLE001 - a failed cell is reported, the sweep goes on
        return {"cell": cell.id, "status": "failed", "error": describe(e), "record": recs[-1] if recs else None,
                "intervals": [(t0, time.time())]}
    name, files = recs[-1]
    return {"cell": cell.id, "status": "ok", "error": None, "record": (name, files),
            "summary": json.loads(files["summary.json"]), "intervals": [(t0, time.time())]}


def run_timing(cells: list[Cell], rounds: int | None = None) -> list[dict]:
    """One timing group: `rounds` rounds, each running every arm once in order (A B C ... A B C ...), each arm
    a fresh bench (warm-up, then the measured tokens) or simulate (its compute profile measured afresh) writing
    its record. Per arm the median round's record comes back, its tok_s the median over rounds with min, max and
    every round's value beside it; an arm that fails is dropped from the later rounds and reported, with the
    failed run's record if its verb wrote one."""
    rounds = rounds or cells[0].get("rounds")
    done = {c.id: {"rounds": [], "intervals": [], "error": None, "record": None} for c in cells}
    for _ in range(rounds):
        for c in cells:
            d = done[c.id]
            if d["error"]:
                continue
            t0 = time.time()
            try:
                with captured_records() as recs:
                    res = TIMED[c.kind](c)
                d["rounds"].append((res["tok_s"], recs[-1]))
            except Exception as e:  # noqa: BLE001
                d["error"], d["record"] = describe(e), recs[-1] if recs else None
            d["intervals"].append((t0, time.time()))
    for c in cells:
        if dict(c.settings).get("heldout_tokens") and not done[c.id]["error"]:
            try:
                done[c.id]["heldout"] = heldout(c)
            except Exception as e:  # noqa: BLE001
                done[c.id]["error"] = describe(e)
    out = []
    for c in cells:
        d = done[c.id]
        if d["error"]:
            out.append({"cell": c.id, "status": "failed", "error": d["error"], "record": d["record"],
                        "intervals": d["intervals"]})
            continue
        tps = [t for t, _ in d["rounds"]]
        name, files = sorted(d["rounds"], key=lambda r: r[0])[len(tps) // 2][1]
        summary = json.loads(files["summary.json"])
        summary.update(tok_s=statistics.median(tps), tok_s_min=min(tps), tok_s_max=max(tps), tok_s_rounds=tps,
                       **d.get("heldout", {}))
        files = {**files, "summary.json": (json.dumps(summary, indent=1, default=str) + "\n").encode()}
        out.append({"cell": c.id, "status": "ok", "error": None, "record": (name, files), "summary": summary,
                    "intervals": d["intervals"]})
    return out


def heldout(cell: Cell) -> dict:
    """Held-out TinyStories decoded token by token (teacher-forced) in a fresh session, so the cache and a
    cache-aware bias evolve as in generation: its perplexity and miss rate."""
    from runtime.session import open_session
    from workbench.textdata import heldout_ids
    with open_session(cell.model, cell.preset_obj(), cell.budget, prompt=cell.get("prompt"),
                      tokens=cell.get("tokens"), engine=cell.engine, direct=not cell.get("page_cache"),
                      **cell.named_storage) as s:
        ids = heldout_ids(s.tokenizer, "tinystories", cell.get("heldout_tokens"))
        s.reset_telemetry()
        nll = decode_nll(s, ids)
        return {"heldout_ppl": float(np.exp(nll.mean())), "heldout_miss_rate": 1.0 - s.summary()["hit_rate"]}


def decode_nll(session, ids: list[int]) -> np.ndarray:
    """Teacher-forced decode, token by token, so the cache (and a cache-aware bias) evolves as in generation."""
    session.engine.reset()
    nll = []
    logits = session.step(ids[:1], "prefill")
    for t in ids[1:]:
        z = logits[-1].astype(np.float64)
        nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[t])
        logits = session.step([t], "decode")
    return np.asarray(nll)
