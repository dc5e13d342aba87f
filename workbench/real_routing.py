"""Realistic routing statistics, kept in one place: what `info` expects a run to read before any run exists.

LRU_HITS: the fraction of routed experts a per-layer LRU expert cache hits, by the fraction of a layer's experts
it holds, measured on a real model's decode: Qwen3-30B-A3B (Q4_K_M GGUF, top-6 of 128 experts, 48 MoE layers,
128 decode tokens, the first token's misses included), from BigMoeOnEdge's routing trace
(github.com/Helldez/BigMoeOnEdge, docs/bench-data/2026-07-15-route-trace/qwen.route.csv at commit 2d4f2b11db12;
its statistics in ../shared/data/routing/bigmoeonedge-qwen3-30b-a3b/PROVENANCE.md): 10 / 15 / 25 / 50% of a
layer's experts hit 0.52 / 0.66 / 0.81 / 0.91. Between the measured points the curve is taken as linear, to 0 at
an empty cache and 1 at every expert. Another model's routing is only assumed to reuse experts as this one's does:
what `info` prints from it is an expectation, labelled so, not a measurement.
"""
from __future__ import annotations

import numpy as np

LRU_HITS = ((0.0, 0.0), (0.10, 0.52), (0.15, 0.66), (0.25, 0.81), (0.50, 0.91), (1.0, 1.0))
SOURCE = "Qwen3-30B-A3B's per-layer LRU hit curve (BigMoeOnEdge's routing trace; workbench/real_routing.py)"


def lru_hit_rate(fraction: float) -> float:
    """Expected hits of a cache holding `fraction` of each layer's experts (LRU_HITS, interpolated)."""
    xs, ys = zip(*LRU_HITS)
    return float(np.interp(min(max(fraction, 0.0), 1.0), xs, ys))
