"""How realistic a checkpoint's own routing is: per-layer expert-usage entropy and LRU hit rates, from a routing
trace or from the checkpoint run on real text in llama.cpp.

    routing_stats(read_trace("data/traces/demo-tinystories-256.parquet")["topk"], 32)
    checkpoint_routing("made.gguf", tokens=256)          # the GGUF's own routing over TinyStories

entropy: the usage distribution's entropy over log(experts), per MoE layer (1 = every expert used equally).
lru_hit: the fraction of routed experts already in a per-layer LRU cache of a fraction of the layer's experts (at
least top-k slots), tokens in order, averaged over layers: what the cache of a streaming engine sees at that size.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

FRACTIONS = (0.1, 0.25, 0.5)


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


def routing_stats(topk: np.ndarray, num_experts: int, fractions=FRACTIONS) -> dict:
    """topk: (T, L, k) experts per token and MoE layer."""
    T, L, k = topk.shape
    entropy = []
    for i in range(L):
        p = np.bincount(topk[:, i].reshape(-1), minlength=num_experts) / (T * k)
        p = p[p > 0]
        entropy.append(float(-(p * np.log(p)).sum() / np.log(num_experts)))
    hits = {f: [lru_hit_rate(topk[:, i], max(k, round(f * num_experts))) for i in range(L)] for f in fractions}
    return {"tokens": T, "layers": L, "experts": num_experts, "top_k": k,
            "entropy": float(np.mean(entropy)), "entropy_layers": [round(e, 4) for e in entropy],
            "lru_hit": {str(f): float(np.mean(h)) for f, h in hits.items()}}


def checkpoint_routing(path, tokens: int = 256, data: str = "tinystories", threads: int = 2) -> dict:
    """The routing statistics of a GGUF's own routing over the first `tokens` of `data`, run in llama.cpp
    (teacher-forced, one batch)."""
    from engines.llamacpp_engine import LlamaCpp
    from workbench.models.gguf_model import GGUFModel
    from workbench.textdata import text_of
    with LlamaCpp(path, n_ctx=tokens + 8, n_batch=tokens, threads=threads, capture=("ffn_moe_topk",)) as llm:
        ids = llm.tokenize(text_of(data)[: tokens * 8])[:tokens]
        llm.reset()
        llm.forward(ids, all_logits=True)
        got = llm.take_captured()
    layers = sorted(int(k.rpartition("-")[2]) for k in got)
    return routing_stats(np.stack([got[f"ffn_moe_topk-{L}"] for L in layers], 1), GGUFModel(path).spec.num_experts)


def table(named: dict) -> str:
    """Markdown rows, one per named statistics dict."""
    fr = list(next(iter(named.values()))["lru_hit"])
    rows = ["| model | experts, top-k | entropy | " + " | ".join(f"LRU hit @ {float(f):.0%}" for f in fr) + " |",
            "|---|---|---|" + "---|" * len(fr)]
    for name, s in named.items():
        rows.append(f"| {name} | {s['experts']}, {s['top_k']} | {s['entropy']:.3f} | "
                    + " | ".join(f"{s['lru_hit'][f]:.3f}" for f in fr) + " |")
    return "\n".join(rows)
