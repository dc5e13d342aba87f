"""How realistic a routing is: the statistics a streaming engine's cache and prefetch live on, for any trace (a real
model's, a workbench trace, or a checkpoint's own routing of real text run in llama.cpp).

    python -m workbench routing-stats qwen.route.csv --json       # a route_trace v1 CSV (its decode tokens)
    python -m workbench routing-stats t.parquet                   # a workbench trace (`trace`)
    python -m workbench routing-stats made.gguf                   # the GGUF's own routing of TinyStories
    python -m workbench routing-stats demo                        # a model's, exported to a GGUF once

Each statistic is per MoE layer over the first `tokens` tokens (128), then averaged over layers:
  reuse      the fraction of a layer's top-k at token t+1 already in its top-k at t (chance: k / experts)
  lru_hit    the fraction of routed experts already in a per-layer LRU cache of 10 / 15 / 25 / 50% of the layer's
             experts (at least top-k slots), tokens in order, the first token's misses included
  hot_share  the share of routed slots that go to the layer's hottest experts: `hot8_share` its 8 hottest, and
             `hot_share` its hottest sixteenth (8 of 128), which compares layers of different expert counts
  distinct   the experts a layer touches (`distinct_fraction`: of its experts)
  entropy    the usage distribution's entropy over log(experts) (1 = every expert used equally)
  lookahead_recall  where the trace holds lookahead predictions (`pred:lookahead:1:k`, or computed from the router
             inputs and the next layer's router for a GGUF): the fraction of layer j's top-k that layer j+1's router
             named from layer j's input (the layers from the second on)
"""
from __future__ import annotations

import csv
from collections import OrderedDict
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

FRACTIONS = (0.1, 0.15, 0.25, 0.5)
TOKENS = 128
HOT = 8                 # experts in hot8_share; hot_share takes the hottest experts / 16 (8 of 128)
LOOKAHEAD = "lookahead:1:k"
COMPARED = ("reuse", "lru_hit", "hot_share", "distinct_fraction")       # held within a tolerance of a reference


def lru_hit_rate(topk: np.ndarray, slots: int) -> float:
    """topk: (T, k) one layer's experts per token."""
    cache, hits = OrderedDict(), 0
    for row in topk:
        for e in row.tolist():
            if e in cache:
                hits += 1
                cache.move_to_end(e)
        for e in row.tolist():
            cache[e] = True
            cache.move_to_end(e)
        while len(cache) > slots:
            cache.popitem(last=False)
    return hits / topk.size


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(T,) the count of each row of b that its row of a holds (ids >= 0)."""
    return ((a[:, :, None] == b[:, None, :]) & (b[:, None, :] >= 0)).any(1).sum(1)


def routing_stats(topk: np.ndarray, num_experts: int, fractions=FRACTIONS, lookahead: np.ndarray | None = None) -> dict:
    """topk: (T, L, k) experts per token and MoE layer; lookahead: (T, L, k) what lookahead named for each (token,
    layer), -1 where nothing (the first layer)."""
    T, L, k = topk.shape
    E = num_experts
    counts = [np.bincount(topk[:, i].reshape(-1), minlength=E) for i in range(L)]
    entropy = []
    for c in counts:
        p = c[c > 0] / (T * k)
        entropy.append(float(-(p * np.log(p)).sum() / np.log(E)))
    reuse = [float(_overlap(topk[:-1, i], topk[1:, i]).mean() / k) for i in range(L)] if T > 1 else [float("nan")]
    hot = lambda n: float(np.mean([np.sort(c)[::-1][:n].sum() / (T * k) for c in counts]))
    distinct = [int((c > 0).sum()) for c in counts]
    hits = {f: [lru_hit_rate(topk[:, i], max(k, round(f * E))) for i in range(L)] for f in fractions}
    out = {"tokens": T, "layers": L, "experts": E, "top_k": k, "chance_reuse": k / E,
           "reuse": float(np.mean(reuse)), "reuse_layers": [round(r, 4) for r in reuse],
           "lru_hit": {str(f): float(np.mean(h)) for f, h in hits.items()},
           "hot8_share": hot(HOT), "hot_experts": max(1, round(E / 16)), "hot_share": hot(max(1, round(E / 16))),
           "distinct": float(np.mean(distinct)), "distinct_fraction": float(np.mean(distinct)) / E,
           "entropy": float(np.mean(entropy)), "entropy_layers": [round(e, 4) for e in entropy]}
    out["lookahead_recall"], out["lookahead_recall_layers"] = None, []
    if lookahead is not None:
        rows = [j for j in range(L) if (lookahead[:, j] >= 0).any()]
        rec = [float(_overlap(lookahead[:, j, :k], topk[:, j]).mean() / k) for j in rows]
        out["lookahead_recall"] = float(np.mean(rec)) if rec else None
        out["lookahead_recall_layers"] = [round(r, 4) for r in rec]
    return out


def compare(got: dict, ref: dict, tolerance: float = 0.2) -> dict:
    """{statistic: (got, reference, relative difference)} for each statistic COMPARED (every LRU fraction)."""
    out = {}
    for key in COMPARED:
        pairs = got[key].items() if isinstance(got[key], dict) else [(None, got[key])]
        for f, v in pairs:
            r = ref[key][f] if f is not None else ref[key]
            out[f"{key}@{f}" if f else key] = (v, r, abs(v - r) / abs(r))
    return out


# ---------------------------------------------------------------- traces in

def read_route_csv(path, phase: int = 1) -> tuple[np.ndarray, dict]:
    """A route_trace v1 CSV (BigMoeOnEdge's: `#` comment lines naming n_layer, n_expert, n_expert_used; rows turn,
    phase, step, layer, slot, expert, weight, ...) as ((T, L, k) experts of its `phase` tokens (1: decode) in step
    order, {num_experts, top_k, layers, model})."""
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"{path}: no such trace file")
    meta, body, lines = {}, [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if line.startswith("#"):
                meta.update(kv.split("=", 1) for kv in line[1:].split() if "=" in kv and not kv.startswith("layer="))
            elif line.strip():
                body.append(line)
                lines.append(n)
    try:
        L, E, k = (int(meta[n]) for n in ("n_layer", "n_expert", "n_expert_used"))
    except (KeyError, ValueError):
        raise WorkbenchError(f"{path}: not a route_trace v1 CSV (no '# ... n_layer= n_expert= n_expert_used=' "
                             f"header)") from None
    rows = csv.DictReader(body)
    need = {"phase", "step", "layer", "slot", "expert"}
    if not need <= set(rows.fieldnames or ()):
        raise WorkbenchError(f"{path}: the CSV header lacks {sorted(need - set(rows.fieldnames or ()))}")
    got = {}
    for n, r in zip(lines[1:], rows):
        try:
            ph, step, layer, slot, e = (int(r[c]) for c in ("phase", "step", "layer", "slot", "expert"))
        except (TypeError, ValueError):
            raise WorkbenchError(f"{path}: line {n}: a non-integer phase, step, layer, slot or expert") from None
        if not (0 <= layer < L and 0 <= slot < k and 0 <= e < E):
            raise WorkbenchError(f"{path}: line {n}: layer {layer}, slot {slot}, expert {e} outside the header's "
                                 f"{L} layers, top-{k}, {E} experts")
        if ph == phase:
            got.setdefault(step, np.full((L, k), -1, np.int32))[layer, slot] = e
    if not got:
        raise WorkbenchError(f"{path}: no rows of phase {phase}")
    topk = np.stack([got[s] for s in sorted(got)])
    if (topk < 0).any():
        t, j, _ = np.argwhere(topk < 0)[0]
        raise WorkbenchError(f"{path}: step {sorted(got)[t]} layer {j}: fewer than {k} experts routed")
    return topk, {"num_experts": E, "top_k": k, "layers": L, "model": meta.get("model")}


def gguf_routing(path, tokens: int = TOKENS, data: str = "tinystories", threads: int = 2) -> tuple[np.ndarray, dict]:
    """A GGUF's own routing of the first `tokens` of `data` in llama.cpp (teacher-forced, one batch), with what les's
    lookahead names from each layer's router input: ((T, L, k) experts, {num_experts, top_k, lookahead})."""
    from engines.llamacpp_engine import LlamaCpp, capture_trace
    from experiments.routing_trace import named_predictions
    from experiments.traces import _weights_for
    from workbench.models.gguf_model import GGUFModel
    from workbench.textdata import text_of
    spec = GGUFModel(path).spec
    with LlamaCpp(path, n_ctx=64) as llm:
        ids = llm.tokenize(text_of(data)[: tokens * 8])[:tokens]
    tr = capture_trace(path, ids, n_batch=max(64, len(ids)), threads=threads)
    preds = named_predictions(tr, spec, _weights_for({"gguf": str(path)}, None, spec))
    return tr["topk"], {"num_experts": spec.num_experts, "top_k": spec.top_k, "lookahead": preds[LOOKAHEAD]}


def _lookahead(tr: dict) -> np.ndarray | None:
    """What lookahead names for a trace that recorded no predictions, from its router inputs and the routers of the
    model it names; None where that model is not here."""
    from experiments.routing_trace import named_predictions
    from experiments.traces import _weights_for
    from workbench.spec import MoESpec
    spec = MoESpec.from_dict(tr["meta"]["spec"])
    for model in (None, tr["meta"].get("model")):          # the file it was traced from, else the model's name
        try:
            return named_predictions(tr, spec, _weights_for(tr["meta"], model, spec))[LOOKAHEAD]
        except (WorkbenchError, OSError, KeyError):
            continue
    return None


def trace_stats(path, tokens: int = TOKENS, threads: int = 2) -> dict:
    """The statistics of the trace at `path` (a route_trace v1 CSV, a workbench Parquet trace, or a model's own
    routing of TinyStories in llama.cpp: a GGUF, or a model exported to one) over its first `tokens` tokens."""
    p = str(path)
    if p.endswith(".csv"):
        topk, meta = read_route_csv(path)
        la, source = None, "route_trace v1 CSV, decode tokens"
    elif p.endswith(".parquet"):
        from experiments.traces import read_trace
        tr = read_trace(path)
        topk, meta = tr["topk"], tr["meta"]
        la, source = tr["predictions"].get(LOOKAHEAD), "workbench trace"
        if la is None:                       # from its router inputs and the traced model's routers, where it is here
            la = _lookahead(tr)
    else:                                    # a model's own routing: a .gguf, or a model exported to one once
        from engines.llamacpp_engine import resolve_gguf
        from workbench.registry import MODELS
        if not (p.endswith(".gguf") or p in MODELS or Path(p).is_dir()):
            raise WorkbenchError(f"{p}: a routing trace is a route_trace v1 .csv, a workbench .parquet, or a model "
                                 f"(a .gguf, a registered name, a Hugging Face directory or a pack)")
        topk, meta = gguf_routing(resolve_gguf(p, "f16"), tokens, threads=threads)
        la, source = meta["lookahead"], "the model's own routing of TinyStories in llama.cpp"
    topk = topk[:tokens]
    if len(topk) < 2:
        raise WorkbenchError(f"{p}: {len(topk)} token(s); the statistics need at least 2")
    out = routing_stats(topk, int(meta["num_experts"]), lookahead=None if la is None else la[:tokens])
    return {"path": p, "source": source, **out}


def text(s: dict) -> str:
    lru = ", ".join(f"{float(f):.0%} {v:.3f}" for f, v in s["lru_hit"].items())
    la = s.get("lookahead_recall")
    return (f"{s['path']}: {s['tokens']} tokens x {s['layers']} layers, top-{s['top_k']} of {s['experts']} "
            f"({s['source']})\n"
            f"next-token reuse {s['reuse']:.3f} of top-{s['top_k']} (chance {s['chance_reuse']:.3f})\n"
            f"per-layer LRU hit at {lru}\n"
            f"hot share: 8 hottest {s['hot8_share']:.3f}, hottest {s['hot_experts']} {s['hot_share']:.3f}\n"
            f"distinct experts a layer touches {s['distinct']:.1f} ({s['distinct_fraction']:.3f} of its experts)\n"
            f"usage entropy {s['entropy']:.3f}\n"
            f"lookahead recall {'n/a (no predictions in the trace)' if la is None else f'{la:.3f}'}")


def table(named: dict) -> str:
    """Markdown rows, one per named statistics dict."""
    fr = list(next(iter(named.values()))["lru_hit"])
    rows = ["| routing | experts, top-k | reuse | " + " | ".join(f"LRU @ {float(f):.0%}" for f in fr)
            + " | hottest 1/16 share | distinct (of experts) | lookahead recall |",
            "|---|---|---:|" + "---:|" * len(fr) + "---:|---:|---:|"]
    for name, s in named.items():
        la = s.get("lookahead_recall")
        rows.append(f"| {name} | {s['experts']}, {s['top_k']} | {s['reuse']:.3f} | "
                    + " | ".join(f"{s['lru_hit'][f]:.3f}" for f in fr)
                    + f" | {s['hot_share']:.3f} | {s['distinct']:.1f} ({s['distinct_fraction']:.3f}) | "
                    + ("" if la is None else f"{la:.3f}") + " |")
    return "\n".join(rows)
