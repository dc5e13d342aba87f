"""What a live page that strangers can reach may do (docs/booth.md).

Booth mode is a kiosk: it takes names, never paths. Models: the registered ones and the one the operator named at
start-up; routing traces: data/traces/ and the operator's; model sizes: the shapes already made on this machine;
devices: data/devices. A round shows at most MAX_DESIGNS designs of at most max(MAX_TOKENS, the operator's) tokens.
The sidebar page takes free-text paths, but while the server listens beyond this machine they must lie under the
allowed roots (`roots`). The operator's choices reach every session in a booth file (BOOTH_ENV, written by
`python -m dashboards.booth`), with the status of what it prepares before the first round.
"""
from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dashboards import model_size as M
from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError
from workbench.presets import PRESETS
from workbench.registry import MODELS, cache_dir

BOOTH_ENV = "WORKBENCH_BOOTH"        # the booth file: the server is a kiosk, every page of it in booth mode
ALLOW_ENV = "WORKBENCH_ALLOW"        # more roots for the sidebar page's paths, os.pathsep between them
TRACES = M.REPO / "data" / "traces"
MAX_TOKENS = 256
MAX_DESIGNS = 4


@dataclass(frozen=True)
class Booth:
    """The operator's program: what a round shows unless the URL picks another entry of the allow-list."""
    model: str = "demo"                  # a registered name, or the name of `models`' one entry
    models: dict = field(default_factory=dict)     # {name: path} the operator named
    trace: str | None = None             # a name in traces()
    traces: dict = field(default_factory=dict)     # {name: path} the operator named
    shape: str | None = None
    device: str | None = None
    designs: tuple = ()                  # () alternates the two comparisons of common.booth_round
    lever: str | None = None             # a lossy lever (common.LEVERS) beside each design, the teacher judging both
    tokens: int = 48
    pause: float = 6.0
    status: str | None = None            # the preparation's status file (None: nothing to wait for)


def load() -> Booth | None:
    """The booth file named by BOOTH_ENV, or None when the server is not a kiosk."""
    path = os.environ.get(BOOTH_ENV)
    if not path:
        return None
    try:
        d = json.loads(Path(path).read_text())
        d["designs"] = tuple(d.get("designs", ()))
        return Booth(**d)
    except (OSError, ValueError, TypeError) as e:
        raise WorkbenchError(f"{path}: not a booth file ({e})") from None


def write(booth: Booth, path) -> Path:
    return atomic_write(path, json.dumps(asdict(booth), indent=1))


def status(booth: Booth | None) -> dict | None:
    """The preparation's state: {"state": "preparing" | "ready", "step", "done", "total"}; None when there is none."""
    if booth is None or not booth.status:
        return None
    try:
        return json.loads(Path(booth.status).read_text())
    except (OSError, ValueError):
        return {"state": "preparing", "step": "starting", "done": 0, "total": 1}


def set_status(booth: Booth, **st):
    atomic_write(booth.status, json.dumps(st))


# ---------------------------------------------------------------- the allow-list

def models(booth: Booth) -> dict[str, str]:
    return {**{k: str(v) for k, v in MODELS.items()}, **booth.models}


def traces(booth: Booth) -> dict[str, str]:
    return {**{p.stem: str(p) for p in sorted(TRACES.glob("*.parquet"))}, **booth.traces}


def roots(booth: Booth | None = None) -> list[Path]:
    """Where the sidebar page may open models and traces while it listens beyond this machine: the registered
    models, data/traces/, the model sizes' checkpoints in the workbench cache, what the operator named."""
    named = [*(booth.models.values() if booth else ()), *(booth.traces.values() if booth else ()),
             *filter(None, os.environ.get(ALLOW_ENV, "").split(os.pathsep))]
    return [Path(p).expanduser().resolve() for p in [*MODELS.values(), TRACES, cache_dir() / "models", *named]]


def is_local(address: str | None) -> bool:
    """Whether a server bound to `address` is reachable from this machine only (Streamlit's unset address, or
    0.0.0.0 / ::, listens on every interface)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address or "0.0.0.0").is_loopback
    except ValueError:
        return False


def check_path(path: str, what: str, booth: Booth | None = None):
    """Refuse, in one line, a path outside roots() (symbolic links and '..' resolved first); a registered name
    passes."""
    if path in MODELS or (booth and path in booth.models):
        return
    p = Path(path).expanduser().resolve()
    allowed = roots(booth)
    if not any(p == r or p.is_relative_to(r) for r in allowed):
        raise WorkbenchError(f"{what} {path}: outside the folders this page opens while it listens beyond this "
                             f"machine ({', '.join(M.shown(r) for r in allowed)}); the operator adds one with "
                             f"{ALLOW_ENV}=DIR at start-up")


def settings(query, booth: Booth) -> tuple[dict, list[str]]:
    """A booth round's settings: the operator's program, with what the URL picks from the allow-list
    (designs, tokens, pause, model, trace, shape, device, lever). The notes say what was ignored, and why."""
    from dashboards.common import LEVERS
    from workbench.devices import names
    notes: list[str] = []

    def pick(key, allowed: dict | list, default):
        v = query.get(key)
        if not v:
            return default
        if v in allowed:
            return v
        notes.append(f"{key}={v!r} ignored: not one this booth shows (one of {', '.join(allowed) or 'none'})")
        return default

    designs = [d for d in query.get("designs", "").split(",") if d] or list(booth.designs)
    unknown = [d for d in designs if d not in PRESETS]
    if unknown:
        notes.append(f"designs {', '.join(map(repr, unknown))} ignored: not presets")
    designs = list(dict.fromkeys(d for d in designs if d in PRESETS))
    if len(designs) > MAX_DESIGNS:
        notes.append(f"designs: the first {MAX_DESIGNS} shown (a round shows at most {MAX_DESIGNS})")
        designs = designs[:MAX_DESIGNS]
    cap = max(MAX_TOKENS, booth.tokens)
    try:
        tokens, pause = int(query.get("tokens", booth.tokens)), float(query.get("pause", booth.pause))
    except ValueError:
        notes.append("tokens and pause must be numbers: the booth's own used")
        tokens, pause = booth.tokens, booth.pause
    if tokens > cap:
        notes.append(f"tokens={tokens} capped at {cap}")
    known = models(booth)
    name = pick("model", known, booth.model)
    trace_name = pick("trace", traces(booth), booth.trace)
    trace = traces(booth).get(trace_name) if trace_name else None
    device = pick("device", names(), booth.device)
    cfg = {"model": booth.models.get(name, name), "designs": designs, "tokens": min(cap, max(1, tokens)),
           "pause": min(600.0, max(0.0, pause)), "device": None if device == "this-machine" else device,
           "routing_trace": trace}
    shape = query.get("shape") or booth.shape
    if shape and shape != M.DEMO:
        try:
            plan = M.plan(shape, trace)
            if not M.made(plan):
                raise WorkbenchError(f"not made on this machine (python -m dashboards.booth --shape {shape} makes "
                                     "it before the booth opens)")
            cfg["model"], cfg["routing_trace"] = str(plan.path), plan.trace
        except WorkbenchError as e:
            notes.append(f"shape={shape!r} ignored ({e}); the model is {M.shown(cfg['model'])}")
    cfg["lever"] = pick("lever", list(LEVERS), booth.lever)
    if cfg["lever"] and cfg["routing_trace"]:
        notes.append(f"lever={cfg['lever']!r} ignored: a lever needs the model's own weights and routing, not a trace")
        cfg["lever"] = None
    if cfg["lever"] and len(cfg["designs"]) > MAX_DESIGNS // 2:
        notes.append(f"designs: the first {MAX_DESIGNS // 2} shown (each runs twice beside its lever)")
        cfg["designs"] = cfg["designs"][:MAX_DESIGNS // 2]
    return cfg, notes
