"""The policy interface: what the schedule (workbench/schedule.py) asks a design on every clock.

A design has two parts, each a small class, a start, and optionally a routing of its own:

  Predictor  after a MoE layer routes: which experts to read ahead for later layers (or later tokens)
  Policy     when a pool is full: which expert leaves it (one Policy per pool of the cache, as libCacheSim's
             eviction algorithms are one object per cache)
  start      what is in memory before the prompt: nothing, each layer's most-used experts (`warm`), or a pinned
             hot store (`hot`: a fraction of the budget, colibri's), from held-out usage
  Router     optional, and flagged as changing the model's output: the routing itself (smol's cache-aware bias)

The built-in predictors and policies are written on these same classes and found by name in the registry
(workbench.designs). A design of your own is a file: a Predictor, a Policy or a Design (a named bundle of both over
a base preset), loaded with `--preset path/to/mine.py:Name` (or `--design`, or `package.module:Name`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass
class Setup:
    """What a predictor is given when a run starts."""
    spec: object                    # workbench.spec.MoESpec: layers (spec.moe_layers), experts, top_k
    weights: dict | None = None     # the model's non-expert weights (None: routing replayed from a trace)
    usage: dict | None = None       # {layer: uses per expert} on held-out text (or a trace's held-out half)
    sample: Callable | None = None  # sample() -> {layer: (T, k) experts routed} on that held-out text, or None
    trace: dict | None = None       # the oracle's true routing {(token, layer): experts}
    pack: object = None             # the pack (Edge0's heads are read from beside it)
    exact: Callable | None = None   # the model's own router: exact(layer, logits, bias=None) -> (experts, weights)


class Predictor:
    """Names experts to read ahead. After MoE layer `layer` routes, predict(layer, ctx) returns {target: experts,
    best first}: a target is a later MoE layer of this token, or (layer, token index) of a later token.
    ctx: "phase" ("prefill" | "decode"), "routed" (this layer's experts, an int array: rows x top-k), "engine"
    (its token_index); in a live run also "h" (the residual stream entering the layer), "x", "logits" and "tops"
    (the later routers `routers` asked for).
    A predictor reading "h" says so in `needs`: a trace-driven run (no residual stream) refuses it."""
    params: dict = {}               # its own knobs and their defaults: `--set NAME=VALUE` reaches them
    needs: tuple = ()               # ctx keys beyond phase, routed and engine ("h")
    certain = False                 # its names are the routing (the oracle): they may evict what a guess may not

    @classmethod
    def build(cls, setup: Setup, prefetch, params: dict):
        """The predictor a run uses: prefetch is the preset's setting (workbench.presets.Prefetch: depth, width),
        params the design's (--set)."""
        return cls(setup, **{k: v for k, v in params.items() if k in cls.params})

    def __init__(self, setup: Setup, **params):
        self.setup, self.spec, self._params = setup, setup.spec, params
        for k, v in {**self.params, **params}.items():
            setattr(self, k, type(self.params[k])(v) if k in self.params else v)

    def predict(self, layer: int, ctx: dict) -> dict:
        return {}

    def routers(self, layer: int) -> dict:
        """Later layers' routers this predictor reads on `layer`'s residual stream at decode, {t: (norm, bias, k)}:
        the engine computes each beside the layer's own router, in one call, and hands predict() their k best a
        row (ctx["tops"][t]: layer t's router on h RMS-normed with `norm`, plus `bias`, best first)."""
        return {}

    def reset(self):
        """A cold start: the predictor as it was built, what it learned while running forgotten (a bench's warm-up
        is not the measured run's). Built by this class's __init__, it is built again."""
        if "_params" in vars(self):
            self.__init__(self.setup, **self._params)


class Evictable:
    """The experts of one pool that may leave it now (not pinned, not in use by the current layer, not a read in
    flight): iterate least recently used first, `newest()` most recently used first, `key in evictable`."""

    def __init__(self, pool, protect, pinned, flying: Callable):
        self.pool, self.protect, self.pinned, self.flying = pool, protect, pinned, flying

    def __iter__(self) -> Iterator:
        protect, pinned, flying = self.protect, self.pinned, self.flying
        return (k for k, v in self.pool.items() if k not in protect and k not in pinned and not flying(v))

    def newest(self) -> Iterator:
        return (k for k in reversed(self.pool) if k in self)

    def __contains__(self, key) -> bool:
        return (key in self.pool and key not in self.protect and key not in self.pinned
                and not self.flying(self.pool[key]))


class Policy:
    """Which expert leaves a full pool; LRU unless a subclass says otherwise. Keys are (layer, expert). `step` is
    the cache's clock in layer steps (a step per MoE layer run; `token_of(step)` the token it belongs to)."""
    params: dict = {}

    def __init__(self, capacity: int, layers: int, **params):
        """capacity: the pool's slots; layers: MoE layers in the model (steps per token)."""
        self.capacity, self.layers = capacity, layers
        for k, v in {**self.params, **params}.items():
            setattr(self, k, type(self.params[k])(v) if k in self.params else v)

    def token_of(self, step: int) -> int:
        return max(0, step - 1) // self.layers

    def hit(self, key, step: int):
        """An expert asked for and found in the pool."""

    def inserted(self, key, step: int):
        """An expert given a slot (its read issued, or loaded at the start)."""

    def removed(self, key):
        """An expert left the pool (evicted, or dropped after a failed read)."""

    def demoted(self, key):
        """A prefetch its layer did not ask for: a hint that it may go first."""

    def victim(self, evictable: Evictable, step: int):
        """The expert to evict, one of `evictable`; None: none may go (the read waits)."""
        return next(iter(evictable), None)


class Router:
    """Changes the routing, and so the model's output (its quality cost is measured: evals): route(layer, logits,
    ctx) -> (experts, weights), rows x top-k or fewer columns (the levers: workbench.designs.lossy), in place of the
    exact router. `cache` is the run's expert cache (what is in memory: cache.keys(layer), cache.peek(key)); `exact`
    is the model's own router, with a bias if given.
    A router with a low tier (`low`: its precision, q2 or q3; workbench.low_tier) may return a third array, rows x
    columns of bool: the choices computed from the tier's copy instead of read; the tier holds `low_experts()`."""
    params: dict = {}
    changes_output = True
    low: str | None = None

    def low_experts(self) -> list:
        """The (layer, expert)s the low tier holds: every expert of every MoE layer, unless a router needs fewer."""
        return [(L, e) for L in self.spec.moe_layers for e in range(self.spec.num_experts)]

    def __init__(self, setup: Setup, cache, **params):
        self.setup, self.spec, self.cache = setup, setup.spec, cache
        for k, v in {**self.params, **params}.items():
            setattr(self, k, type(self.params[k])(v) if k in self.params else v)

    def exact(self, layer: int, logits, bias=None):
        return self.setup.exact(layer, logits, bias)

    def route(self, layer: int, logits, ctx: dict):
        return self.exact(layer, logits)


class Design:
    """A named bundle over a base preset: its predictor and policy (classes, or registered names), its start and
    its own parameters. What it leaves as None is the base preset's."""
    base = "les_no_prefetch"        # the preset whose storage and execution it runs with
    predictor: type | str | None = None
    policy: type | str | None = None
    router: type | str | None = None       # changes the model's output: its quality is the teacher's to judge
    warm: bool | None = None        # start from each layer's most-used experts
    hot: float | None = None        # pin this fraction of the budget from held-out usage (colibri's hot store)
    scope: str | None = None        # "global" or "per_layer" pools
    params: dict = {}               # defaults of the parts' parameters
