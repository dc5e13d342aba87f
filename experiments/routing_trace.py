"""Trace-driven runs: any model's routing and predictions taken from a recorded routing trace.

    python -m workbench trace --engine numpy --model demo --data tinystories --tokens 256 --out t.parquet
    python -m workbench bench --model <make-model dir> --preset les --routing-trace t.parquet --device ufs22-phone

A trace (experiments/traces.py) holds per token and MoE layer the experts routed; `named_predictions` adds what
each predictor named for that (token, layer), computed when the trace is written (from the recorded router inputs
and the traced model's own routers for lookahead): lookahead at depth 1 and 2, width k and 2k; history (the
previous token's experts at that layer); the oracle (the true routing). Edge0's prerouter is not recorded.

`TraceDrive` replaces a Session's router and predictor, so the run reads real experts of the model's own size
and computes for real, but routes and prefetches as the traced model did. Mapping when shapes differ (stated in
every result as `routing_trace.mapping`):
  layers   the model's i-th MoE layer replays the trace's MoE layer i mod (trace MoE layers)
  experts  identity when experts and top-k agree; else, when the model's top-k is r times the trace's and it has
           r times the experts, trace expert e becomes the r experts r*e .. r*e+r-1. Anything else is refused.
  tokens   prefill token p replays trace token p; decode step n (engine.token_index) replays the token after
           the prompt's last, n - 1 positions on; the trace wraps around at its end.
Mixing weights are uniform over the routed experts (the trace keeps which experts, not the model's weights).
"""
from __future__ import annotations

import numpy as np

from workbench.errors import WorkbenchError
from workbench.presets import Predictor, Prefetch
from workbench.routing import topk_desc
from workbench.spec import MoESpec

PREDICTORS = ("lookahead:1:k", "lookahead:1:2k", "lookahead:2:k", "lookahead:2:2k", "history", "oracle")


def named_predictions(trace: dict, spec: MoESpec, weights: dict) -> dict:
    """{predictor: (T, NL, width) int32}: the experts each predictor named for (token, layer); -1 where none."""
    from workbench.predict import Lookahead
    topk, h, layers = trace["topk"], trace["router_input"], list(trace["moe_layers"])
    T, NL, k = topk.shape
    out = {}
    for name in PREDICTORS:
        pf = Prefetch.parse(name)
        if pf.predictor is not Predictor.LOOKAHEAD:
            continue
        la, depth = Lookahead(spec, weights, depth=pf.depth, width=pf.width), pf.depth
        a = np.full((T, NL, la.width), -1, np.int32)
        for j in range(depth, NL):
            logits = la.scores(layers[j - depth], h[:, j - depth].astype(np.float32), layers[j])
            if spec.router == "sigmoid_group":
                logits = logits + weights.get(f"layers.{layers[j]}.router_bias", 0.0)
            a[:, j] = topk_desc(logits, la.width)
        out[name] = a
    hist = np.full((T, NL, k), -1, np.int32)
    hist[1:] = topk[:-1]
    out["history"] = hist
    out["oracle"] = topk.astype(np.int32)
    return out


def expert_map(path, trace_spec: dict, spec: MoESpec) -> tuple[int, str]:
    """The expansion r (trace expert e -> model experts r*e..r*e+r-1) and the stated rule, or a one-line refusal."""
    E, k = trace_spec["num_experts"], trace_spec["top_k"]
    if (E, k) == (spec.num_experts, spec.top_k):
        return 1, "experts: identity"
    r = spec.top_k // k
    if spec.top_k % k or spec.num_experts != r * E:
        raise WorkbenchError(
            f"{path}: a trace of {E} experts top-{k} maps onto a model only when the model's top-k is r times {k} "
            f"and it has r x {E} experts; this model has {spec.num_experts} experts top-{spec.top_k}"
            + (f" (make-model --experts {r * E} fits)" if r and not spec.top_k % k else ""))
    return r, f"experts: trace expert e -> model experts {r}e..{r}e+{r - 1} (top-{k} -> top-{spec.top_k})"


class TraceDrive:
    def __init__(self, path, spec: MoESpec, predictor: str | None, trace: dict | None = None):
        from experiments.traces import read_trace
        tr = trace or read_trace(path)      # trace: the file already read
        self.path, self.spec = str(path), spec
        self.topk, self.preds = tr["topk"], tr.get("predictions", {})
        meta = tr["meta"]
        self.T, tl = self.topk.shape[0], tr["moe_layers"]
        self.r, rule = expert_map(path, {"num_experts": meta["num_experts"], "top_k": meta["top_k"]}, spec)
        self.row_layer = {L: i % len(tl) for i, L in enumerate(spec.moe_layers)}
        self.mapping = (f"layers: model MoE layer i replays trace MoE layer i mod {len(tl)} (trace layers {tl}); "
                        f"{rule}; tokens: prompt then decode replay trace rows in order, wrapping at {self.T}")
        self.source = {"path": self.path, "engine": meta.get("engine"), "model": meta.get("gguf") or meta.get("model"),
                       "tokens": self.T, "data": meta.get("data"), "mapping": self.mapping}
        self.predictor_name = predictor
        if predictor and predictor not in self.preds:
            have = ", ".join(self.preds) or "none (a trace written before predictions were recorded)"
            raise WorkbenchError(f"{path}: predictor {predictor!r} is not recorded in this trace (it has: {have})")
        self.prompt_len = 0
        counts = {L: np.bincount(self.topk[:, j].reshape(-1), minlength=meta["num_experts"]) for L, j in self.row_layer.items()}
        self.usage = {L: np.repeat(c, self.r).tolist() for L, c in counts.items()}   # for warm sets (the pager)

    def experts(self, a: np.ndarray) -> np.ndarray:
        """Trace expert ids (any shape, -1 = none) -> model expert ids, last axis widened r times."""
        a = np.asarray(a)
        if self.r == 1:
            return a
        wide = self.r * a[..., :, None] + np.arange(self.r)
        return np.where(a[..., :, None] < 0, -1, wide).reshape(*a.shape[:-1], -1)

    def rows(self, engine, n: int) -> np.ndarray:
        if n > 1 or engine.token_index == 0:           # prefill: trace rows 0..P-1
            self.prompt_len = n
            return np.arange(n) % self.T
        return np.array([(self.prompt_len - 1 + engine.token_index) % self.T])

    def route(self, layer: int, logits, ctx):
        """The router hook: the trace's experts for these tokens, uniform mixing weights."""
        idx = self.experts(self.topk[self.rows(ctx["engine"], len(logits)), self.row_layer[layer]]).astype(np.int64)
        return idx, np.full(idx.shape, 1.0 / idx.shape[1], np.float32)

    def predictor(self):
        return None if not self.predictor_name else _Recorded(self)


class _Recorded:
    """A predictor that names what the trace recorded for the target layer at this token."""

    def __init__(self, drive: TraceDrive):
        name = drive.predictor_name
        self.d, self.table = drive, drive.preds[name]
        self.depth = int(name.split(":")[1]) if name.startswith("lookahead") else 1
        self.moe = drive.spec.moe_layers

    def predict(self, layer: int, ctx) -> dict:
        i = self.moe.index(layer) + self.depth
        if ctx["phase"] != "decode" or i >= len(self.moe):
            return {}
        target = self.moe[i]
        row = self.d.rows(ctx["engine"], 1)[0]
        named = self.d.experts(self.table[row, self.d.row_layer[target]])
        return {target: [int(e) for e in named if e >= 0]}

