"""Predictors: which experts will a later layer use? Each returns {target layer: expert ids}.

lookahead(depth, width)  layer L+depth's router, with its own input norm, applied to layer L's
                         residual stream (LES: depth 1; smolmaxxing: depth 2); width k or 2k
history                  the experts the previous token used at the next layer
oracle                   the true routing, replayed from a trace of the same tokens (the bound)
shuffled                 draws from each layer's marginal expert frequencies: no timing (a control)

Predictions are made at decode only; prefill routes exactly and reads what it needs.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from workbench.designs.base import Predictor, Setup
from workbench.routing import topk_rows


def _rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


@njit(cache=True, fastmath=True, nogil=True)
def _norm_then_router(h, norm_w, eps, router, bias, out):
    """out = rows of h, RMS-normed with norm_w, times router^T, plus bias: layer L+depth's router logits on layer
    L's residual. Compiled: it runs at every MoE layer of every token, where half a dozen numpy calls would each pay
    numpy's overhead per call."""
    T, d = h.shape
    x = np.empty(d, np.float32)
    for t in range(T):
        ss = np.float32(0.0)
        for j in range(d):
            ss += h[t, j] * h[t, j]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for j in range(d):
            x[j] = norm_w[j] * (h[t, j] * r)
        for e in range(router.shape[0]):
            acc = np.float32(0.0)
            for j in range(d):
                acc += router[e, j] * x[j]
            out[t, e] = acc + bias[e]


@njit(cache=True, fastmath=True, nogil=True)
def _lookahead(h, norm_w, eps, router, bias, width):
    """The `width` experts layer L+depth's router ranks first on each row of layer L's residual, best first."""
    logits = np.empty((h.shape[0], router.shape[0]), np.float32)
    _norm_then_router(h, norm_w, eps, router, bias, logits)
    top = np.empty((h.shape[0], width), np.int64)
    topk_rows(logits, width, top)
    return top


class Lookahead(Predictor):
    """LES's and smolmaxxing's: layer L+depth's router on layer L's residual."""
    needs = ("h",)

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        return cls(setup.spec, setup.weights, depth=prefetch.depth, width=prefetch.width)

    def __init__(self, spec, weights, depth: int = 1, width: int = 1):
        self.spec, self.w, self.depth = spec, weights, depth
        self.width = spec.top_k * width             # width: in multiples of top-k
        self.moe = spec.moe_layers
        self.eps = np.float32(spec.rms_norm_eps)
        self.targets = {L: t for L in self.moe if (t := self.target(L)) is not None}     # layer -> layer predicted
        self._w32 = {}      # target layer -> its norm and router weights as float32 rows, its selection bias

    def target(self, layer: int):
        i = self.moe.index(layer) + self.depth
        return self.moe[i] if i < len(self.moe) else None

    def _weights(self, t: int):
        """(norm, router, bias) of layer t, made once: the router's bias (a sigmoid_group family's selection bias)
        is zero elsewhere. A router the engine keeps encoded (engines/packed_engine.py: a full-size one in Q8_0)
        stays so, and is None here: predict() computes it in the engine's kernel."""
        if t not in self._w32:
            f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
            router = self.w[f"layers.{t}.router"]
            router = f32(router) if isinstance(router, np.ndarray) else None
            bias = self.w.get(f"layers.{t}.router_bias") if self.spec.router == "sigmoid_group" else None
            experts = self.w[f"layers.{t}.router"].shape[0]
            bias = np.zeros(experts, np.float32) if bias is None else f32(bias).reshape(-1)
            self._w32[t] = (f32(self.w[f"layers.{t}.mlp_norm"]), router, bias)
        return self._w32[t]

    def scores(self, layer: int, h: np.ndarray, target: int) -> np.ndarray:
        """Layer `target`'s router logits (without its selection bias) on `layer`'s residual h."""
        norm, router, _ = self._weights(target)
        h = np.ascontiguousarray(h, dtype=np.float32).reshape(-1, h.shape[-1])
        if router is None:
            router = np.ascontiguousarray(self.w[f"layers.{target}.router"], dtype=np.float32)
        out = np.empty((h.shape[0], router.shape[0]), np.float32)
        _norm_then_router(h, norm, self.eps, router, np.zeros(router.shape[0], np.float32), out)
        return out

    def routers(self, layer: int) -> dict:
        """An encoded router (a full-size one) is the engine's to compute, beside the layer's own; a float32 one (the
        demo's, which stays in cache) predict() computes in _lookahead, one compiled call where the engine's
        decoder would make several numpy ones."""
        t = self.targets.get(layer)
        if t is None:
            return {}
        norm, router, bias = self._weights(t)
        return {t: (norm, bias, self.width)} if router is None else {}

    def predict(self, layer: int, ctx) -> dict:
        t = self.targets.get(layer)
        if t is None or ctx["phase"] != "decode":
            return {}
        top = ctx.get("tops", {}).get(t)        # the engine's, computed beside the layer's own router
        if top is None:
            norm, router, bias = self._weights(t)
            h = ctx["h"]
            h = np.ascontiguousarray(h, dtype=np.float32).reshape(-1, h.shape[-1])
            if router is None:          # encoded: the engine's kernels
                top = ctx["engine"].router_top(h, norm, f"layers.{t}.router", bias, self.width)
            else:
                top = _lookahead(h, norm, self.eps, router, bias, self.width)
        if top.shape[0] == 1:
            return {t: top[0].tolist()}
        return {t: list(dict.fromkeys(top.T.reshape(-1).tolist()))}     # a speculative batch: the rows' union


class History(Predictor):
    """At layer L of token t, the experts token t-1 used at the next MoE layer."""

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        return cls(setup.spec)

    def __init__(self, spec):
        self.moe, self.last = spec.moe_layers, {}

    def reset(self):
        self.last = {}

    def predict(self, layer: int, ctx) -> dict:
        self.last[layer] = np.unique(ctx["routed"][-1]).tolist()
        i = self.moe.index(layer) + 1
        if ctx["phase"] != "decode" or i >= len(self.moe) or self.moe[i] not in self.last:
            return {}
        return {self.moe[i]: self.last[self.moe[i]]}


class Oracle(Predictor):
    """Replays a routing trace {(token index, layer): experts} captured from the same tokens."""
    certain = True          # its prefetches are the routing: they may evict what a guess's may not

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        return cls(setup.spec, setup.trace or {})

    def __init__(self, spec, trace: dict, depth: int = 1):
        self.moe, self.trace, self.depth = spec.moe_layers, trace, depth

    def predict(self, layer: int, ctx) -> dict:
        i = self.moe.index(layer) + self.depth
        if ctx["phase"] != "decode" or i >= len(self.moe):
            return {}
        key = (ctx["engine"].token_index, self.moe[i])
        return {self.moe[i]: self.trace[key]} if key in self.trace else {}


class Shuffled(Predictor):
    """Keeps each layer's marginal expert frequencies (from the usage profile), not the timing."""

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        return cls(setup.spec, setup.usage)

    def __init__(self, spec, usage: dict, seed: int = 0):
        self.moe, self.k = spec.moe_layers, spec.top_k
        self.p = {L: np.asarray(c, np.float64) / max(1, sum(c)) for L, c in usage.items()}
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.rng = np.random.default_rng(self.seed)

    def predict(self, layer: int, ctx) -> dict:
        i = self.moe.index(layer) + 1
        if ctx["phase"] != "decode" or i >= len(self.moe):
            return {}
        t = self.moe[i]
        p = self.p[t]
        k = min(self.k, int((p > 0).sum()))
        return {t: self.rng.choice(len(p), size=k, replace=False, p=p).tolist()}


def recall(predicted, routed) -> float:
    """Fraction of the routed experts that were predicted."""
    routed = set(map(int, routed))
    return len(routed & set(map(int, predicted))) / max(1, len(routed))


class Prerouter(Predictor):
    """Edge0's trained heads, a token ahead (workbench/edge0): built from the heads beside the pack."""
    needs = ("h",)

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        from workbench.edge0.serve import make_prerouter
        return make_prerouter(prefetch.skip_layers, setup.spec, setup.weights, pack=setup.pack)
