"""Shared dashboard pieces: the registry of background runs, the numbers we show, and Altair charts.

A DesignRun owns one worker process (dashboards/worker.py), which creates its own Session, generates, and writes
the run record, sending the telemetry it copied under `tel.lock`; Streamlit reruns never touch an engine.
The registry is module level: it outlives reruns and is shared by the pages of one server.
"""
from __future__ import annotations

import functools
import json
import multiprocessing
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import altair as alt
import pyarrow as pa

from dashboards import worker
from workbench.presets import PRESETS, Budget, budget_for, get_preset
from workbench.registry import model_dir
from workbench.runs import list_runs, read_run
from workbench.errors import WorkbenchError

REFRESH_S = 0.5          # live numbers redraw this often
CHARTS_REFRESH_S = 1.0   # and the live charts this often
RECENT = 40              # decode tokens shown in the per-token charts
STOP_GRACE_S = 2.0       # a stopped design ends at its next token, or this long after Stop, whatever step it is in
MiB = 2 ** 20
# a token's time, split as telemetry.TokenRecord adds it up: flash wait is queue + device + completion, other is
# submit + hand-off + Python; draft, a speculative step's draft proposing its tokens
PARTS = [("compute_s", "compute"), ("router_s", "router"), ("dequant_s", "dequant"), ("submit_s", "submit"),
         ("queue_s", "queue"), ("device_s", "device"), ("completion_s", "completion"), ("handoff_s", "hand-off"),
         ("python_s", "Python"), ("draft_s", "draft")]
PART_COLORS = ["#4c78a8", "#72b7b2", "#eeca3b", "#f58518", "#ff9da6", "#e45756", "#9d755d", "#b279a2", "#bab0ac",
               "#54a24b"]
BOOTH_PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a small dog found a big red ball in the park.",
    "Tom and his mom went to the market to buy some apples.",
    "There was a tiny bird who wanted to fly to the moon.",
    "In a little house by the sea lived an old fisherman.",
]


def edge0_ready(model: str = "demo") -> bool:
    """The edge0 preset exists and its trained files (prerouter heads, LoRA) sit beside the model."""
    if "edge0" not in PRESETS:
        return False
    try:
        from workbench.edge0.artifacts import FILES, edge0_dir_of   # numpy only
        return all((edge0_dir_of(model_dir(model)) / f).exists() for f in FILES.values())
    except (ImportError, WorkbenchError, OSError):
        return False


def default_designs(model: str = "demo") -> list[str]:
    """on_demand, les, smol and edge0; resident (the ceiling) in edge0's place until edge0 can run."""
    return [d for d in ("on_demand", "les", "smol", "edge0" if edge0_ready(model) else "resident") if d in PRESETS]


def booth_round(i: int, model: str = "demo") -> tuple[str, list[str]]:
    """Round i of booth mode: the next story opening and the next set of designs."""
    sets = [default_designs(model), [d for d in ("on_demand", "history", "oracle", "les") if d in PRESETS]]
    return BOOTH_PROMPTS[i % len(BOOTH_PROMPTS)], sets[i % len(sets)]


def check_inputs(model: str, designs: list[str], budget: str, prompt: str, tokens: int):
    """What can be checked before any worker starts; the rest (a corrupt pack, a budget below
    top-k slots) is raised by Session in the worker and shown in that design's column."""
    model_dir(model)
    Budget(str(budget))
    if not designs:
        raise WorkbenchError("pick at least one design to compare")
    if not prompt.strip():
        raise WorkbenchError("empty prompt: type a story opening")
    if tokens < 1:
        raise WorkbenchError("tokens: generate at least one token")


@dataclass
class Snapshot:
    tokens: list           # TokenRecord, the prefill first
    ring: list             # the most recent LayerEvents
    summary: dict          # Session.summary() keys (per_layer included)
    charts: dict = field(default_factory=dict)     # chart rows, built once per snapshot


EMPTY = Snapshot([], [], {"per_layer": []})      # a design still starting


WORKER_NICE = worker.WORKER_NICE


class DesignRun:
    """One design generating in its own process (dashboards/worker.py); a listener thread here takes its messages,
    and `snapshot()` is safe to call from the page."""

    _init_locks: dict = {}          # one per stored form of a model: its conversion and usage profile are made once

    def __init__(self, model: str, design: str, budget: str, prompt: str, tokens: int, device: str | None = None,
                 routing_trace: str | None = None, knobs: dict | None = None, judged: bool = False,
                 lever: dict | None = None):
        """judged: the teacher scores each token as it comes (evals.live.Verdict, on a thread of this process: the
        worker's pipe never waits for it), from the model's own text only. lever: a lossy lever's knobs
        (workbench.designs.lossy) set on the design besides `knobs`, named in its heading."""
        self.id = secrets.token_hex(4)
        self.device = device            # an emulated device's profile name (data/devices), or None: this machine
        self.routing_trace = routing_trace   # routing replayed from a trace (a make-model checkpoint's real shape)
        self.lever = dict(lever or {})
        self.knobs = {**(knobs or {}), **self.lever}      # preset knobs set on the design (bench's --set)
        self.model, self.design, self.prompt, self.tokens = model, design, prompt, int(tokens)
        # a design whose preset keeps every expert resident ("all") is the ceiling: the budget does not apply
        self.budget = budget_for(get_preset(design), budget)
        self.status, self.error, self.record = "queued", None, None
        self.text, self.generated, self.summary, self.started, self.finished = "", 0, None, time.time(), None
        self._final: Snapshot | None = None
        self._last: Snapshot | None = None
        self._stop_at: float | None = None     # when Stop was asked (time.monotonic)
        self.judged = judged and routing_trace is None
        self.verdict, self.verdict_note = None, None       # evals.live.Verdict once the teacher reads the prompt
        self._judge_q: queue.SimpleQueue = queue.SimpleQueue()
        ctx = multiprocessing.get_context("spawn")       # a fresh interpreter: no locks forked from the server's threads
        self._conn, child = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self.process = ctx.Process(target=worker.run_design, name=f"workbench-{design}-{self.id}", daemon=True,
                                   args=(child, self._stop, model, design, self.budget, prompt, self.tokens, device,
                                         routing_trace, self.knobs, self.judged))
        self._child = child
        self.thread = threading.Thread(target=self._listen, name=f"workbench-{design}-{self.id}", daemon=True)

    @property
    def name(self) -> str:
        """The design's name on the page: its preset's (or file's), with the lever set on it."""
        from workbench.designs import short
        return short(self.design) + (f" + {lever_label(self.lever)}" if self.lever else "")

    @property
    def active(self) -> bool:
        return self.status in ("queued", "starting", "running")

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def start(self) -> "DesignRun":
        self.thread.start()
        return self

    def stop(self):
        """Ask the worker to stop at its next token (it sends its telemetry then); `_recv` ends the process if that
        token has not come STOP_GRACE_S later. A step can outlast a Stop by tens of seconds (the first steps of a
        fresh process compile kernels, a read is slow, the CPU is starved at nice 19), and a Stop is a Stop. Ending
        the process is safe: its Session lives there alone, its files are written atomically, its run record only
        once it is done."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            self._stop.set()

    def snapshot(self) -> Snapshot | None:
        """The finished run's numbers, or the latest copy of the live telemetry."""
        return self._final if self._final is not None else self._last

    def _take(self, msg):
        kind, *rest = msg
        if kind == "status":
            self.status = rest[0]
        elif kind == "unjudged":
            self.verdict_note = rest[0]
        elif kind == "prompt":
            self._judge_q.put(("prompt", rest[0]))
            threading.Thread(target=self._judge, name=f"workbench-judge-{self.id}", daemon=True).start()
        elif kind == "token":
            self.text, self.generated = rest[0], self.generated + 1
            if rest[1] is not None:
                self._last = Snapshot(*rest[1])
            if rest[2:] and rest[2] is not None:
                self._judge_q.put(("token", *rest[2]))
        elif kind == "done":
            self.text, self.summary, self._final, self.record = rest[0], rest[1], Snapshot(*rest[2]), Path(rest[3])
            self.status = "done"
        else:       # stopped, error
            if rest[-1] is not None:
                self._final = Snapshot(*rest[-1])
            self.error = rest[0] if kind == "error" else None
            self.status = kind

    def _recv(self):
        """The worker's next message; ("stopped", None) when it outlasted a Stop by STOP_GRACE_S and was ended."""
        while not self._conn.poll(0.25):
            if self._stop_at is not None and time.monotonic() - self._stop_at > STOP_GRACE_S:
                self.process.terminate()
                return ("stopped", None)
        return self._conn.recv()

    def _judge(self):
        """The teacher's verdict, token by token, behind the design; it ends with the run (or on a one-line error)."""
        from evals.live import Verdict
        try:
            with self._init_locks.setdefault((self.model, get_preset("teacher").storage), threading.Lock()):
                verdict = Verdict(self.model)
            while True:
                kind, *args = self._judge_q.get()
                if kind == "end":
                    break
                if kind == "prompt":
                    verdict.start(args[0])
                    self.verdict = verdict
                else:
                    verdict.add(*args)
            verdict.close()
        except Exception as e:     # noqa: BLE001 - one line in the design's column
            self.verdict_note = str(e) if isinstance(e, WorkbenchError) else \
                f"the teacher failed: {type(e).__name__}: {e}"

    def _listen(self):
        storage = get_preset(self.design).storage
        try:
            with self._init_locks.setdefault((self.model, storage), threading.Lock()):
                if self.stopping:
                    self.status = "stopped"
                    return
                self.process.start()
                self._child.close()
                while self.status in ("queued", "starting"):      # its Session made (or failed) before the next's
                    self._take(self._recv())
            while self.active:
                self._take(self._recv())
        except (EOFError, OSError):
            if self.active:
                self.error, self.status = f"{self.design}: its process ended without a result", "error"
        finally:
            self._judge_q.put(("end",))
            self._conn.close()
            if self.process.pid is not None:
                self.process.join(timeout=10)
            self.finished = time.time()


_RUNS: dict[str, DesignRun] = {}
_RUNS_LOCK = threading.Lock()
KEEP = 48
MAX_RUNS = 8        # design processes at once on this server: every page, session and visitor together


# the lossy levers the live page sets beside each design (workbench.designs.lossy; their price: results/lossy.md)
LEVERS = {"drop_misses": {"routing": "drop_misses"}, "drop_misses keep=2": {"routing": "drop_misses", "keep": "2"},
          "top_k k=3": {"routing": "top_k", "k": "3"}, "top_k k=2": {"routing": "top_k", "k": "2"},
          "low_on_miss": {"routing": "low_on_miss"}}


def lever_label(lever: dict) -> str:
    return next((n for n, k in LEVERS.items() if k == lever), ", ".join(f"{k}={v}" for k, v in lever.items()))


def start_runs(model: str, designs: list[str], budget: str, prompt: str, tokens: int, device: str | None = None,
               routing_trace: str | None = None, knobs: dict | None = None, lever: str | None = None) -> list[str]:
    """Start one process per design (knobs: preset knobs set on each, checked here); refused, in one line, when that
    would run more than MAX_RUNS at once. lever: a name of LEVERS: beside each design the same design with that
    lever, and every run judged by the teacher as it goes (its running KL and top-1 agreement)."""
    from workbench.presets import with_each
    if lever is not None and lever not in LEVERS:
        raise WorkbenchError(f"lever {lever!r}: choose one of {', '.join(LEVERS)}")
    if lever is not None and routing_trace:
        raise WorkbenchError("a lossy lever beside the designs needs the model's own weights and routing: not a "
                             "model size or a routing trace")
    arms = [(d, None) for d in designs] + [(d, LEVERS[lever]) for d in designs if lever]
    for lv in {None, lever}:     # a design that does not load, a knob none has, a value refused: one line, first
        with_each([get_preset(d) for d in designs], {**(knobs or {}), **LEVERS.get(lv, {})})
    with _RUNS_LOCK:
        busy = sum(r.active and not r.stopping for r in _RUNS.values())
        if busy + len(arms) > MAX_RUNS:
            raise WorkbenchError(f"busy: {busy} designs are running on this machine and at most {MAX_RUNS} run at "
                                 f"once; stop some or wait for them to finish")
        runs = [DesignRun(model, d, budget, prompt, tokens, device, routing_trace, knobs, judged=lever is not None,
                          lever=lv) for d, lv in arms]
        _RUNS.update((r.id, r) for r in runs)
        old = [k for k, r in _RUNS.items() if not r.active]
        for k in old[: max(0, len(_RUNS) - KEEP)]:
            del _RUNS[k]
    for r in runs:
        r.start()
    return [r.id for r in runs]


def cores() -> int:
    from workbench.host import cores
    return cores()


def cores_note(designs: int, n_cores: int | None = None) -> str:
    """What the page says about the designs' processes and this machine's cores."""
    n_cores = n_cores or cores()
    if designs > n_cores:
        return (f"Each design runs in its own process: {designs} designs on {n_cores} cores share cores, so each "
                f"design's tok/s here also depends on the others' work (not what it gets alone).")
    return f"Each design runs in its own process: {designs} design(s) on {n_cores} cores, at most one each."


def get_runs(ids) -> list[DesignRun]:
    return [_RUNS[i] for i in ids or [] if i in _RUNS]


def stop_runs(ids):
    for r in get_runs(ids):
        r.stop()


# ---------------------------------------------------------------- numbers shown

def _fmt(s: dict, key: str, spec: str, scale: float = 1.0) -> str:
    x = s.get(key)
    return "—" if x is None else format(x * scale, spec)


def display_numbers(s: dict) -> dict[str, str]:
    """The headline numbers of one run, formatted, from a Session.summary() dict (or a summary.json)."""
    return {
        "tok/s": _fmt(s, "tok_s", ".2f"),
        "hit rate": _fmt(s, "hit_rate", ".1%"),
        "late (in flight)": _fmt(s, "late_rate", ".1%"),
        "flash wait ms/tok": _fmt(s, "flash_wait_per_token_s", ".1f", 1e3),
        "prefetch recall": _fmt(s, "prefetch_recall", ".1%"),
        "read KiB/tok": _fmt(s, "bytes_read_per_token", ".0f", 1 / 1024),
        "peak RSS MiB": _fmt(s, "peak_rss_bytes", ".0f", 1 / MiB),
        "cache MiB": _fmt(s, "cache_bytes", ".1f", 1 / MiB),
        "budget MiB": _fmt(s, "budget_bytes", ".1f", 1 / MiB),
        **({"drafts accepted": _fmt(s, "spec_accept_rate", ".0%"),
            "experts a step (x one token's)": _fmt(s, "union_growth", ".2f")} if "spec_steps" in s else {}),
    }


NUMBER_KEYS = ("decode_steps", "tok_s", "hit_rate", "late_rate", "flash_wait_per_token_s", "prefetch_recall",
               "bytes_read_per_token", "cache_bytes", "budget_bytes", "peak_rss_bytes")


# ---------------------------------------------------------------- charts
# Each live chart is an Altair template built once (`chart_spec`) and fed fresh rows on every redraw
# (`chart_data`): rebuilding and validating Altair objects 4x6 times a second costs more than it shows.

def _decode(tokens, recent=RECENT):
    return [t for t in tokens if t.phase == "decode"][-recent:]


def _table(cols: dict) -> pa.Table:
    return pa.table({k: pa.array(v, type=pa.float64()) for k, v in cols.items()})


# the recent tokens on a quantitative axis (x..x2 per token): cheaper for the browser than an ordinal one
RECENT_SCALE = alt.Scale(zero=False, nice=False)
TOKEN_AXIS = alt.Axis(tickMinStep=1, format="d")


def _tok_s_chart():
    base = alt.Chart(title="tok/s (dots: tokens, line: mean of 8)").encode(
        x=alt.X("token:Q", title="decode token"))
    dots = base.mark_circle(size=18, opacity=0.5, color="#4c78a8").encode(
        y=alt.Y("tok_s:Q", title="tok/s"), tooltip=["token:Q", alt.Tooltip("tok_s:Q", format=".2f")])
    return dots + base.mark_line(color="#f58518").encode(y="mean8:Q")


def _tok_s_data(snap):
    dec = [t for t in snap.tokens if t.phase == "decode"]
    rate = [1.0 / max(t.wall_s, 1e-9) for t in dec]
    mean8 = [sum(rate[max(0, i - 7):i + 1]) / len(rate[max(0, i - 7):i + 1]) for i in range(len(rate))]
    return _table({"token": [t.token for t in dec], "tok_s": rate, "mean8": mean8})


def _heatmap_chart():
    return alt.Chart(title="hit (green) / miss (red) by layer").mark_rect().encode(
        x=alt.X("token:Q", title="decode token", scale=RECENT_SCALE, axis=TOKEN_AXIS), x2="token_end:Q",
        y=alt.Y("layer:O", title="layer"),
        color=alt.Color("hit_rate:Q", scale=alt.Scale(domain=[0, 1], scheme="redyellowgreen"), legend=None),
        tooltip=["token:O", "layer:O", alt.Tooltip("hits:Q", title="hits"), alt.Tooltip("routed:Q", title="of")])


def _heatmap_data(snap):
    evs = [e for e in snap.ring if e.phase == "decode" and e.hit]
    last = max((e.token for e in evs), default=0)
    evs = [e for e in evs if e.token > last - RECENT]
    return _table({"token": [e.token for e in evs], "token_end": [e.token + 1 for e in evs],
                   "layer": [e.layer for e in evs],
                   "hit_rate": [sum(e.hit) / len(e.hit) for e in evs], "hits": [sum(e.hit) for e in evs],
                   "routed": [len(e.hit) for e in evs]})


LAYER_SERIES = ["hit rate", "prefetch recall"]
LAYER_COLORS = ["#54a24b", "#b279a2"]


def _layers_chart():
    return alt.Chart(title="per layer: hit rate, prefetch recall").mark_bar().encode(
        x=alt.X("layer:O", axis=alt.Axis(labelAngle=0)), xOffset=alt.XOffset("series:N", sort=LAYER_SERIES),
        y=alt.Y("value:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%", tickCount=3), title=None),
        color=alt.Color("series:N", scale=alt.Scale(domain=LAYER_SERIES, range=LAYER_COLORS), legend=None),
        tooltip=["layer:O", "series:N", alt.Tooltip("value:Q", format=".1%")])


def _layers_data(snap):
    rows = [(r["layer"], series, v) for r in snap.summary["per_layer"]
            for series, v in zip(LAYER_SERIES, (r["hit_rate"], r.get("recall"))) if v is not None]
    return _long({"layer": [r[0] for r in rows], "value": [r[2] for r in rows]}, series=[r[1] for r in rows])


def _breakdown_chart():
    labels = [label for _, label in PARTS]
    return alt.Chart(title="time per token (ms)").mark_rect().encode(
        x=alt.X("token:Q", title="decode token", scale=RECENT_SCALE, axis=TOKEN_AXIS), x2="token_end:Q",
        y=alt.Y("ms_from:Q", title="ms"), y2="ms_to:Q",
        color=alt.Color("part:N", scale=alt.Scale(domain=labels, range=PART_COLORS), legend=None),
        tooltip=["token:Q", "part:N", alt.Tooltip("ms:Q", format=".2f")])


def _breakdown_data(snap):
    """One rect per (token, part), stacked here in PARTS' order from the bottom."""
    cols = {k: [] for k in ("token", "token_end", "ms", "ms_from", "ms_to")}
    parts = []
    for t in _decode(snap.tokens):
        y = 0.0
        for k, label in PARTS:
            ms = getattr(t, k) * 1e3
            for key, v in zip(cols, (t.token, t.token + 0.9, ms, y, y + ms)):
                cols[key].append(v)
            parts.append(label)
            y += ms
    return _long(cols, part=parts)


def _long(numbers: dict, **labels) -> pa.Table:
    """Rows already in long form (no fold or calculate left to the browser: those made its redraws slow)."""
    return pa.table({**{k: pa.array(v, type=pa.float64()) for k, v in numbers.items()},
                     **{k: pa.array(v, type=pa.string()) for k, v in labels.items()}})


# name: (template, rows from a Snapshot, element height in px: Streamlit's height includes title and axes)
LIVE_CHARTS = {
    "tok/s": (_tok_s_chart, _tok_s_data, 230),
    "heatmap": (_heatmap_chart, _heatmap_data, 260),
    "layers": (_layers_chart, _layers_data, 200),
    "breakdown": (_breakdown_chart, _breakdown_data, 240),
}


def legend_html(name: str) -> str | None:
    """A static colour key under a chart (cheaper for the browser than a Vega legend on every redraw)."""
    keys = {"layers": zip(LAYER_SERIES, LAYER_COLORS), "breakdown": zip([l for _, l in PARTS], PART_COLORS)}.get(name)
    if keys is None:
        return None
    return " ".join(f"<span style='white-space:nowrap;font-size:0.8em'><span style='display:inline-block;width:0.8em;"
                    f"height:0.8em;background:{c};margin:0 0.25em 0 0.6em'></span>{label}</span>" for label, c in keys)


def _without_data(spec):
    """Drop Altair's placeholder data so every layer reads the rows Streamlit is given."""
    if isinstance(spec, dict):
        return {k: _without_data(v) for k, v in spec.items() if k not in ("data", "datasets")}
    return [_without_data(v) for v in spec] if isinstance(spec, list) else spec


@functools.cache
def chart_spec(name: str) -> dict:
    return _without_data(LIVE_CHARTS[name][0]().to_dict(validate=False))


def chart_data(name: str, snap: Snapshot) -> pa.Table:
    if snap is EMPTY:
        return LIVE_CHARTS[name][1](snap)
    if name not in snap.charts:
        snap.charts[name] = LIVE_CHARTS[name][1](snap)
    return snap.charts[name]


def chart(name: str, snap: Snapshot) -> alt.Chart:
    """The same chart as one Altair object, data included (for notebooks and tests)."""
    return LIVE_CHARTS[name][0]().properties(data=chart_data(name, snap).to_pandas())


# ---------------------------------------------------------------- saved run records

def record_configs(key: str) -> list[tuple[str, dict]]:
    """(path, config) of the saved run records whose config has `key`, oldest first (config.json only).
    Names start with the UTC second; within one second the file times order them."""
    out = []
    for p in list_runs():
        try:
            cfg = json.loads((p / "config.json").read_text())
            when = (p.name.split("-", 1)[0], (p / "summary.json").stat().st_mtime_ns)
        except (OSError, ValueError):
            continue
        if isinstance(cfg, dict) and key in cfg:
            out.append((when, str(p), cfg))
    return [(path, cfg) for _, path, cfg in sorted(out, key=lambda x: x[0])]


@functools.lru_cache(maxsize=512)
def read_record(path: str) -> dict:
    """A run record (records never change once written, so caching by path is safe); events left out."""
    rec = read_run(path)
    rec.pop("events", None)
    return rec


def scalars(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


for _name in LIVE_CHARTS:   # build the chart templates now, not in the first live redraw
    chart_spec(_name)
