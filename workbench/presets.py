"""Designs as presets: named settings of the shared knobs, one frozen dataclass per concern.

Every string a preset is written in ("lookahead:2:k", "cache_bias:0.05", "prerouter:nolora", "96MiB") is
parsed here and nowhere else, and a combination that cannot work is refused when the preset is built.
Each field names the code that consumes it:

  storage    layout, experts, rest       the pack (workbench.store.pack.convert, workbench.registry.resolve_pack)
  cache      budget, policy, scope, warm the expert cache (workbench.cache.ExpertCache, Session.warm_start)
  prefetch   predictor, depth, width,    which later experts to read ahead (workbench.predict.make_predictor,
             skip_layers                 workbench.edge0.serve.make_prerouter)
  routing    router, beta, lora          who routes (Session._routing: exact, cache-aware bias, the prerouter)
  execution  order, speculative, draft   the streamer's order of compute (workbench.streamer.ExpertStreamer) and
                                         draft tokens verified per step and what drafts them (runtime.speculative)

`Preset.with_(layout=..., predictor="lookahead:1:2k", ...)` takes the flat knob names of `to_dict()` (the form
run records keep) and parses them here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from enum import Enum

from workbench.errors import WorkbenchError


class Layout(str, Enum):
    CONTIGUOUS = "contiguous"       # an expert's three matrices adjacent on disk: one read
    NATIVE = "native"               # the checkpoint's order: three reads per expert


class CacheScope(str, Enum):
    GLOBAL = "global"
    PER_LAYER = "per_layer"         # the smolmaxxing pager's per-layer pools


class Predictor(str, Enum):
    """The predictors the presets' wiring names (their classes, and every other predictor, are found by name in the
    registry: workbench.designs.PREDICTORS)."""
    LOOKAHEAD = "lookahead"         # layer L+depth's router on layer L's residual (LES, smolmaxxing)
    HISTORY = "history"             # the previous token's experts
    ORACLE = "oracle"               # the true routing, replayed from a trace (the bound)
    SHUFFLED = "shuffled"           # draws from each layer's marginal frequencies (a control)
    PREROUTER = "prerouter"         # Edge0's trained heads, a token ahead


class Router(str, Enum):
    EXACT = "exact"
    CACHE_BIAS = "cache_bias"       # +beta on the logits of experts in memory (changes routing)
    PREROUTER = "prerouter"         # the prerouter's prediction is the routing (Edge0)


class Order(str, Enum):
    READY_FIRST = "ready_first"     # compute what is in memory while the rest arrive
    WAIT_ALL = "wait_all"


PRECISIONS = ("q2", "q3", "q4", "q8", "bf16", "raw",      # workbench.store.quant; raw: a GGUF's own blocks
              "g2", "g3", "g4", "g8")                   # ggml's blocks (workbench.store.ggml_blocks)
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _enum(cls, text, knob):
    try:
        return cls(text)
    except ValueError:
        raise WorkbenchError(f"{knob} {text!r}: choose one of {', '.join(m.value for m in cls)}") from None


def _number(text, knob) -> float:
    try:
        return float(text)
    except ValueError:
        raise WorkbenchError(f"{knob} {text!r}: expected a number") from None


@dataclass(frozen=True)
class Budget:
    """The expert cache's size: a fraction of all experts ("0.25"), a size ("96MiB", "3GB", "123456") or "all"."""
    text: str = "0.25"

    def __post_init__(self):
        self.parse()

    def parse(self) -> tuple[float, int]:
        """(fraction of all expert bytes, 0) or (0, bytes)."""
        s = self.text.strip()
        if s.lower() in ("all", "1", "1.0"):
            return 1.0, 0
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([A-Za-z]*)", s)
        if not m or m[2].upper() not in _UNITS:
            raise WorkbenchError(f"--budget {self.text!r}: expected a fraction like 0.25 or a size like 96MiB")
        x = float(m[1])           # a bare 1 in any spelling ("1.000000": runtime.session.prefills) is every expert
        return (x, 0) if not m[2] and x <= 1.0 else (0.0, int(x * _UNITS[m[2].upper()]))

    def nbytes(self, slot_bytes: int, n_experts: int) -> int:
        """Bytes the cache may hold, given what one expert costs in the engine's cache (engines.slot_bytes) and
        the number of experts."""
        frac, n = self.parse()
        total = slot_bytes * n_experts
        return total if frac == 1.0 else int(frac * total) if frac else n

    def slots(self, slot_bytes: int, n_experts: int) -> int:
        """What the budget buys: the expert slots (of slot_bytes each) its bytes hold. The one budget converter:
        the Session's cache, `info`, the simulator and the trace replay all size their cache with it."""
        return self.nbytes(slot_bytes, n_experts) // slot_bytes

    @property
    def all(self) -> bool:
        return self.parse() == (1.0, 0)

    def __str__(self):
        return self.text


@dataclass(frozen=True)
class Storage:
    layout: Layout = Layout.CONTIGUOUS      # workbench.store.pack.convert (through registry.resolve_pack)
    experts: str = "q4"             # precision of the routed experts: convert, workbench.store.quant
    rest: str = "q4"                # precision of everything else: likewise

    def __post_init__(self):
        for knob in ("experts", "rest"):
            if getattr(self, knob) not in PRECISIONS:
                raise WorkbenchError(f"{knob} {getattr(self, knob)!r}: choose one of {', '.join(PRECISIONS)}")


def _policy(text) -> str:
    from workbench.designs import policy_class
    policy_class(str(text))         # a registered name or a design's reference, refused here when neither
    return str(text)


def _hot(text) -> float:
    x = _number(text, "hot")
    if not 0.0 <= x < 1.0:
        raise WorkbenchError(f"hot {text!r}: the fraction of the budget pinned must be in 0..1 (below 1)")
    return x


@dataclass(frozen=True)
class Cache:
    budget: Budget = Budget()                   # Budget.nbytes -> workbench.cache.ExpertCache (Session)
    policy: str = "lru"             # ExpertCache: a Policy by name (workbench.designs.POLICIES) or reference
    scope: CacheScope = CacheScope.GLOBAL       # ExpertCache, Session.warm_start
    warm: bool = False              # Session.warm_start: each layer's most-used experts (held-out text) loaded first
    hot: float = 0.0                # workbench.cache.start_set: this fraction of the budget pinned from held-out
                                    # usage (colibri's hot store), the rest the policy's


@dataclass(frozen=True)
class Prefetch:
    predictor: Predictor | str | None = None    # workbench.predict.make_predictor: a built-in's enum, another
                                                # registered name (workbench.designs) or a design's reference
    depth: int = 1                  # lookahead (predict.Lookahead): layers ahead
    width: int = 1                  # lookahead: experts named per layer, in multiples of top-k
    skip_layers: int | None = None  # prerouter (edge0.serve.make_prerouter): MoE layers routed exactly (None: the heads')
    recall: float | None = None     # lookahead_recall: a MODELLED lookahead's or prerouter's recall, where a routing
                                    # trace holds no router inputs (experiments.routing_trace; None: its default)

    @classmethod
    def parse(cls, text: str | None) -> "Prefetch":
        """None | lookahead:DEPTH:k|2k | history | oracle | shuffled | prerouter[:SKIP]"""
        if not text:
            return cls()
        from workbench.designs import is_ref, predictor_class
        if is_ref(text) or str(text).split(":")[0] not in {m.value for m in Predictor}:
            predictor_class(str(text))      # registered, or refused in one line
            return cls(str(text))
        kind, *args = str(text).split(":")
        kind = _enum(Predictor, kind, "predictor")
        try:
            if kind is Predictor.LOOKAHEAD and len(args) <= 2 and (len(args) < 2 or args[1] in ("k", "2k")):
                return cls(kind, depth=int(args[0]) if args else 1, width=2 if args[1:] == ["2k"] else 1)
            if kind is Predictor.PREROUTER and len(args) <= 1:
                return cls(kind, skip_layers=int(args[0]) if args and args[0] else None)
            if not args:
                return cls(kind)
        except ValueError:
            pass
        raise WorkbenchError(f"predictor {text!r}: choose lookahead:DEPTH:k|2k, history, oracle, shuffled or "
                             f"prerouter[:SKIP_LAYERS]")

    def __str__(self):
        if self.predictor is Predictor.LOOKAHEAD:
            return f"lookahead:{self.depth}:{'2k' if self.width == 2 else 'k'}"
        if self.predictor is Predictor.PREROUTER and self.skip_layers is not None:
            return f"prerouter:{self.skip_layers}"
        return str(getattr(self.predictor, "value", self.predictor) or "")


@dataclass(frozen=True)
class Routing:
    router: Router | str = Router.EXACT         # Session._routing: a design's Router by reference, a str
    beta: float = 0.0               # cache_bias: logit bonus of experts in memory (workbench.routing.route's bias)
    lora: bool = True               # prerouter: serve the recovery LoRA, unmerged (edge0.serve.prerouter_routing)

    @classmethod
    def parse(cls, text: str) -> "Routing":
        """exact | cache_bias:BETA | prerouter[:nolora] | top_k | drop_misses | low_on_miss | low_by_hotness | a Router
        of your own
        (path/to/file.py:Name)"""
        from workbench.designs import is_ref, router_class
        if is_ref(text):
            router_class(str(text))             # loads, or one line
            return cls(str(text))
        kind, *args = str(text).split(":")
        from workbench.designs import ROUTERS
        if kind in ROUTERS and kind not in {r.value for r in Router} and not args:
            return cls(kind)                    # a registered Router (workbench.designs.lossy's levers)
        kind = _enum(Router, kind, "routing")
        try:
            if kind is Router.CACHE_BIAS and len(args) == 1:
                return cls(kind, beta=float(args[0]))
        except ValueError:
            pass
        if kind is Router.PREROUTER and args in ([], [""], ["nolora"]):
            return cls(kind, lora=args != ["nolora"])
        if kind is Router.EXACT and not args:
            return cls(kind)
        raise WorkbenchError(f"routing {text!r}: choose exact, cache_bias:BETA, prerouter[:nolora], top_k, "
                             f"drop_misses, low_on_miss or low_by_hotness")

    def __str__(self):
        if self.router is Router.CACHE_BIAS:
            return f"cache_bias:{self.beta:g}"
        if isinstance(self.router, str) and not isinstance(self.router, Router):
            return self.router
        return "prerouter:nolora" if self.router is Router.PREROUTER and not self.lora else self.router.value


@dataclass(frozen=True)
class Execution:
    order: Order = Order.WAIT_ALL               # workbench.streamer.ExpertStreamer.run_layer
    speculative: int = 0            # Session.generate -> runtime.speculative: drafts verified per step (0: none)
    draft: str = "lookup"           # what drafts them (runtime.speculative.make_draft): lookup, or a draft model


# flat knob name (run records, Session overrides) -> (concern, field, parse)
KNOBS = {
    "layout": ("storage", "layout", lambda v: _enum(Layout, v, "layout")),
    "experts": ("storage", "experts", str),
    "rest": ("storage", "rest", str),
    "budget": ("cache", "budget", lambda v: Budget(str(v))),
    "cache_policy": ("cache", "policy", _policy),
    "cache_scope": ("cache", "scope", lambda v: _enum(CacheScope, v, "cache_scope")),
    "warm": ("cache", "warm", lambda v: v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")),
    "hot": ("cache", "hot", _hot),
    "execution": ("execution", "order", lambda v: _enum(Order, v, "execution")),
    "predictor": ("prefetch", None, Prefetch.parse),
    "lookahead_recall": ("prefetch", "recall", lambda v: None if v is None else _number(v, "lookahead_recall")),
    "routing": ("routing", None, Routing.parse),
    "speculative": ("execution", "speculative", int),
    "draft": ("execution", "draft", str),
}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    storage: Storage = field(default_factory=Storage)
    cache: Cache = field(default_factory=Cache)
    prefetch: Prefetch = field(default_factory=Prefetch)
    routing: Routing = field(default_factory=Routing)
    execution: Execution = field(default_factory=Execution)
    params: tuple = ()              # (name, value) of the design's own parameters: its predictor's and policy's

    def __post_init__(self):
        if self.routing.router is Router.PREROUTER and self.prefetch.predictor is not Predictor.PREROUTER:
            raise WorkbenchError(f"preset {self.name!r}: routing {self.routing} needs predictor prerouter (the "
                                 f"prediction is the routing), not {str(self.prefetch) or None!r}")
        if self.routing.router is Router.PREROUTER and self.execution.speculative:
            raise WorkbenchError(f"preset {self.name!r}: routing {self.routing} decodes one token per step: "
                                 f"speculative must be 0")
        if self.prefetch.predictor is Predictor.LOOKAHEAD and self.prefetch.depth < 1:
            raise WorkbenchError(f"preset {self.name!r}: predictor {self.prefetch}: lookahead depth must be >= 1")
        if self.prefetch.recall is not None and not 0.0 <= self.prefetch.recall <= 1.0:
            raise WorkbenchError(f"preset {self.name!r}: lookahead_recall {self.prefetch.recall} must be in 0..1")
        if self.execution.speculative < 0:
            raise WorkbenchError(f"preset {self.name!r}: speculative {self.execution.speculative} must be >= 0")

    def with_(self, name: str | None = None, description: str | None = None, **knobs) -> "Preset":
        """A copy with some knobs changed, by their flat names (strings parsed here)."""
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        own = {}
        for knob, value in knobs.items():
            if knob == "params":                # the flat form's own (to_dict)
                own.update(value or {})
                continue
            if knob not in KNOBS:
                own[knob] = value
                continue
            concern, attr, parse = KNOBS[knob]
            value = parse(value)
            if knob == "predictor":             # another predictor keeps the modelled recall set
                value = replace(value, recall=parts["prefetch"].recall)
            parts[concern] = value if attr is None else replace(parts[concern], **{attr: value})
        parts.update({k: v for k, v in (("name", name), ("description", description)) if v is not None})
        if own:
            declared = Preset(**parts).declared()
            if bad := [k for k in own if k not in declared]:
                raise WorkbenchError(f"{bad[0]!r}: not a preset knob (choose from {', '.join(KNOBS)})"
                                     + (f" nor a parameter of this design ({', '.join(declared)})" if declared else ""))
            parts["params"] = tuple(sorted({**dict(parts["params"]), **{k: str(v) for k, v in own.items()}}.items()))
        return Preset(**parts)

    def declared(self) -> dict:
        """The design's own parameters and their defaults: its predictor's and its cache policy's."""
        from workbench.designs import params_of, policy_class, predictor_class, router_class
        pred = predictor_class(str(self.prefetch)) if self.prefetch.predictor else None
        routed = router_class(str(self.routing)) if self.routing.router not in (Router.EXACT, Router.PREROUTER) \
            else None
        return params_of(*[c for c in (pred, policy_class(self.cache.policy), routed) if c is not None])

    def to_dict(self) -> dict:
        """The flat form: knob name -> its text (run records, `with_`)."""
        out = {"name": self.name, "description": self.description}
        for knob, (concern, attr, _) in KNOBS.items():
            v = getattr(self, concern) if attr is None else getattr(getattr(self, concern), attr)
            if isinstance(v, Enum):
                v = v.value
            elif isinstance(v, (Budget, Prefetch, Routing)):
                v = str(v) or None
            out[knob] = v
        if self.params:
            out["params"] = dict(self.params)
        return out

    @property
    def exact(self) -> bool:
        return self.routing.router is Router.EXACT


def with_each(presets: list, knobs: dict) -> list:
    """Knobs set on several presets (a replay's, a ladder's rungs): the preset knobs on every one, a design's own
    parameter on those that declare it; one none declares is refused."""
    own = {k: v for k, v in knobs.items() if k not in KNOBS}
    shared = {k: v for k, v in knobs.items() if k in KNOBS}
    out = [p.with_(**shared) for p in presets]
    declared = [p.declared() for p in out]
    if bad := [k for k in own if not any(k in d for d in declared)]:
        raise WorkbenchError(f"{bad[0]!r}: not a preset knob (choose from {', '.join(KNOBS)}) nor a parameter of "
                             f"any design given")
    return [p.with_(**{k: v for k, v in own.items() if k in d}) for p, d in zip(out, declared)]


def _preset(name, description, **knobs) -> Preset:
    return Preset(name, description).with_(**knobs)


PRESETS = {p.name: p for p in [
    _preset("teacher", "full precision (bf16 weights, fp32 compute), exact routing, every expert resident: the reference",
            experts="bf16", rest="bf16", budget="all"),
    _preset("resident", "every expert in memory (the ceiling), int4", budget="all"),
    _preset("on_demand", "no prediction: each miss is read when the layer asks for it (the floor control)",
            layout="native"),
    _preset("oracle", "prefetch the true routing one layer ahead (the bound on prediction)",
            execution="ready_first", predictor="oracle"),
    _preset("shuffled", "control: prefetch experts drawn from each layer's marginal frequencies, no timing information",
            execution="ready_first", predictor="shuffled"),
    _preset("history", "prefetch the previous token's experts at each layer", execution="ready_first", predictor="history"),
    _preset("les", "LES: router lookahead 1 layer (top-k), ready-first, contiguous layout, experts q3 / rest q4",
            experts="q3", rest="q4", execution="ready_first", predictor="lookahead:1:k"),
    _preset("les_no_prefetch", "control: LES with its lookahead taken out (contiguous layout, ready-first, experts q3 / "
            "rest q4, each miss read on demand): les over it is the prediction's gain alone, not a layout or "
            "precision gain", experts="q3", rest="q4", execution="ready_first"),
    _preset("smol", "smolmaxxing pager: per-layer LRU pools warmed from each layer's most-used list, "
            "prefetch 2 layers ahead, parallel whole-expert reads, experts q2 / rest q4",
            experts="q2", rest="q4", cache_scope="per_layer", warm=True, execution="ready_first", predictor="lookahead:2:k"),
    _preset("smol_bias", "smolmaxxing pager with cache-aware routing bias 0.05 for experts in memory",
            experts="q2", rest="q4", cache_scope="per_layer", warm=True, execution="ready_first",
            predictor="lookahead:2:k", routing="cache_bias:0.05"),
    _preset("edge0", "Edge0: trained prerouter heads predict the next layer's routing a token ahead and that "
            "prediction is the routing (the first skip_layers MoE layers exact); unmerged recovery LoRA on attention; "
            "int4 experts and rest",
            experts="q4", rest="q4", execution="ready_first", predictor="prerouter", routing="prerouter"),
]}


def get_preset(name: str) -> Preset:
    """A preset by name, or a design of your own by reference ("path/to/mine.py:Name", "package.module:Name")."""
    if name in PRESETS:
        return PRESETS[name]
    from workbench.designs import is_ref
    if is_ref(name):
        return design_preset(name)
    raise WorkbenchError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)} or path/to/file.py:Name")


def design_preset(ref: str) -> Preset:
    """The preset a design's reference makes: a Design (its parts over its base preset), or a Predictor or a Policy
    alone (over les_no_prefetch: contiguous, ready-first, q3 / q4, no prefetch, LRU). Named by the reference, so a
    worker in another process makes the same preset from the name a record keeps."""
    import inspect
    from workbench.designs import Design, Policy, Predictor, Router as RouterPart, load, ref_of
    name, _, attr = ref.rpartition(":")
    if name.endswith(".py"):                # absolute: a worker in another folder (a Ray cell) finds the same file
        from pathlib import Path
        ref = f"{Path(name).expanduser().resolve()}:{attr}"
    obj = load(ref)
    if inspect.isclass(obj) and issubclass(obj, Predictor):
        obj = type(attr, (Design,), {"predictor": obj, "__doc__": obj.__doc__})
    elif inspect.isclass(obj) and issubclass(obj, Policy):
        obj = type(attr, (Design,), {"policy": obj, "__doc__": obj.__doc__})
    elif inspect.isclass(obj) and issubclass(obj, RouterPart):
        obj = type(attr, (Design,), {"router": obj, "__doc__": obj.__doc__})
    elif not (inspect.isclass(obj) and issubclass(obj, Design)):
        raise WorkbenchError(f"{name}: {attr} is not a Design, Predictor, Policy or Router (workbench.designs)")
    if obj.base not in PRESETS:
        raise WorkbenchError(f"{name}: {attr}.base {obj.base!r}: choose one of {', '.join(PRESETS)}")
    knobs = {"predictor": obj.predictor and ref_of(obj.predictor, ref),
             "cache_policy": obj.policy and ref_of(obj.policy, ref), "warm": obj.warm, "hot": obj.hot,
             "cache_scope": obj.scope, "routing": obj.router and ref_of(obj.router, ref)}
    doc = " ".join((obj.__doc__ or f"a design from {name}").split())
    p = PRESETS[obj.base].with_(name=ref, description=doc, **{k: v for k, v in knobs.items() if v is not None})
    return p.with_(**obj.params) if obj.params else p


def budget_for(preset: Preset, requested) -> str | None:
    """The budget a comparison runs a preset at: a preset that keeps every expert resident (the teacher, the
    ceiling) keeps it; the others take the requested one (None: their own)."""
    return None if preset.cache.budget.all or requested is None else str(Budget(str(requested)))
