"""Designs by name: the registry of predictors and cache policies, and the loader of a design from a file.

    PREDICTORS   name -> its Predictor's reference (lookahead, history, oracle, shuffled, prerouter, coactivation)
    POLICIES     name -> its Policy's reference    (lru, lfu, lfu_aging, s3fifo, least_stale)
    ROUTERS      name -> its Router's reference    (cache_bias: smol_bias's; top_k, drop_misses, low_on_miss,
                 low_by_hotness: the lossy levers)
    load(ref)    "path/to/mine.py:Name" or "package.module:Name" -> the object it names

Every built-in is found here the way a design of your own is: by its name in the preset's knobs
(`--set predictor=coactivation`, `--set cache_policy=s3fifo`) or by reference (`--preset mine.py:Name`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np

from workbench.designs.base import Design, Evictable, Policy, Predictor, Router, Setup
from workbench.errors import WorkbenchError

__all__ = ["Design", "Evictable", "Policy", "Predictor", "Router", "Setup", "PREDICTORS", "POLICIES", "ROUTERS", "load",
           "predictor_class", "policy_class", "router_class", "make_predictor", "is_ref", "ref_of", "short"]


# The built-ins, by reference: found as a design of your own is (load), so that none has a private path
PREDICTORS = {
    "lookahead": "workbench.predict:Lookahead",
    "history": "workbench.predict:History",
    "oracle": "workbench.predict:Oracle",
    "shuffled": "workbench.predict:Shuffled",
    "prerouter": "workbench.predict:Prerouter",
    "coactivation": "workbench.designs.coactivation:CoActivation",
}
POLICIES = {
    "lru": "workbench.designs.base:Policy",
    "lfu": "workbench.designs.lfu:LFU",
    "lfu_aging": "workbench.designs.lfu:LFUAging",
    "s3fifo": "workbench.designs.s3fifo:S3FIFO",
    "least_stale": "workbench.designs.least_stale:LeastStale",
}
ROUTERS = {
    "cache_bias": "workbench.routing:CacheBias",
    "top_k": "workbench.designs.lossy:TopK",
    "drop_misses": "workbench.designs.lossy:DropMisses",
    "low_on_miss": "workbench.designs.lossy:LowOnMiss",
    "low_by_hotness": "workbench.designs.lossy:LowByHotness",
}


def is_ref(text: str) -> bool:
    """A reference to a design's code ("mine.py:Name", "package.module:Name"), not a registered name with its
    arguments ("lookahead:1:k", "cache_bias:0.05", "prerouter:nolora")."""
    where, sep, attr = str(text).rpartition(":")
    if not sep:
        return False
    return where.endswith(".py") or (attr.isidentifier() and where.replace(".", "_").isidentifier()
                                     and where not in ("lookahead", "prerouter", "cache_bias"))


_LOADED: dict = {}


def load(ref: str):
    """The object `ref` names: "path/to/file.py:Name" or "package.module:Name". A one-line error otherwise."""
    where, _, name = str(ref).rpartition(":")
    if not where or not name:
        raise WorkbenchError(f"design {ref!r}: expected path/to/file.py:Name or package.module:Name")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise WorkbenchError(f"{where}: no such design file")
        key = f"{path}:{path.stat().st_mtime_ns}"
        if key not in _LOADED:
            spec = importlib.util.spec_from_file_location(f"workbench_design_{abs(hash(key))}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module         # dataclasses and pickling look their module up
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                raise WorkbenchError(f"{where}: the design file failed to load ({type(e).__name__}: {e})") from None
            _LOADED[key] = module
        module, label = _LOADED[key], where
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise WorkbenchError(f"design {ref!r}: cannot import {where} ({type(e).__name__}: {e})") from None
        label = where
    if not hasattr(module, name):
        raise WorkbenchError(f"{label}: defines no {name!r}")
    return getattr(module, name)


def short(name: str) -> str:
    """A design's name in a table: a preset's; a file's name and the class; a module's class."""
    if not is_ref(name):
        return str(name)
    where, _, attr = str(name).rpartition(":")
    return f"{Path(where).name}:{attr}" if where.endswith(".py") else attr


def ref_of(obj, file_ref: str) -> str:
    """The reference text of a class defined in the file (or module) that `file_ref` names, or a registered name."""
    if isinstance(obj, str):
        return obj
    for reg in (PREDICTORS, POLICIES, ROUTERS):
        if (name := next((n for n, r in reg.items() if r == f"{obj.__module__}:{obj.__name__}"), None)) is not None:
            return name
    return f"{file_ref.rpartition(':')[0]}:{obj.__name__}"


def _check_class(obj, base: type, ref: str, methods: dict):
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise WorkbenchError(f"{ref}: not a {base.__name__} (subclass workbench.designs.{base.__name__})")
    for m, n in methods.items():
        f = getattr(obj, m, None)
        if not callable(f):
            raise WorkbenchError(f"{ref}: {m} is not a method")
        try:
            got = len([p for p in inspect.signature(f).parameters.values()
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) - 1
        except (TypeError, ValueError):
            continue
        if got != n:
            raise WorkbenchError(f"{ref}: {m} takes {got} argument{'s' * (got != 1)}, the interface gives it {n}")
    return obj


def _guarded(cls: type, base: type, ref: str, methods: tuple, check=None) -> type:
    """A design's own class, each of its methods turning an exception into one line naming the design, the method
    and what it raised (check(self, method, args, result): the result is of the interface's shape, or one line)."""
    def wrap(m, f):
        def guarded(self, *args, **kw):
            try:
                out = f(self, *args, **kw)
            except WorkbenchError:
                raise
            except Exception as e:
                raise WorkbenchError(f"{ref}: {m} raised {type(e).__name__}: {e}") from None
            return check(self, m, args, out) if check else out
        return guarded
    own = {m: wrap(m, getattr(cls, m)) for m in methods if getattr(cls, m) is not getattr(base, m)}
    return type(cls.__name__, (cls,), {**own, "__module__": cls.__module__, "__doc__": cls.__doc__})


def _named(self, m: str, args: tuple, named):
    """What a predictor returned: {later MoE layer, or (layer, token): expert ids} (else one line)."""
    if m != "predict":
        return named
    spec, (layer, _) = self.spec, args
    if not isinstance(named, dict):
        raise WorkbenchError(f"{self.ref}: predict returned {type(named).__name__}, not a dict {{layer: experts}}")
    for target, experts in named.items():
        L = target[0] if isinstance(target, tuple) else target
        if L not in spec.moe_layers:
            raise WorkbenchError(f"{self.ref}: predict at layer {layer} named layer {target!r}, not a MoE layer")
        bad = [e for e in experts if not (isinstance(e, (int, np.integer)) and 0 <= e < spec.num_experts)]
        if bad:
            raise WorkbenchError(f"{self.ref}: predict at layer {layer} named expert {bad[0]!r} of layer {L}: the "
                                 f"model has experts 0..{spec.num_experts - 1}")
    return named


def _part(name: str, base: type, registry: dict, knob: str, methods: dict, check=None) -> type:
    """The class a part's text names: a registered built-in by its kind (the text before any ':' arguments), or a
    design's own by reference, checked for the interface's methods and guarded (each raise one line, `ref` set)."""
    if is_ref(name):
        cls = _check_class(load(name), base, name, methods)
        guarded = _guarded(cls, base, name, ("__init__", *methods, *(("demoted",) if base is Policy else ())), check)
        guarded.ref = name          # a design's own: what it returns is checked (the cache: that its victim may go)
        return guarded
    kind = str(name).split(":")[0]
    if kind not in registry:
        raise WorkbenchError(f"{knob} {name!r}: choose one of {', '.join(registry)} or path/to/file.py:Name")
    return load(registry[kind])


def predictor_class(name: str) -> type:
    """The Predictor a preset's predictor text names."""
    return _part(name, Predictor, PREDICTORS, "predictor", {"predict": 2}, _named)


def policy_class(name: str) -> type:
    return _part(name, Policy, POLICIES, "cache_policy", {"victim": 2, "hit": 2, "inserted": 2, "removed": 1})


def router_class(name: str) -> type:
    return _part(name, Router, ROUTERS, "routing", {"route": 3}, _routed)


def _routed(self, m: str, args: tuple, out):
    """What a router returned: (experts, weights), rows x top-k, experts of the model's, and with a low tier its
    marks, bool as the experts (else one line)."""
    if m != "route":
        return out
    spec, (layer, logits, _) = self.spec, args
    try:
        idx, w, *low = (np.asarray(a) for a in out)
        if len(low) > (1 if self.low else 0):
            raise ValueError
    except (TypeError, ValueError):
        raise WorkbenchError(f"{self.ref}: route returned {type(out).__name__}, not (experts, weights)"
                             f"{', with marks for its low tier' if self.low else ''}") from None
    rows = np.asarray(logits).shape[0]
    if idx.ndim != 2 or idx.shape[0] != rows or not 1 <= idx.shape[1] <= spec.top_k or w.shape != idx.shape:
        raise WorkbenchError(f"{self.ref}: route at layer {layer} returned experts {idx.shape} and weights {w.shape}, "
                             f"not rows x (1 to top-k) ({rows}, {spec.top_k})")
    if idx.min() < 0 or idx.max() >= spec.num_experts:
        raise WorkbenchError(f"{self.ref}: route at layer {layer} chose expert {int(idx.max())}: the model has "
                             f"experts 0..{spec.num_experts - 1}")
    if low and (low[0].shape != idx.shape or low[0].dtype != bool):
        raise WorkbenchError(f"{self.ref}: route at layer {layer} marked {low[0].shape} {low[0].dtype} for its low "
                             f"tier, not bool as its experts {idx.shape}")
    return (idx.astype(np.int64), w.astype(np.float32), *low)


def params_of(*classes) -> dict:
    out = {}
    for c in classes:
        out.update(getattr(c, "params", {}) or {})
    return out


def make_predictor(prefetch, setup: Setup, params: dict | None = None):
    """The predictor of a preset's prefetch setting (workbench.presets.Prefetch), found by name in the registry, or
    None."""
    if not prefetch.predictor:
        return None
    return predictor_class(str(prefetch)).build(setup, prefetch, params or {})
