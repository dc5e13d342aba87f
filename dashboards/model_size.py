"""The live page's model sizes: the demo, or a random-weight checkpoint of a real model's shape driven by a trace.

A shape's checkpoint (workbench/shapes.py) is made once, where `make-model` writes it by default
(workbench.shapes.checkpoint_path, under the workbench cache), with LAYERS layers and the experts the trace's
mapping needs (experiments/routing_trace.py: r x the trace's experts, r = the shape's top-k over the trace's); every
design then runs it with the trace as its --routing-trace, so the reads are the real expert size and the routing is
the traced model's.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.shapes import SHAPES, checkpoint_bytes, checkpoint_path, free_bytes, make_model, random_label

REPO = Path(__file__).resolve().parents[1]
DEMO = "demo"
DEMO_TRACE = REPO / "data" / "traces" / "demo-tinystories-256.parquet"
LAYERS = 4      # of the shape's layers: a real expert size at a make time and disk the page can wait for
ROOM = 2        # disk asked for: the checkpoint, and about as much again for the packs the designs convert it to
_locks: dict = {}
_locks_lock = threading.Lock()


def choices() -> list[str]:
    return [DEMO, *SHAPES]


def shown(path) -> str:
    """A path as the page shows it: relative to the repository when inside it."""
    p = Path(path)
    return str(p.relative_to(REPO)) if p.is_absolute() and p.is_relative_to(REPO) else str(p)


@dataclass(frozen=True)
class Plan:
    shape: str
    trace: str
    layers: int
    experts: int
    path: Path

    @property
    def bytes(self) -> int:
        return checkpoint_bytes(self.shape, self.layers, self.experts)

    @property
    def label(self) -> str:
        return f"{self.shape} ({self.layers} layers, {self.experts} experts, {self.bytes / 1e9:.1f} GB)"


def plan(shape: str, trace=None) -> Plan:
    """Which checkpoint a shape runs as with this trace (the demo trace by default); a one-line refusal when the
    shape is unknown or its top-k cannot replay the trace."""
    from experiments.routing_trace import replay_experts
    from experiments.traces import read_trace
    if shape not in SHAPES:
        raise WorkbenchError(f"model size {shape!r}: choose {DEMO} or one of {', '.join(SHAPES)}")
    trace = str(trace or DEMO_TRACE)
    meta = read_trace(trace)["meta"]
    try:
        experts = replay_experts(shown(trace), meta, SHAPES[shape]["num_experts_per_tok"], SHAPES[shape]["num_experts"])
    except WorkbenchError as e:
        raise WorkbenchError(f"model size {shape}: {e}") from None
    return Plan(shape, trace, LAYERS, experts, checkpoint_path(shape, LAYERS, experts))


def made(p: Plan) -> bool:
    return (p.path / "random_weights.json").is_file()


def make(p: Plan) -> Path:
    """The plan's checkpoint, made once (two sessions asking at once wait for one make); refused, in one line, when
    the disk lacks room for it and its packs."""
    with _locks_lock:
        lock = _locks.setdefault(p.path, threading.Lock())
    with lock:
        if not made(p):
            need, free = ROOM * p.bytes, free_bytes(p.path)
            if need > free:
                raise WorkbenchError(f"{p.path}: no room for {p.label}: it and its packs need about {need / 1e9:.1f} GB, "
                                     f"the disk has {free / 1e9:.1f} GB free")
            make_model(p.shape, p.layers, p.path, experts=p.experts)
    return p.path


def caption(model: str, trace: str | None) -> str | None:
    """What the page says under the runs of a make-model checkpoint (its random_weights.json card, or a GGUF's
    metadata), else None."""
    if str(model).endswith(".gguf"):        # make-model's GGUF: its label is in its metadata
        label = random_label(model)
        return None if label is None else (f"Model: {label}; routing with a real model's statistics (reuse, hot "
                                           f"experts, lookahead recall). {FORCED}")
    card = Path(model) / "random_weights.json"
    if not card.is_file():
        return None
    try:
        c = json.loads(card.read_text())
        what = f"{c['shape']} expert shape ({c['layers']} layers, {c['experts']} experts)"
    except (OSError, ValueError, KeyError, TypeError):
        what = shown(model)
    if trace:
        return f"Model size {what}: RANDOM weights, routing replayed from {shown(trace)}. {FORCED}"
    return (f"Model size {what}: RANDOM weights, routing with a real model's statistics (reuse, hot experts, "
            f"lookahead recall). {FORCED}")


FORCED = ("Forced text: TinyStories validation fed token by token, the model's logits and routing computed at every "
          "step (its own argmax repeats a token or two, and routing with it: runtime/text.py).")
