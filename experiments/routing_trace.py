"""Trace-driven runs: any model's routing and predictions taken from a recorded routing trace.

    python -m workbench trace --engine numpy --model demo --data tinystories --tokens 256 --out t.parquet
    python -m workbench bench --model <make-model dir> --preset les --routing-trace t.parquet --device ufs22-phone

A trace (experiments/traces.py) holds per token and MoE layer the experts routed; `named_predictions` adds what
each predictor named for that (token, layer), computed when the trace is written (from the recorded router inputs
and the traced model's own routers for lookahead): lookahead at depth 1 and 2, width k and 2k; history (the
previous token's experts at that layer); the oracle (the true routing); and, where an Edge0 head is trained for the
traced model (<model dir>/edge0/prerouter.safetensors), `prerouter`: what the heads name for (token t, layer j) from
token t-1 at layer j-1, as the engine's Prerouter names it one token ahead. `drafts` adds, per token, the
prompt-lookup draft (runtime.speculative) proposed after it, for replaying LES's speculative batch verification:
a draft token is accepted while it equals the trace's next token (the traced text plays the model's greedy output).

`TraceDrive` replaces a Session's router and predictor, so the run reads real experts of the model's own size
and computes for real, but routes and prefetches as the traced model did. Mapping when shapes differ (stated in
every result as `routing_trace.mapping`):
  layers   the model's i-th MoE layer replays the trace's MoE layer i mod (trace MoE layers)
  experts  identity when the experts agree and the model's top-k is the trace's or more (a top-8 model driven by
           a top-6 trace computes 6 experts a token, as the traced run did); else, when the model's top-k is r
           times the trace's and it has r times the experts, trace expert e becomes the r experts r*e .. r*e+r-1.
           Anything else is refused.
  tokens   prefill token p replays trace token p; decode step n (engine.token_index) replays the token after
           the prompt's last, n - 1 positions on; the trace wraps around at its end.
Mixing weights are the router's as the trace records them (an imported trace's), split evenly over an expert's r
copies; uniform over the routed experts where the trace keeps none (a trace written by `trace`).

A trace without router inputs (an imported one: a real model's routing recorded elsewhere) cannot compute les's
lookahead (the next layer's router on this layer's state) nor Edge0's heads. There, a lookahead or prerouter
predictor is a MODELLED prediction (`modelled`): for each (token, layer) it names each true expert with probability
`recall` (the preset's lookahead_recall knob, default MODELLED_RECALL, inside the 0.66-0.88 published for early
routers), and fills the rest of its width with other experts drawn by the layer's usage in the trace (seeded: the
same trace and recall name the same experts). `shuffled` (a control) draws k experts from each layer's usage in the
trace, for any trace. The drive's `source` (in every run record) says which prediction is modelled and at what recall.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from workbench.errors import WorkbenchError
from workbench.presets import Predictor, Prefetch
from workbench.routing import topk_desc
from workbench.spec import MoESpec

RECORDABLE = ("lookahead", "history", "oracle", "shuffled", "prerouter")   # what a trace records or computes
PREDICTORS = ("lookahead:1:k", "lookahead:1:2k", "lookahead:2:k", "lookahead:2:2k", "history", "oracle")
DRAFT = 4               # draft tokens recorded per position: LES's speculative rung (experiments.ladder.les_rungs)


def drafts(ids: list[int], n: int = DRAFT) -> np.ndarray:
    """(T, n) int32: the prompt-lookup draft proposed after token t (context ids[:t+1]), -1 past its end."""
    from runtime.speculative import PromptLookup
    out = np.full((len(ids), n), -1, np.int32)
    for t in range(len(ids)):
        d = PromptLookup().propose(list(ids[:t + 1]), n)
        out[t, :len(d)] = d
    return out


def prerouter_predictions(trace: dict, spec: MoESpec, weights: dict, heads) -> np.ndarray:
    """(T, NL, k) int32: what Edge0's heads (workbench.edge0.serve.Heads) name for token t at MoE layer j, computed at
    token t-1 from layer j-1's normed input, routing and the routing of token t-2 there; -1 where no head names it."""
    from workbench.edge0.serve import features
    from workbench.predict import _rms
    from workbench.routing import route
    topk, h, layers = trace["topk"], trace["router_input"], list(trace["moe_layers"])
    T, NL, k = topk.shape
    out = np.full((T, NL, k), -1, np.int32)
    for j in range(1, NL):
        owner, target = layers[j - 1], layers[j]
        if owner not in heads.owners:
            continue
        x = _rms(h[:, j - 1].astype(np.float32), weights[f"layers.{owner}.mlp_norm"], spec.rms_norm_eps)
        prev = np.concatenate([np.zeros((1, k), topk.dtype), topk[:-1, j - 1]])
        f = features(x, topk[:, j - 1], prev, spec.num_experts)
        f[0, spec.hidden_size + spec.num_experts:] = 0.0            # the first token has no previous one
        idx, _ = route(spec, heads.logits(owner, f), weights.get(f"layers.{target}.router_bias"))
        out[1:, j] = idx[:-1]
    return out


def named_predictions(trace: dict, spec: MoESpec, weights: dict, heads=None) -> dict:
    """{predictor: (T, NL, width) int32}: the experts each predictor named for (token, layer); -1 where none.
    heads: Edge0's trained prerouter heads for the traced model, when it has them."""
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
    out.update(history_and_oracle(topk))
    if heads is not None:
        out["prerouter"] = prerouter_predictions(trace, spec, weights, heads)
    return out


def history_and_oracle(topk: np.ndarray) -> dict:
    """The predictors a trace's routing alone gives: history (the previous token's experts) and the oracle."""
    hist = np.full(topk.shape, -1, np.int32)
    hist[1:] = topk[:-1]
    return {"history": hist, "oracle": np.asarray(topk, np.int32)}


MODELLED_RECALL = 0.77      # the middle of the 0.66-0.88 published for early routers' lookahead (issue 50)


def modelled(topk: np.ndarray, width: int, recall: float, num_experts: int, seed: int) -> np.ndarray:
    """(T, NL, width) int32: per (token, layer), each of the true experts named with probability `recall` (the
    count drawn so that its mean is recall x top-k), the rest of the width other experts drawn by the layer's usage
    in the trace (every expert a little, so that a layer's rare ones can be drawn too)."""
    T, NL, k = topk.shape
    rng = np.random.default_rng(seed)
    out = np.full((T, NL, width), -1, np.int32)
    for j in range(NL):
        usage = np.bincount(topk[:, j].reshape(-1), minlength=num_experts) + 0.01
        for t in range(T):
            true = topk[t, j]
            n = min(k, width, int(np.floor(recall * k + rng.random())))
            named = list(rng.choice(true, n, replace=False)) if n else []
            p = usage.copy()
            p[true] = 0.0
            named += list(rng.choice(num_experts, width - n, replace=False, p=p / p.sum()))
            out[t, j] = named
    return out


def shuffled(topk: np.ndarray, num_experts: int, seed: int) -> np.ndarray:
    """(T, NL, k) int32: k experts per (token, layer) drawn by the layer's usage in the trace (the shuffled control)."""
    T, NL, k = topk.shape
    rng = np.random.default_rng(seed)
    out = np.empty((T, NL, k), np.int32)
    for j in range(NL):
        p = np.bincount(topk[:, j].reshape(-1), minlength=num_experts) + 0.01
        for t in range(T):
            out[t, j] = rng.choice(num_experts, k, replace=False, p=p / p.sum())
    return out


def replay_experts(path, trace_spec: dict, top_k: int, num_experts: int | None = None) -> int:
    """The experts per layer a model of this top-k needs to replay the trace (r x the trace's, r = top_k / the
    trace's top-k: the rule expert_map applies; or the trace's own where they are the model's `num_experts` and its
    top-k is at least the trace's), or a one-line refusal."""
    E, k = trace_spec["num_experts"], trace_spec["top_k"]
    if num_experts == E and top_k >= k:      # expert_map's identity with fewer experts a token than the model's
        return E
    if top_k < k or top_k % k:
        raise WorkbenchError(f"{path}: a trace of {E} experts top-{k} maps onto a model only when the model's top-k "
                             f"is a multiple of {k}; this model's is top-{top_k}")
    return top_k // k * E


def expert_map(path, trace_spec: dict, spec: MoESpec) -> tuple[int, str]:
    """The expansion r (trace expert e -> model experts r*e..r*e+r-1) and the stated rule, or a one-line refusal."""
    E, k = trace_spec["num_experts"], trace_spec["top_k"]
    if (E, k) == (spec.num_experts, spec.top_k):
        return 1, "experts: identity"
    if E == spec.num_experts and k < spec.top_k:
        return 1, (f"experts: identity, the trace's top-{k} routed on the model's top-{spec.top_k} ({k} experts a "
                   f"token computed, as the traced run)")
    r = spec.top_k // k
    if spec.top_k % k or spec.num_experts != r * E:
        raise WorkbenchError(
            f"{path}: a trace of {E} experts top-{k} maps onto a model only when the model's top-k is r times {k} "
            f"and it has r x {E} experts; this model has {spec.num_experts} experts top-{spec.top_k}"
            + (f" (make-model --experts {r * E} fits)" if r and not spec.top_k % k else ""))
    return r, f"experts: trace expert e -> model experts {r}e..{r}e+{r - 1} (top-{k} -> top-{spec.top_k})"


def drive(path):
    """What a Session's `drive` takes for the routing trace at `path` (None: no trace, routing as the model's)."""
    return partial(TraceDrive, path) if path else None


class TraceDrive:
    def __init__(self, path, spec: MoESpec, predictor: str | None, trace: dict | None = None, skip: int = 0,
                 recall: float | None = None, params: dict | None = None):
        """skip: trace rows before the run's first; recall: a modelled prediction's (an imported trace's lookahead or
        prerouter), None: MODELLED_RECALL. A predictor a trace does not record (one of the registry's others, a
        design's own) runs on what the trace gives: the routing, its held-out half; params: its parameters."""
        from experiments.traces import read_trace
        tr = trace or read_trace(path)      # trace: the file already read
        self.path, self.spec = str(path), spec
        self.topk, self.preds = tr["topk"], dict(tr.get("predictions", {}))
        self.weights = tr.get("weights")
        self.ids, self.drafts = tr["ids"], tr.get("drafts")
        meta = tr["meta"]
        self.T, tl = self.topk.shape[0], tr["moe_layers"]
        self.r, rule = expert_map(path, {"num_experts": meta["num_experts"], "top_k": meta["top_k"]}, spec)
        self.row_layer = {L: i % len(tl) for i, L in enumerate(spec.moe_layers)}
        self.mapping = (f"layers: model MoE layer i replays trace MoE layer i mod {len(tl)} (trace layers {tl}); "
                        f"{rule}; tokens: prompt then decode replay trace rows in order, wrapping at {self.T}")
        imported = meta.get("imported")
        self.source = {"path": self.path, "engine": meta.get("engine"), "model": meta.get("gguf") or meta.get("model")
                       or (imported or {}).get("model"), "tokens": self.T, "data": meta.get("data"),
                       "mapping": self.mapping, "imported": bool(imported),
                       "mixing_weights": "the trace's router weights" if self.weights is not None else "uniform"}
        self.predictor_name, self.skip = predictor, skip
        self.prompt_len = 0
        # a warm set's usage: the half of the trace that a run of fewer than T/2 tokens from `skip` does not replay
        self.held = held = (skip + np.arange(self.T // 2, self.T)) % self.T
        counts = {L: np.bincount(self.topk[held, j].reshape(-1), minlength=meta["num_experts"])
                  for L, j in self.row_layer.items()}
        self.usage = {L: np.repeat(c, self.r).tolist() for L, c in counts.items()}
        self.source["warm_usage"] = (f"trace rows {held[0]}-{held[-1]} (mod {self.T}): out of sample for a run that "
                                     f"replays fewer than {self.T // 2} rows")
        self.own = None                 # a predictor the trace does not record, run on the trace's routing
        if predictor and predictor.split(":")[0] == "prerouter":     # prerouter:SKIP names the layers from SKIP on
            predictor = "prerouter"
        if predictor and predictor.split(":")[0] not in RECORDABLE:
            self.own = self._own(path, predictor, params or {})
        elif predictor and predictor not in self.preds:
            self.preds[predictor] = self._computed(path, tr, predictor, recall)

    def _own(self, path, predictor: str, params: dict):
        from workbench.designs import Setup, predictor_class
        from workbench.presets import Prefetch
        cls = predictor_class(predictor)
        if missing := [n for n in getattr(cls, "needs", ()) if n not in ("routed", "phase", "engine")]:
            raise WorkbenchError(f"{path}: predictor {predictor} reads {', '.join(missing)}, which a routing trace does "
                                 f"not give (a trace-driven run gives a predictor the routing only)")
        sample = {L: self.experts(self.topk[self.held, j]) for L, j in self.row_layer.items()}
        self.source["prediction"] = (f"{predictor}: run on the trace's routing; held-out statistics from trace rows "
                                     f"{self.held[0]}-{self.held[-1]} (mod {self.T})")
        return cls.build(Setup(self.spec, usage=self.usage, sample=lambda: sample), Prefetch(predictor), params)

    def _computed(self, path, tr: dict, predictor: str, recall: float | None) -> np.ndarray:
        """What a predictor the trace did not record names: shuffled (any trace) or a modelled lookahead or
        prerouter (a trace without router inputs, stated in `source`); else a one-line refusal."""
        import zlib
        k, E = self.topk.shape[2], tr["meta"]["num_experts"]
        seed = zlib.crc32(predictor.encode())
        if predictor == "shuffled":
            self.source["prediction"] = "shuffled: k experts drawn by each layer's usage in this trace (in-sample)"
            return shuffled(self.topk, E, seed)
        kind = predictor.split(":")[0]
        if tr.get("router_input") is None and kind in ("lookahead", "prerouter"):
            recall = MODELLED_RECALL if recall is None else float(recall)
            width = k * (Prefetch.parse(predictor).width if kind == "lookahead" else 1)
            self.source.update(prediction=f"modelled prediction: {predictor} names each true expert with recall "
                                          f"{recall:g} (lookahead_recall), the rest of its {width} by the layer's usage "
                                          f"in the trace; the trace holds no router inputs", modelled_recall=recall)
            return modelled(self.topk, width, recall, E, seed)
        have = ", ".join(self.preds) or "none (a trace written before predictions were recorded)"
        raise WorkbenchError(f"{path}: predictor {predictor!r} is not recorded in this trace (it has: {have})")

    def experts(self, a: np.ndarray) -> np.ndarray:
        """Trace expert ids (any shape, -1 = none) -> model expert ids, last axis widened r times."""
        a = np.asarray(a)
        if self.r == 1:
            return a
        wide = self.r * a[..., :, None] + np.arange(self.r)
        return np.where(a[..., :, None] < 0, -1, wide).reshape(*a.shape[:-1], -1)

    def rows(self, engine, n: int, phase: str) -> np.ndarray:
        """The trace rows of a forward's n tokens: a prefill's rows skip..skip+P-1; a decode's the rows after the
        prompt at its tokens' places (a verification batch: its input token's and its drafts', in order)."""
        if phase == "prefill":
            self.prompt_len = n
            return (self.skip + np.arange(n)) % self.T
        return (self.skip + self.prompt_len - 1 + engine.token_index + np.arange(n)) % self.T

    def next_ids(self, engine, n: int) -> list[int]:
        """The trace's n tokens after the next decode's input token (a modelled draft's: runtime.speculative); token 0
        where the trace holds no token (an imported trace records routing only: the tokens fed do not route)."""
        first = self.skip + self.prompt_len + engine.pos - engine.prompt_end
        return [max(0, int(self.ids[(first + 1 + i) % self.T])) for i in range(n)]

    def route(self, layer: int, logits, ctx):
        """The router hook: the trace's experts for these tokens, and its mixing weights (uniform where it has none)."""
        rows, j = self.rows(ctx["engine"], len(logits), ctx["phase"]), self.row_layer[layer]
        idx = self.experts(self.topk[rows, j]).astype(np.int64)
        if self.weights is None:
            return idx, np.full(idx.shape, 1.0 / idx.shape[1], np.float32)
        return idx, np.repeat(self.weights[rows, j] / self.r, self.r, axis=-1).astype(np.float32)

    def predictor(self):
        return self.own if self.own is not None or not self.predictor_name else _Recorded(self)

    def draft(self, token_index: int, n: int) -> tuple[list[int], int]:
        """The recorded draft after decode step `token_index`'s input token (at most n tokens) and how many of it
        the trace's next tokens accept. A rejected draft token is routed as the trace's token at its place."""
        if self.drafts is None:
            raise WorkbenchError(f"{self.path}: no speculative drafts recorded (a trace written before they were): "
                                 f"write it again with `trace`")
        r = (self.skip + self.prompt_len - 1 + token_index) % self.T
        d = [int(t) for t in self.drafts[r][:n] if t >= 0]
        accepted = 0
        while accepted < len(d) and d[accepted] == self.ids[(r + 1 + accepted) % self.T]:
            accepted += 1
        return d, accepted


class _Recorded:
    """A predictor that names what the trace recorded for the target layer at this token."""

    def __init__(self, drive: TraceDrive):
        name = drive.predictor_name
        self.d, self.table = drive, drive.preds[name.split(":")[0] if name.startswith("prerouter") else name]
        self.skip = int(name.split(":")[1]) if name.startswith("prerouter:") else 1
        self.depth = int(name.split(":")[1]) if name.startswith("lookahead") else 1
        self.ahead = int(name.startswith("prerouter"))       # Edge0's heads name the next token's layer
        self.certain = name.startswith(("oracle", "prerouter"))     # replays the routing itself
        self.moe = drive.spec.moe_layers

    def predict(self, layer: int, ctx) -> dict:
        i = self.moe.index(layer) + self.depth
        if ctx["phase"] != "decode" or i >= len(self.moe) or (self.ahead and i < self.skip):
            return {}
        target = self.moe[i]
        rows = (self.d.rows(ctx["engine"], len(ctx["routed"]), "decode") + self.ahead) % self.d.T
        named = list(dict.fromkeys(int(e) for e in self.d.experts(self.table[rows, self.d.row_layer[target]]).reshape(-1)
                                   if e >= 0))          # a verification batch: its rows' union
        return {(target, ctx["engine"].token_index + 1): named} if self.ahead else {target: named}



def trained_heads(meta: dict, spec: MoESpec):
    """Edge0's prerouter heads for the traced model (its pack's, or beside its GGUF), or None where none is trained."""
    from workbench.edge0.artifacts import artifact_path
    from workbench.edge0.serve import Heads
    from workbench.store.pack import Pack
    ref = meta.get("pack") or meta.get("gguf")
    if not ref or not str(ref).endswith((".pack", ".index")):     # a pack, or an index of the checkpoint's own file
        return None
    pack = Pack(ref)
    return Heads.load(spec, pack) if artifact_path(pack, "prerouter").is_file() else None
