"""Routing traces of real models, recorded elsewhere, into the workbench's trace format (experiments/traces.py).

    python -m workbench import-trace qwen.route.csv --out qwen.parquet                 # route_trace v1 CSV
    python -m workbench import-trace routes.jsonl --shape qwen3-30b-a3b --out t.parquet  # the plain format

Two formats are read:

  route_trace v1   BigMoeOnEdge's CSV: `#` lines first (`# route_trace v1`, then `model=... arch=... n_layer=N
                   n_expert=E n_expert_used=K` and one `layer=L expert_bytes=B dense_bytes=D` per layer), a header
                   `turn,phase,step,layer,slot,expert,weight,residency,expert_bytes`, then one row per routed slot
                   (phase 0 prefill, 1 decode; step the token's position in its turn). A prompt token other than
                   the last may lack the last layer (llama.cpp computes it for the last one only): such tokens are
                   left out, and the metadata says how many.
  plain            (token, layer, expert ids best first, weights): a CSV with the header `token,layer,experts,weights`
                   (ids and weights space-separated; the weights column may be left out), or JSON Lines of
                   {"token": 0, "layer": 0, "experts": [..], "weights": [..]}. Every token has every layer 0..L-1
                   once, every row the same number of experts (the top-k). `#` lines are comments.

The spec is the real model's shape (workbench/shapes.py; for route_trace the one whose architecture, layers and
experts match its header, or --shape) with the layers, experts and top-k as traced. A model with no built-in shape
(a Gemma-4-26B-A4B trace, 30 layers x 128 experts, top-6) is imported all the same, as its layers, experts (the
header's, or for the plain format the most it routes to) and top-k: replay, the leaderboard and Belady's bound run
on it with budgets as fractions of its experts; its bytes are not reported (`expert_size` says so), and simulate
asks for --shape. An imported trace holds the
experts and the router's weights, not the router's inputs: designs that need those (les's lookahead, Edge0's
heads) run on it with a modelled prediction (experiments/routing_trace.py). Token ids are unknown (-1).
A malformed file is one line naming it and the row; nothing is written then.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

ROUTE_TRACE_COLUMNS = ["turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes"]


def import_trace(path, out, shape: str | None = None) -> dict:
    """Read `path` (route_trace v1 or the plain format), write the workbench trace to `out`; a summary."""
    from experiments.routing_trace import history_and_oracle
    from experiments.traces import write_trace
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"{path}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.readline().strip()
    if first.startswith("# route_trace"):
        tokens, info = _route_trace(path)
    else:
        tokens, info = _plain(path)
    topk, weights, kept = _assemble(path, tokens, info)
    shape = shape or info.get("shape")
    spec = _spec(path, shape, info["n_layer"], topk.shape[2], info.get("n_expert")) if shape else \
        routing_spec(info["n_layer"], info.get("n_expert") or int(topk.max()) + 1, topk.shape[2])
    if len(spec.moe_layers) != info["n_layer"]:
        raise WorkbenchError(f"{path}: {info['n_layer']} routed layers, but {shape} has dense layers among them")
    if topk.max() >= spec.num_experts:
        raise WorkbenchError(f"{path}: expert {topk.max()} is outside {shape}'s 0..{spec.num_experts - 1}")
    prompt = sum(t["phase"] == 0 for t in tokens.values())
    meta = {"engine": "imported", "model": None, "spec": spec.to_dict(), "shape": shape, "data": None,
            "num_experts": spec.num_experts, "expert_size": "the shape's" if shape else UNSIZED,
            "imported": {"from": str(path), "file": path.name, "sha256": _sha256(path), "format": info["format"],
                         "model": info.get("model"), "tokens": kept, "prompt_tokens": int(prompt),
                         "decode_tokens": int(kept - prompt), "left_out": info.get("left_out", 0),
                         "left_out_why": info.get("left_out_why"), "weights": weights is not None,
                         "expert_bytes": info.get("expert_bytes") or None}}
    trace = {"topk": topk, "weights": weights, "moe_layers": spec.moe_layers}
    write_trace(out, trace, [-1] * topk.shape[0], meta, predictions=history_and_oracle(topk))
    return {"path": str(out), "from": str(path), "format": info["format"], "tokens": int(topk.shape[0]),
            "moe_layers": len(spec.moe_layers), "num_experts": spec.num_experts, "top_k": int(topk.shape[2]),
            "shape": shape, "left_out": info.get("left_out", 0), "weights": weights is not None}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _int(path, row: int, name: str, v: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise WorkbenchError(f"{path}: row {row}: {name} {v!r} is not an integer") from None


def _float(path, row: int, name: str, v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise WorkbenchError(f"{path}: row {row}: {name} {v!r} is not a number") from None
    if not math.isfinite(x):
        raise WorkbenchError(f"{path}: row {row}: {name} {v!r} is not finite")
    return x


# ---------------------------------------------------------------- route_trace v1

def _route_trace(path: Path) -> tuple[dict, dict]:
    """{(turn, step): {"phase", "row", "layers": {layer: (row, [(slot, expert, weight)])}}}, header info."""
    info = {"format": "route_trace v1", "expert_bytes": {}}
    tokens: dict = {}
    header = None
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                if header is not None:
                    raise WorkbenchError(f"{path}: row {n}: a comment after the column header")
                if n == 1:
                    if line.split() != ["#", "route_trace", "v1"]:
                        raise WorkbenchError(f"{path}: row 1: {line!r} is not '# route_trace v1'")
                    continue
                kv = dict(re.findall(r"(\w+)=(\S+)", line))
                if "n_layer" in kv:
                    for key in ("n_layer", "n_expert", "n_expert_used"):
                        if key not in kv:
                            raise WorkbenchError(f"{path}: row {n}: the model line lacks {key}=")
                        info[key] = _int(path, n, key, kv[key])
                    info["model"], info["arch"] = kv.get("model"), kv.get("arch")
                elif "layer" in kv and "expert_bytes" in kv:
                    info["expert_bytes"][_int(path, n, "layer", kv["layer"])] = _int(path, n, "expert_bytes",
                                                                                    kv["expert_bytes"])
                continue
            cells = next(csv.reader([line]))
            if header is None:
                if cells != ROUTE_TRACE_COLUMNS:
                    raise WorkbenchError(f"{path}: row {n}: expected the header {','.join(ROUTE_TRACE_COLUMNS)}")
                if "n_layer" not in info:
                    raise WorkbenchError(f"{path}: row {n}: no '# model=... n_layer=N n_expert=E n_expert_used=K' "
                                         f"line before the header")
                header = cells
                continue
            if len(cells) != len(header):
                raise WorkbenchError(f"{path}: row {n}: {len(cells)} fields, expected {len(header)}")
            turn, phase, step, layer, slot, expert = (_int(path, n, c, v) for c, v in zip(header[:6], cells[:6]))
            weight = _float(path, n, "weight", cells[6])
            if phase not in (0, 1):
                raise WorkbenchError(f"{path}: row {n}: phase {phase} is not 0 (prefill) or 1 (decode)")
            for name, v, top in (("layer", layer, info["n_layer"]), ("slot", slot, info["n_expert_used"]),
                                 ("expert", expert, info["n_expert"])):
                if not 0 <= v < top:
                    raise WorkbenchError(f"{path}: row {n}: {name} {v} is outside 0..{top - 1}")
            tok = tokens.setdefault((turn, step), {"phase": phase, "row": n, "layers": {}})
            if tok["phase"] != phase:
                raise WorkbenchError(f"{path}: row {n}: turn {turn} step {step} is both prefill and decode")
            tok["layers"].setdefault(layer, (n, []))[1].append((slot, expert, weight))
    if header is None:
        raise WorkbenchError(f"{path}: no column header ({','.join(ROUTE_TRACE_COLUMNS)})")
    if not tokens:
        raise WorkbenchError(f"{path}: no rows")
    info["shape"] = _match_shape(info)
    # a prompt token other than the turn's last may lack the last layer (llama.cpp skips it): left out
    last = info["n_layer"] - 1
    short = [key for key, t in tokens.items()
             if t["phase"] == 0 and len(t["layers"]) == last and last not in t["layers"]]
    for key in short:
        del tokens[key]
    info["left_out"] = len(short)
    info["left_out_why"] = (f"{len(short)} prompt tokens without layer {last} (llama.cpp computes the last layer "
                            f"for a prompt's last token only)") if short else None
    info["top_k"] = info["n_expert_used"]
    return {key: tokens[key] for key in sorted(tokens)}, info


UNSIZED = "unknown: no built-in shape (workbench/shapes.py) is this model's, so bytes are not reported"


def routing_spec(n_layer: int, n_expert: int, top_k: int):
    """A trace's own model, where no shape is its: its layers, experts and top-k. Its expert dims are placeholders
    (qwen3-30b-a3b's), which nothing that reports bytes may use: the trace's metadata says `expert_size` UNSIZED,
    and a budget then counts experts (a fraction), never bytes."""
    import dataclasses
    from workbench.shapes import hf_config
    from workbench.spec import from_hf_config
    spec = from_hf_config(hf_config("qwen3-30b-a3b", layers=n_layer, experts=n_expert))
    return dataclasses.replace(spec, top_k=top_k)


def _match_shape(info: dict) -> str | None:
    """The shape (workbench/shapes.py) whose architecture, layers and experts are the header's, if one is."""
    from workbench.shapes import ARCH, SHAPES
    for name, s in SHAPES.items():
        if (ARCH.get(s["arch"]["model_type"]) == info.get("arch") and s["num_hidden_layers"] == info["n_layer"]
                and s["num_experts"] == info["n_expert"]):
            return name
    return None


# ---------------------------------------------------------------- the plain format

def _plain_rows(path: Path, fmt: list):
    """(row number, token, layer, experts, weights | None) of a plain CSV or JSON Lines file (fmt: json | csv)."""
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        lines = [(n, line.strip()) for n, line in enumerate(f, 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise WorkbenchError(f"{path}: no rows")
    fmt.append("json" if lines[0][1].startswith("{") else "csv")
    if fmt == ["json"]:
        for n, line in lines:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkbenchError(f"{path}: row {n}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not {"token", "layer", "experts"} <= set(obj):
                raise WorkbenchError(f"{path}: row {n}: expected an object with token, layer, experts (and weights)")
            experts, weights = obj["experts"], obj.get("weights")
            if not isinstance(experts, list) or (weights is not None and not isinstance(weights, list)):
                raise WorkbenchError(f"{path}: row {n}: experts and weights must be lists")
            yield n, obj["token"], obj["layer"], experts, weights
        return
    n0, head = lines[0]
    cols = next(csv.reader([head]))
    if cols not in (["token", "layer", "experts"], ["token", "layer", "experts", "weights"]):
        raise WorkbenchError(f"{path}: row {n0}: expected the header token,layer,experts,weights (weights optional), "
                             f"or JSON Lines")
    for n, line in lines[1:]:
        cells = next(csv.reader([line]))
        if len(cells) != len(cols):
            raise WorkbenchError(f"{path}: row {n}: {len(cells)} fields, expected {len(cols)}")
        yield n, cells[0], cells[1], cells[2].split(), cells[3].split() if len(cols) == 4 else None


def _plain(path: Path) -> tuple[dict, dict]:
    tokens: dict = {}
    k = with_weights = None
    fmt: list = []
    for n, token, layer, experts, weights in _plain_rows(path, fmt):
        token, layer = _int(path, n, "token", token), _int(path, n, "layer", layer)
        experts = [_int(path, n, "expert", e) for e in experts]
        if not experts:
            raise WorkbenchError(f"{path}: row {n}: no experts")
        k = k or len(experts)
        if len(experts) != k:
            raise WorkbenchError(f"{path}: row {n}: {len(experts)} experts, the rows before have {k} (the top-k)")
        if min(experts) < 0 or layer < 0:
            raise WorkbenchError(f"{path}: row {n}: a negative layer or expert id")
        if with_weights is None:
            with_weights = weights is not None
        if (weights is not None) != with_weights or (weights is not None and len(weights) != k):
            raise WorkbenchError(f"{path}: row {n}: {k} weights expected, as many as experts, on every row or none")
        w = [_float(path, n, "weight", x) for x in weights] if weights is not None else [1.0 / k] * k
        tok = tokens.setdefault(token, {"phase": 1, "row": n, "layers": {}})
        if layer in tok["layers"]:
            raise WorkbenchError(f"{path}: row {n}: token {token} layer {layer} again (first at row "
                                 f"{tok['layers'][layer][0]})")
        tok["layers"][layer] = (n, [(s, e, x) for s, (e, x) in enumerate(zip(experts, w))])
    n_layer = 1 + max(L for t in tokens.values() for L in t["layers"])
    info = {"format": "plain " + ("JSON Lines" if fmt == ["json"] else "CSV"), "n_layer": n_layer, "top_k": k,
            "weights": with_weights}
    return {key: tokens[key] for key in sorted(tokens)}, info


# ---------------------------------------------------------------- both

def _assemble(path, tokens: dict, info: dict) -> tuple[np.ndarray, np.ndarray | None, int]:
    """topk (T, L, k) int32 best first, weights (T, L, k) float32 (None where the file has none), T."""
    NL, k = info["n_layer"], info["top_k"]
    T = len(tokens)
    topk = np.empty((T, NL, k), np.int32)
    weights = np.empty((T, NL, k), np.float32)
    for t, (key, tok) in enumerate(tokens.items()):
        missing = sorted(set(range(NL)) - set(tok["layers"]))
        if missing:
            raise WorkbenchError(f"{path}: row {tok['row']}: token {key} lacks layer{'s' * (len(missing) > 1)} "
                                 f"{', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
        for L, (row, slots) in tok["layers"].items():
            if sorted(s for s, _, _ in slots) != list(range(k)):
                raise WorkbenchError(f"{path}: row {row}: token {key} layer {L} has slots "
                                     f"{sorted(s for s, _, _ in slots)}, expected 0..{k - 1} once each")
            experts = [e for _, e, _ in sorted(slots)]
            if len(set(experts)) != k:
                raise WorkbenchError(f"{path}: row {row}: token {key} layer {L} routes an expert twice: {experts}")
            topk[t, L] = experts
            weights[t, L] = [w for _, _, w in sorted(slots)]
    return topk, (weights if info.get("weights", True) else None), T


def _spec(path, shape: str | None, n_layer: int, top_k: int, n_expert: int | None):
    """The real model's shape with the traced layers, experts (None: the shape's) and top-k."""
    import dataclasses
    from workbench.shapes import SHAPES, hf_config
    from workbench.spec import from_hf_config
    if shape not in SHAPES:
        raise WorkbenchError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    if n_layer > s["num_hidden_layers"] or (n_expert or 0) > s["num_experts"]:
        raise WorkbenchError(f"{path}: {n_layer} layers of {n_expert or s['num_experts']} experts do not fit {shape} "
                             f"({s['num_hidden_layers']} layers of {s['num_experts']})")
    spec = from_hf_config(hf_config(shape, layers=n_layer, experts=n_expert or s["num_experts"]))
    return dataclasses.replace(spec, top_k=top_k)
