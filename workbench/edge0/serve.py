"""Edge0 serving, numpy only: prediction-as-routing from trained prerouter heads, and an unmerged LoRA.

Prerouter (predictor "prerouter[:SKIP]", routing "prerouter[:nolora]")
  At layer L of token t the head of owner layer L maps the features
      concat[x_L(t) (the router input), one-hot top-k of layer L at t, one-hot top-k of layer L at t-1]
  to router logits for layer L+1 at token t+1. They go through the model's own routing function
  (workbench.routing.route), and the result is *staged*: its experts are prefetched a token ahead
  (the predictor returns {(L+1, t+1): experts}), and at token t+1 the router hook of layer L+1 returns
  the staged (ids, weights) instead of the real router's. So the staged slots are exactly the routed
  set: nothing staged is dropped, nothing routed was unstaged. The first SKIP MoE layers (at least the
  first: nothing precedes it) and prefill route exactly. The one-hots are of the routing executed.

LoRA: y = x W^T + (x A^T) B^T * scale on attention q, k, v, o, applied as a parallel delta through the
engine's projection deltas (engines/base.py's hooks), so the int4 base stays as it is stored.

Counters (edge0_counters / edge0_summary), over decode steps of the layers that stream from a prediction:
  routed    experts those layers computed
  consumed  of those, experts that came from a staged prediction (Edge0: must equal routed)
  dropped   staged experts the layer did not use (Edge0: must be 0)
  staged_in_memory  consumed experts already in memory when the layer asked (the prefetch landed)
"""
from __future__ import annotations

import numpy as np

from workbench.edge0.artifacts import artifact_path, check_identity, load_safetensors
from workbench.routing import route
from workbench.errors import WorkbenchError

PROJ = ("q", "k", "v", "o")


def gelu(x):
    """tanh approximation (torch's gelu(approximate="tanh"), as the heads are trained)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


# ---------------------------------------------------------------- heads

class Heads:
    """Prerouter heads per owner layer: logits = res(f) + fc2(gelu(fc1(f)))."""

    def __init__(self, tensors: dict, meta: dict, path="<memory>"):
        self.t, self.meta, self.path = tensors, meta, path
        self.owners = sorted(int(o) for o in meta["owners"])

    @classmethod
    def load(cls, spec, pack=None, path=None) -> "Heads":
        path = path or artifact_path(pack, "prerouter")
        t, meta = load_safetensors(path, "prerouter")
        cls.check(spec, t, meta, path)
        if pack is not None:
            check_identity(path, meta, pack)
        return cls(t, meta, path)

    @staticmethod
    def check(spec, t: dict, meta: dict, path):
        for k, want in (("num_layers", spec.num_layers), ("hidden_size", spec.hidden_size),
                        ("num_experts", spec.num_experts), ("top_k", spec.top_k)):
            if meta.get(k) != want:
                raise WorkbenchError(f"{path}: heads are for {k}={meta.get(k)}, this model has {k}={want}")
        moe = spec.moe_layers
        owners = [int(o) for o in meta.get("owners", [])]
        bad = [o for o in owners if o not in moe[:-1]]
        if not owners or bad:
            raise WorkbenchError(f"{path}: owner layers {bad or owners} do not match this model's MoE layers {moe}")
        d, E, H = spec.hidden_size, spec.num_experts, int(meta.get("hidden", 0))
        f = d + 2 * E
        shapes = {"fc1.weight": (H, f), "fc1.bias": (H,), "fc2.weight": (E, H), "fc2.bias": (E,), "res.weight": (E, f)}
        for o in owners:
            for n, shape in shapes.items():
                a = t.get(f"heads.{o}.{n}")
                if a is None or tuple(a.shape) != shape:
                    raise WorkbenchError(f"{path}: tensor heads.{o}.{n} has shape "
                                         f"{None if a is None else tuple(a.shape)}, expected {shape} for this model")
        extra = set(t) - {f"heads.{o}.{n}" for o in owners for n in shapes}
        if extra:
            raise WorkbenchError(f"{path}: unexpected tensors {sorted(extra)[:3]}")

    def logits(self, owner: int, feats: np.ndarray) -> np.ndarray:
        p = f"heads.{owner}."
        t = self.t
        hid = gelu(feats @ t[p + "fc1.weight"].T + t[p + "fc1.bias"])
        return feats @ t[p + "res.weight"].T + hid @ t[p + "fc2.weight"].T + t[p + "fc2.bias"]


def onehot(idx: np.ndarray, E: int) -> np.ndarray:
    """(..., k) expert ids -> (..., E) 0/1."""
    out = np.zeros(idx.shape[:-1] + (E,), np.float32)
    np.put_along_axis(out, np.asarray(idx, np.int64), 1.0, -1)
    return out


def features(x: np.ndarray, idx_t: np.ndarray, idx_prev: np.ndarray | None, E: int) -> np.ndarray:
    """concat[x, one-hot(top-k at t), one-hot(top-k at t-1)] (zeros where there is no previous token)."""
    prev = np.zeros(x.shape[:-1] + (E,), np.float32) if idx_prev is None else onehot(idx_prev, E)
    return np.concatenate([x.astype(np.float32), onehot(idx_t, E), prev], -1)


# ---------------------------------------------------------------- the prerouter: predictor + router hook

class Prerouter:
    certain = True          # the prediction is the routing (of the streamed layers)
    def __init__(self, spec, weights, heads: Heads, skip_layers: int | None = None):
        self.spec, self.w, self.heads = spec, weights, heads
        moe = spec.moe_layers
        skip = int(heads.meta.get("skip_layers", 1) if skip_layers is None else skip_layers)
        if not 1 <= skip <= len(moe):
            raise WorkbenchError(f"prerouter skip_layers={skip}: choose 1..{len(moe)} (the first MoE layer has no "
                                 f"earlier layer to predict it from)")
        self.skip_layers = skip
        self.owner = {moe[i]: moe[i - 1] for i in range(1, len(moe))}     # target layer -> owner layer
        self.streamed = set(moe[skip:])                                   # layers that route from a prediction
        missing = [L for L in sorted(self.streamed) if self.owner[L] not in heads.owners]
        if missing:
            raise WorkbenchError(f"{heads.path}: no head predicts layer(s) {missing} (owners {heads.owners}); "
                                 f"use a larger skip_layers or re-train")
        self.staged: dict[tuple, tuple] = {}      # (layer, token index) -> (ids (1, k), weights (1, k))
        self.last: dict[int, np.ndarray] = {}     # owner layer -> executed top-k of the previous token (k,)
        self.routing_active = False

    def predict(self, layer: int, ctx) -> dict:
        eng = ctx["engine"]
        routed, x, phase = ctx["routed"], ctx["x"], ctx["phase"]
        if phase == "prefill" and eng.pos == 0 and layer == self.spec.moe_layers[0]:
            self.staged.clear()
            self.last.clear()
        if phase == "decode" and len(x) != 1 and self.routing_active:
            raise WorkbenchError("routing prerouter decodes one token per step (no speculative batches)")
        prev = routed[-2] if len(routed) >= 2 else self.last.get(layer)
        self.last[layer] = np.asarray(routed[-1])
        i = self.spec.moe_layers.index(layer)
        if i + 1 >= len(self.spec.moe_layers):
            return {}
        target = self.spec.moe_layers[i + 1]
        if target not in self.streamed:
            return {}
        f = features(x[-1:], routed[-1:], None if prev is None else np.asarray(prev)[None], self.spec.num_experts)
        logits = self.heads.logits(layer, f)
        idx, wts = route(self.spec, logits, self.w.get(f"layers.{target}.router_bias"))
        t = eng.token_index + 1
        self.staged.pop((target, t - 2), None)            # stale (prefetch-only use): never piles up
        self.staged[(target, t)] = (idx, wts)
        return {(target, t): idx[0].tolist()}

    def route(self, layer: int, logits: np.ndarray, ctx):
        """The router hook: a streamed layer at decode takes the staged routing; elsewhere the real router."""
        if ctx["phase"] == "decode" and layer in self.streamed:
            st = self.staged.pop((layer, ctx["engine"].token_index), None)
            if st is not None:
                if len(logits) != 1:
                    raise WorkbenchError("routing prerouter decodes one token per step (no speculative batches)")
                return st
        return route(self.spec, logits, self.w.get(f"layers.{layer}.router_bias"))


def make_prerouter(skip_layers: int | None, spec, weights, pack=None, path=None) -> Prerouter:
    """Predictor prerouter (skip_layers None: the heads' own); heads from <model dir>/edge0/prerouter.safetensors."""
    if pack is None and path is None:
        raise WorkbenchError("predictor prerouter: needs the model's pack to find edge0/prerouter.safetensors")
    return Prerouter(spec, weights, Heads.load(spec, pack, path), skip_layers)


# ---------------------------------------------------------------- LoRA (unmerged)

class LoRA:
    def __init__(self, tensors: dict, meta: dict, path="<memory>"):
        self.t, self.meta, self.path = tensors, meta, path
        self.scale = float(meta["scale"])

    @classmethod
    def load(cls, spec, weights, pack=None, path=None) -> "LoRA":
        path = path or artifact_path(pack, "lora")
        t, meta = load_safetensors(path, "lora")
        cls.check(spec, weights, t, meta, path)
        if pack is not None:
            check_identity(path, meta, pack)
        return cls(t, meta, path)

    @staticmethod
    def check(spec, weights, t: dict, meta: dict, path):
        if meta.get("num_layers") != spec.num_layers:
            raise WorkbenchError(f"{path}: adapters are for num_layers={meta.get('num_layers')}, this model has "
                                 f"num_layers={spec.num_layers}")
        r = int(meta.get("rank", 0))
        names = sorted({n.rsplit(".", 1)[0] for n in t})
        if not names:
            raise WorkbenchError(f"{path}: no adapters")
        for base in names:
            _, L, proj = base.split(".")
            W = weights.get(f"layers.{L}.{proj}")
            if W is None or int(L) >= spec.num_layers:
                raise WorkbenchError(f"{path}: adapter {base} has no projection layers.{L}.{proj} in this model")
            out, inp = W.shape
            for part, shape in (("A", (r, inp)), ("B", (out, r))):
                a = t.get(f"{base}.{part}")
                if a is None or tuple(a.shape) != shape:
                    raise WorkbenchError(f"{path}: tensor {base}.{part} has shape "
                                         f"{None if a is None else tuple(a.shape)}, expected {shape} for this model")

    def targets(self):
        for base in sorted({n.rsplit(".", 1)[0] for n in self.t}):
            _, L, proj = base.split(".")
            yield f"layers.{L}.{proj}", self.t[base + ".A"], self.t[base + ".B"]

    def deltas(self) -> dict:
        """{projection name: x -> (x A^T) B^T * scale}: the engine's projection deltas."""
        s = np.float32(self.scale)

        def make(A, B):
            return lambda x: ((x @ A.T) @ B.T) * s
        return {name: make(A, B) for name, A, B in self.targets()}

    def merged(self, weights: dict) -> dict:
        """{projection name: W + scale * B A} (fp32), the merged reference."""
        return {name: weights[name] + self.scale * (B @ A) for name, A, B in self.targets()}


def prerouter_routing(predictor: Prerouter, lora: bool, spec, weights, pack):
    """The Session's routing "prerouter" (heads + the recovery LoRA) or "prerouter:nolora" (the preset has
    made sure its predictor is the prerouter): (the router hook, the LoRA or None)."""
    predictor.routing_active = True
    return predictor.route, (LoRA.load(spec, weights, pack) if lora else None)


# ---------------------------------------------------------------- counters

def edge0_counters(session) -> dict:
    pr = session.engine.predictor
    streamed = pr.streamed if isinstance(pr, Prerouter) else set()
    routed = consumed = dropped = in_mem = 0
    for ev in session.tel.events:
        if ev.phase != "decode" or ev.layer not in streamed:
            continue
        pred = set(ev.predicted)
        routed += len(ev.routed)
        for e, hit in zip(ev.routed, ev.hit):
            if e in pred:
                consumed += 1
                in_mem += bool(hit)
        dropped += len(pred - set(ev.routed))
    return {"edge0_routed": routed, "consumed": consumed, "dropped": dropped, "staged_in_memory": in_mem,
            "streamed_layers": sorted(streamed), "skip_layers": getattr(pr, "skip_layers", None),
            "lora": str(getattr(session.lora, "path", "")) or None}


def edge0_summary(session) -> dict:
    return {**session.summary(), **edge0_counters(session)}
