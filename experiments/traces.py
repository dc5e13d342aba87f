"""Routing traces: per-token, per-layer routing and router inputs in a Parquet file (replayed by
experiments.routing_trace, experiments.simulate).

    python -m workbench trace --engine llamacpp --model X.gguf --data tinystories --tokens 512 --out t.parquet
    python -m workbench replay t.parquet --preset les --budget 0.25 --json

A trace has one row per (token, MoE layer): token (index in the traced text), token_id, layer,
topk (the experts chosen, best first), logits (the router's logits over all experts) and router_input
(the residual stream entering the MoE block: llama.cpp's `ffn_inp-N`, the numpy engine's `h`).
The file's schema metadata (`workbench.trace`) holds the engine, the model, the spec and the data.
An imported trace (`import-trace`: a real model's routing recorded elsewhere, experiments/import_trace.py) has no
logits or router_input (read back as None) and carries `weights` (the router's mixing weights of the top-k, in its
order); its metadata says `"imported": {...}` and where from.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from runtime.capture import RoutingCapture
from workbench.errors import WorkbenchError
from workbench.runs import write_table
from workbench.spec import MoESpec

META_KEY = b"workbench.trace"


# ---------------------------------------------------------------- file format

def write_trace(path, trace: dict, ids: list[int], meta: dict, predictions: dict | None = None,
                drafts: np.ndarray | None = None) -> Path:
    """trace: topk (T, L, k), logits (T, L, E), router_input (T, L, d), moe_layers; optionally weights (T, L, k),
    the router's mixing weights of topk. logits and router_input may be None (an imported trace: its metadata names
    num_experts). Written atomically.
    predictions: {predictor: (T, L, width) expert ids, -1 = none} (experiments/routing_trace.py), one column each.
    drafts: (T, n) the speculative draft proposed after each token (-1 = none), in every row of that token."""
    import pyarrow as pa
    topk = np.asarray(trace["topk"])
    logits, h, weights = (None if trace.get(k) is None else np.asarray(trace[k])
                          for k in ("logits", "router_input", "weights"))
    T, NL, k = topk.shape
    layers = np.asarray(trace["moe_layers"], np.int16)
    E = logits.shape[2] if logits is not None else meta["num_experts"]
    d = h.shape[2] if h is not None else None

    def fixed(a, n, typ):
        return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).reshape(-1), typ), n)

    table = pa.table({
        "token": pa.array(np.repeat(np.arange(T, dtype=np.int32), NL)),
        "token_id": pa.array(np.repeat(np.asarray(ids, np.int32), NL)),
        "layer": pa.array(np.tile(layers, T)),
        "topk": fixed(topk.astype(np.int32), k, pa.int32()),
        **({"logits": fixed(logits.astype(np.float32), E, pa.float32())} if logits is not None else {}),
        **({"router_input": fixed(h.astype(np.float32), d, pa.float32())} if h is not None else {}),
        **({"weights": fixed(weights.astype(np.float32), k, pa.float32())} if weights is not None else {}),
        **{f"pred:{name}": fixed(np.asarray(a, np.int32), a.shape[2], pa.int32()) for name, a in (predictions or {}).items()},
        **({"draft": fixed(np.repeat(np.asarray(drafts, np.int32), NL, 0), drafts.shape[1], pa.int32())}
           if drafts is not None else {}),
    })
    meta = {**meta, "n_tokens": T, "moe_layers": layers.tolist(), "top_k": k, "num_experts": E, "hidden_size": d,
            "predictions": sorted(predictions or {}), "draft": None if drafts is None else int(drafts.shape[1]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    return write_table(table, path)


def read_trace(path) -> dict:
    import pyarrow.parquet as pq
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"{path}: no such trace file")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise WorkbenchError(f"{path}: not a readable Parquet file ({e})") from None
    md = table.schema.metadata or {}
    if META_KEY not in md:
        raise WorkbenchError(f"{path}: not a workbench routing trace (no {META_KEY.decode()} metadata)")
    meta = json.loads(md[META_KEY])
    T, layers = meta["n_tokens"], meta["moe_layers"]
    NL = len(layers)

    def col(name, n):
        c = table.column(name).combine_chunks()
        return np.asarray(c.flatten()).reshape(T, NL, n)

    have = lambda name: name in table.column_names
    return {"meta": meta, "moe_layers": layers, "ids": np.asarray(table.column("token_id"))[::NL].tolist(),
            "topk": col("topk", meta["top_k"]),
            "logits": col("logits", meta["num_experts"]) if have("logits") else None,
            "router_input": col("router_input", meta["hidden_size"]) if have("router_input") else None,
            "weights": col("weights", meta["top_k"]) if have("weights") else None,
            "predictions": {n: col(f"pred:{n}", table.schema.field(f"pred:{n}").type.list_size)
                            for n in meta.get("predictions", [])},
            "drafts": col("draft", meta["draft"])[:, 0] if meta.get("draft") else None}


# ---------------------------------------------------------------- capture with the numpy engine

def capture_numpy(model: str, ids: list[int], preset: str = "teacher") -> tuple[dict, dict]:
    """The workbench engine's own routing on `ids` (one teacher-forced batch, every expert resident)."""
    from runtime.session import open_session
    with open_session(model, preset, budget="all") as s, RoutingCapture(s, keep=("logits", "h")) as cap:
        s.engine.reset()
        s.step(ids, "prefill")
        layers = s.spec.moe_layers
        rec = {r["layer"]: r for r in cap.records}
        trace = {"topk": np.stack([rec[L]["idx"] for L in layers], 1),
                 "logits": np.stack([rec[L]["logits"] for L in layers], 1),
                 "router_input": np.stack([rec[L]["h"] for L in layers], 1), "moe_layers": layers}
        meta = {"engine": "numpy", "model": model, "pack": str(s.pack_path), "preset": s.preset.name,
                "spec": s.spec.to_dict()}
    return trace, meta


# ---------------------------------------------------------------- replay

def _weights_for(meta: dict, model: str | None, spec: MoESpec) -> dict:
    """The norms and routers of the traced model (for lookahead scores)."""
    ref = model or meta.get("gguf") or meta.get("pack") or meta.get("model")
    if not ref:
        raise WorkbenchError("the trace names no model: pass --model for lookahead weights")
    need = [f"layers.{L}.{n}" for L in spec.moe_layers for n in ("router", "mlp_norm", "router_bias")]
    if str(ref).endswith(".gguf"):
        from workbench.models.gguf_model import GGUFModel
        src = GGUFModel(ref)
        have = set(src.names())
        return {n: src.tensor(n) for n in need if n in have}
    from workbench.registry import is_pack, model_dir
    p = model_dir(str(ref))
    if is_pack(p):
        from workbench.store.pack import Pack
        pack = Pack(p)
        return {n: pack.tensor(n) for n in need if n in pack.tensors}
    from workbench.models.hf import HFModel
    hf = HFModel(p)
    return {n: hf.tensor(n) for n in need if n in hf.where}


def near_ties(logits: np.ndarray, topk: np.ndarray, k: int) -> dict:
    """Rows whose recorded top-k is not the top-k of the recorded logits, and the smallest k-th/(k+1)-th gap."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    mine = np.sort(order[..., :k], -1)
    theirs = np.sort(topk, -1)
    s = np.sort(logits, -1)
    gap = s[..., -k] - s[..., -k - 1] if logits.shape[-1] > k else np.full(logits.shape[:-1], np.inf)
    mism = (mine != theirs).any(-1)
    return {"rows": int(mism.size), "topk_vs_logits_mismatch": int(mism.sum()), "min_gap": float(gap.min()),
            "max_gap_where_mismatch": float(gap[mism].max()) if mism.any() else None}
