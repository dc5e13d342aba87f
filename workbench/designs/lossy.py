"""The lossy levers as routers: each trades the model's output for fewer experts read and computed, and each is the
exact router at its neutral value. Any design takes one: `--set routing=top_k --set k=4`, `--set
routing=drop_misses`. Their quality is the teacher's to judge (evals); a trace, which replays exact routing, refuses
them.

    TopK        fewer experts a token: flash-moe runs Qwen3.5-397B at K=4 of 10 (4.36 tok/s against 1.20 at K=10);
                WARP keeps a table of reduced top-k settings checked by KL
    DropMisses  skip the routed experts not in memory: BigMoeOnEdge, Qwen3.6-35B-A3B on a 16 GB laptop, 4.8 tok/s
                lossless against 7.3 dropping cold experts
"""
from __future__ import annotations

import numpy as np

from workbench.designs.base import Router
from workbench.errors import WorkbenchError


def kept(idx: np.ndarray, w: np.ndarray, n: int) -> tuple:
    """The first n of each row's experts (best first), their weights rescaled to the row's whole sum, so that the
    layer's output keeps its scale."""
    if n >= idx.shape[1]:
        return idx, w
    part = w[:, :n]
    return idx[:, :n], part * (w.sum(1, keepdims=True) / part.sum(1, keepdims=True))


class TopK(Router):
    """The best `k` of the router's top-k (0: all of them), or the fewest whose weights reach `mass` of the top-k's
    (1.0: all; a batch keeps the most any row needs). `k` may name one value per MoE layer ("4,4,3,2,..."): WARP's
    table of reduced top-k per layer."""
    params = {"k": "0", "mass": 1.0}

    def __init__(self, setup, cache, **params):
        super().__init__(setup, cache, **params)
        layers, top = self.spec.moe_layers, self.spec.top_k
        try:
            ks = [int(v) for v in str(self.k).split(",")]
        except ValueError:
            raise WorkbenchError(f"routing top_k: k={self.k} is not a number or one per MoE layer") from None
        if len(ks) not in (1, len(layers)):
            raise WorkbenchError(f"routing top_k: k={self.k} names {len(ks)} values; give one, or one per MoE layer "
                                 f"({len(layers)})")
        if bad := [v for v in ks if not 0 <= v <= top]:
            raise WorkbenchError(f"routing top_k: k={bad[0]} is outside 0..{top} (the model's top-k)")
        self.ks = dict(zip(layers, ks * len(layers) if len(ks) == 1 else ks))
        if not 0.0 < self.mass <= 1.0:
            raise WorkbenchError(f"routing top_k: mass={self.mass:g} is outside (0, 1]")

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        n = self.ks[layer] or idx.shape[1]
        if self.mass < 1.0:
            share = np.cumsum(w, 1) / w.sum(1, keepdims=True)
            n = min(n, int((share < self.mass - 1e-6).sum(1).max()) + 1)
        return kept(idx, w, n)


class DropMisses(Router):
    """A routed expert not in memory when its layer routes is skipped, its weight shared among the rest. The first
    `keep` of a token's experts (best first) are always computed; MoE layers before the `from_layer`-th drop nothing.
    Decode steps only (a prompt's batch reads what it routes to); a read in flight counts as in memory."""
    params = {"keep": 1, "from_layer": 0}

    def __init__(self, setup, cache, **params):
        super().__init__(setup, cache, **params)
        if not 1 <= self.keep <= self.spec.top_k:
            raise WorkbenchError(f"routing drop_misses: keep={self.keep} is outside 1..{self.spec.top_k} (the "
                                 f"model's top-k)")
        if not 0 <= self.from_layer < len(self.spec.moe_layers):
            raise WorkbenchError(f"routing drop_misses: from_layer={self.from_layer} is outside "
                                 f"0..{len(self.spec.moe_layers) - 1} (the model's MoE layers)")
        self.depth = {L: i for i, L in enumerate(self.spec.moe_layers)}

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        if ctx.get("phase") != "decode" or idx.shape[0] != 1 or self.depth[layer] < self.from_layer:
            return idx, w
        held = [j for j, e in enumerate(idx[0]) if j < self.keep or (layer, int(e)) in self.cache]
        if len(held) == idx.shape[1]:
            return idx, w
        order = held + [j for j in range(idx.shape[1]) if j not in held]
        return kept(idx[:, order], w[:, order], len(held))
