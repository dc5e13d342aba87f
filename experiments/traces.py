"""Routing traces: per-token, per-layer routing and router inputs in a Parquet file, and a replay that
simulates the expert cache for each design without running the model.

    python -m workbench trace --engine llamacpp --model X.gguf --data tinystories --tokens 512 --out t.parquet
    python -m workbench replay t.parquet --preset les --budget 0.25 --json

A trace has one row per (token, MoE layer): token (index in the traced text), token_id, layer,
topk (the experts chosen, best first), logits (the router's logits over all experts) and router_input
(the residual stream entering the MoE block: llama.cpp's `ffn_inp-N`, the numpy engine's `h`).
The file's schema metadata (`workbench.trace`) holds the engine, the model, the spec and the data.
An imported trace (`import-trace`: a real model's routing recorded elsewhere, experiments/import_trace.py) has no
logits or router_input (read back as None) and carries `weights` (the router's mixing weights of the top-k, in its
order); its metadata says `"imported": {...}` and where from.

Replay: the cache holds the slots the budget buys in --engine's cache (the default engine's, as bench's Session:
engines.expert_bytes, Budget.slots). Every token is a decode step through the MoE layers in order, as in the
engine: a layer's routed experts are hits if already in the cache (else read: a miss); the design's predictor then names
experts of a later layer, which are prefetched without evicting the current layer's. Prefetches are
assumed to land in time (no timing is simulated), so hit rates are upper bounds for a design's
scheduling; recall/precision are exact. Designs (predictors from workbench.predict, same code as the
engine): on_demand (none), history, shuffled (marginals of this trace: in-sample), lookahead (the
preset's lookahead, else 1 layer ahead at 2k; scored from the recorded router inputs with the next
layer's norm and router read from the traced model), oracle (the recorded routing one layer ahead).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from workbench.cache import GuessAdmission, reserve_ahead, warm_set
from runtime.capture import RoutingCapture
from workbench.errors import WorkbenchError
from workbench.presets import Budget, Predictor, Prefetch
from workbench.runs import write_table
from workbench.spec import MoESpec
from workbench.telemetry import rates

META_KEY = b"workbench.trace"
DESIGNS = ("on_demand", "history", "shuffled", "lookahead", "oracle")


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
    from runtime.session import Session
    with Session(model, preset, budget="all") as s, RoutingCapture(s, keep=("logits", "h")) as cap:
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


class _Ctx:
    token_index = 0


def _predictor(design: str, preset, spec, weights, trace: dict, usage: dict):
    from workbench.predict import make_predictor
    if design == "on_demand":
        return None
    if design == "lookahead":
        pf = preset.prefetch if preset.prefetch.predictor is Predictor.LOOKAHEAD else \
            Prefetch(Predictor.LOOKAHEAD, depth=1, width=2)
    else:
        pf = Prefetch(Predictor(design))
    layers, topk = trace["moe_layers"], trace["topk"]
    oracle = {(t, L): sorted(set(topk[t, j].tolist())) for t in range(topk.shape[0]) for j, L in enumerate(layers)} \
        if design == "oracle" else None
    return make_predictor(pf, spec, weights, usage=usage, trace=oracle)


def simulate(design: str, trace: dict, spec: MoESpec, preset, budget: str, weights: dict, usage: dict,
             skip: int = 0, engine: str | None = None) -> dict:
    """One design over the whole trace; counts from token `skip` on (earlier tokens only warm the cache). The budget
    buys the slots it buys `engine`'s cache (None: the default engine) for the preset's pack of the traced model."""
    from engines import expert_bytes
    from workbench.cache import ExpertCache
    layers, topk, h = trace["moe_layers"], trace["topk"], trace["router_input"]
    T = topk.shape[0]
    item, n_experts = expert_bytes(engine, spec, preset.storage), spec.num_experts * len(layers)
    budget_bytes = Budget(budget).nbytes(item, n_experts)
    cache = ExpertCache(Budget(budget).slots(item, n_experts), item, layers, policy=preset.cache.policy.value,
                        scope=preset.cache.scope.value, min_slots_per_layer=spec.top_k)
    if preset.cache.warm:                                 # the most-used experts of each layer (this trace's counts)
        for k in warm_set(cache, usage):
            cache.reserve(k, True)
    pred = _predictor(design, preset, spec, weights, trace, usage)
    admission = GuessAdmission(len(layers))                # as the streamer's prefetches
    ectx = _Ctx()
    predicted_for: dict = {}
    outstanding: dict = {}                                 # prefetched key -> target token, not yet used
    n = dict(hits=0, routed=0, predicted=0, predicted_used=0, pred_routed=0, issued=0, wasted=0, misses=0)
    for t in range(T):
        ectx.token_index = t
        count = t >= skip
        for j, L in enumerate(layers):
            cache.step()
            routed = sorted(set(topk[t, j].tolist()))
            keys = [(L, e) for e in routed]
            hits = sum(k in cache for k in keys)
            for k in keys:
                admission.asked_for(k in cache, k in outstanding)
            p = predicted_for.pop((L, t), None)
            if p is not None:
                admission.scored(p, routed)
            if count:
                n["hits"] += hits
                n["misses"] += len(keys) - hits
                n["routed"] += len(keys)
                if p is not None:
                    used = len(set(p) & set(routed))
                    n["predicted"] += len(p)
                    n["predicted_used"] += used
                    n["pred_routed"] += len(routed)
            for k in keys:
                outstanding.pop(k, None)
            for k in [k for k, tt in outstanding.items() if k[0] == L and tt <= t]:
                outstanding.pop(k)
                n["wasted"] += count
            if pred is not None:
                ctx = {"phase": "decode", "h": h[t, j][None].astype(np.float32), "routed": topk[t, j][None],
                       "engine": ectx}
                protect = set(keys)
                for target, experts in pred.predict(L, ctx).items():
                    experts = list(map(int, experts))
                    predicted_for[(target, t)] = experts
                    certain = getattr(pred, "certain", False)
                    if not (certain or admission.admit()):
                        continue
                    spare = 0 if certain else admission.spare()
                    for key in reserve_ahead(cache, [(target, e) for e in experts], True, protect, spare):
                        outstanding[key] = t
                        n["issued"] += count
            for k in keys:                                # the layer's misses are read now (never evicting its own)
                if cache.get(k) is None and not cache.reserve(k, True, set(keys)):
                    raise WorkbenchError(f"budget {budget}: no slot for {k} (pinned experts fill the cache)")
    steps = max(1, T - skip)
    return {"design": design, **rates(n["hits"], 0, n["misses"]),    # every prefetch lands in time here: no late
            "recall": n["predicted_used"] / n["pred_routed"] if n["predicted"] else None,
            "precision": n["predicted_used"] / n["predicted"] if n["predicted"] else None,
            "misses_per_token": n["misses"] / steps, "prefetch_per_token": n["issued"] / steps,
            "reads_per_token": (n["misses"] + n["issued"]) / steps, "prefetch_wasted": n["wasted"],
            "routed": n["routed"], "hits": n["hits"], "cache_slots": cache.capacity[layers[0]],
            "budget_bytes": budget_bytes}


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


def replay(path, preset: str = "les", budget: str | None = None, model: str | None = None,
           designs=DESIGNS, skip: int = 0, engine: str | None = None) -> dict:
    from workbench.presets import get_preset
    tr = read_trace(path)
    meta = tr["meta"]
    spec = MoESpec.from_dict(meta["spec"])
    if list(spec.moe_layers) != list(tr["moe_layers"]):
        raise WorkbenchError(f"{path}: the trace's layers {tr['moe_layers']} are not the spec's MoE layers")
    p = get_preset(preset)
    budget = str(budget if budget is not None else p.cache.budget)
    usage = {L: np.bincount(tr["topk"][:, j].reshape(-1), minlength=spec.num_experts).tolist()
             for j, L in enumerate(tr["moe_layers"])}
    weights = {}
    if "lookahead" in designs:
        weights = _weights_for(meta, model, spec)
        # the traced router, recomputed from the recorded inputs: a check that these are the traced weights
        from workbench.predict import _rms
        j, L = 0, tr["moe_layers"][0]
        mine = _rms(tr["router_input"][:, j], weights[f"layers.{L}.mlp_norm"], spec.rms_norm_eps) @ weights[f"layers.{L}.router"].T
        check = float(np.abs(mine - tr["logits"][:, j]).max())
    else:
        check = None
    from engines import default_engine
    engine = engine or default_engine()
    rows = [simulate(d, tr, spec, p, budget, weights, usage, skip=skip, engine=engine) for d in designs]
    return {"trace": str(path), "engine": meta.get("engine"), "model": meta.get("gguf") or meta.get("model"),
            "tokens": len(tr["ids"]), "skip": skip, "preset": p.name, "budget": budget, "cache_engine": engine,
            "cache_policy": p.cache.policy.value, "cache_scope": p.cache.scope.value, "warm": p.cache.warm,
            "router_recompute_max_abs": check, "routing_check": near_ties(tr["logits"], tr["topk"], spec.top_k),
            "designs": rows}


def table(res: dict) -> str:
    lines = [f"replay of {res['trace']} ({res['engine']}, {res['tokens']} tokens) preset {res['preset']}, "
             f"budget {res['budget']} ({res['designs'][0]['cache_slots']} slots of the {res['cache_engine']} engine's cache)",
             f"{'design':12} {'hit':>6} {'recall':>7} {'precision':>9} {'miss/tok':>9} {'prefetch/tok':>12}"]
    for r in res["designs"]:
        f = lambda v: "" if v is None else f"{v:.3f}"
        lines.append(f"{r['design']:12} {r['hit_rate']:6.3f} {f(r['recall']):>7} {f(r['precision']):>9} "
                     f"{r['misses_per_token']:9.2f} {r['prefetch_per_token']:12.2f}")
    return "\n".join(lines)
