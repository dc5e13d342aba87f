"""The lossy levers as routers: each trades the model's output for fewer experts read and computed, and each is the
exact router at its neutral value. Any design takes one: `--set routing=top_k --set k=4`, `--set
routing=drop_misses`. Their quality is the teacher's to judge (evals); a trace, which replays exact routing, refuses
them.

    TopK        fewer experts a token: flash-moe runs Qwen3.5-397B at K=4 of 10 (4.36 tok/s against 1.20 at K=10);
                WARP keeps a table of reduced top-k settings checked by KL
    DropMisses  skip the routed experts not in memory: BigMoeOnEdge, Qwen3.6-35B-A3B on a 16 GB laptop, 4.8 tok/s
                lossless against 7.3 dropping cold experts
    LowOnMiss   compute a missed expert from a resident q2 copy instead of reading it: HOBBIT (mixed-precision
                expert offloading, arXiv 2411.01433)
    LowByHotness  the most used experts at the pack's precision, the rest from a resident q2 copy: HOBBIT's and
                the field's precision by hotness
"""
from __future__ import annotations

import numpy as np

from workbench.designs.base import Router
from workbench.errors import WorkbenchError
from workbench.low_tier import LOW


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

    def missed(self, layer: int, idx: np.ndarray, ctx: dict) -> np.ndarray | None:
        """Which of a decode step's choices are not in memory (past the first `keep`, from the `from_layer`-th MoE
        layer on): rows x columns of bool, None where none is or the lever does not act."""
        if ctx.get("phase") != "decode" or idx.shape[0] != 1 or self.depth[layer] < self.from_layer:
            return None
        cache, keep = self.cache, self.keep
        m = np.array([[j >= keep and (layer, int(e)) not in cache for j, e in enumerate(idx[0])]])
        return m if m.any() else None

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        m = self.missed(layer, idx, ctx)
        if m is None:
            return idx, w
        order = np.concatenate([np.flatnonzero(~m[0]), np.flatnonzero(m[0])])
        return kept(idx[:, order], w[:, order], int((~m[0]).sum()))


def low_precision(router) -> str:
    if router.low not in LOW:
        raise WorkbenchError(f"routing {type(router).__name__}: low={router.low} is not a low tier's precision; "
                             f"choose {' or '.join(LOW)}")
    return router.low


class LowOnMiss(DropMisses):
    """A routed expert not in memory when its layer routes is computed from its resident low-precision copy (the
    low tier, workbench.low_tier) instead of read: HOBBIT's. `keep` and `from_layer` as drop_misses's."""
    params = {**DropMisses.params, "low": "q2"}

    def __init__(self, setup, cache, **params):
        super().__init__(setup, cache, **params)
        low_precision(self)

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        m = self.missed(layer, idx, ctx)
        return (idx, w) if m is None else (idx, w, m)


class LowByHotness(Router):
    """Precision by hotness: each layer's `hottest` share of its experts, the most used on held-out text, at the pack's
    precision (streamed through the cache); the rest always computed from their resident low-precision copy (the
    low tier holds only those). hottest=1: every expert at the pack's precision."""
    params = {"hottest": 0.5, "low": "q2"}

    def __init__(self, setup, cache, **params):
        super().__init__(setup, cache, **params)
        low_precision(self)
        if not 0.0 <= self.hottest <= 1.0:
            raise WorkbenchError(f"routing low_by_hotness: hottest={self.hottest:g} is outside [0, 1]")
        E = self.spec.num_experts
        usage = setup.usage or {L: np.bincount(np.asarray(t).ravel(), minlength=E) for L, t in setup.sample().items()}
        n = round(self.hottest * E)
        self.cold = {L: np.ones(E, bool) for L in self.spec.moe_layers}
        for L in self.spec.moe_layers:
            self.cold[L][np.argsort(-np.asarray(usage[L], np.float64), kind="stable")[:n]] = False

    def low_experts(self):
        return [(L, int(e)) for L, c in self.cold.items() for e in np.flatnonzero(c)]

    def route(self, layer, logits, ctx):
        idx, w = self.exact(layer, logits)
        m = self.cold[layer][idx]
        return (idx, w, m) if m.any() else (idx, w)
