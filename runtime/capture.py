"""Record the routing an engine actually executes, wrapping the session's router hook.

One mechanism for everything that needs the routing: the oracle's trace, the usage profile,
routing traces, the model card's statistics and the teacher comparison.
"""
from __future__ import annotations

import numpy as np

from workbench.routing import route


class RoutingCapture:
    """Per routed call: layer, phase, token index and top-k ids, and the router's context that `keep` names
    ("logits", "x" the router input, "h" the residual stream). `take()` returns {layer: (T, k)} for everything
    since the last take."""

    def __init__(self, session, keep: tuple[str, ...] = ()):
        self.session = session
        self.records: list[dict] = []
        spec, w, engine = session.spec, session.engine.w, session.engine

        def hook(layer, logits, ctx):
            if self.prev is not None:
                routed = self.prev(layer, logits, ctx)      # a low tier's router adds its marks: passed on
            else:
                routed = route(spec, logits, w.get(f"layers.{layer}.router_bias"))
            idx = routed[0]
            ids = np.array(idx, dtype=np.int32, copy=True)
            if ids.shape[-1] < spec.top_k:      # a lever computed fewer (workbench.designs.lossy): -1 for the rest
                ids = np.pad(ids, ((0, 0), (0, spec.top_k - ids.shape[-1])), constant_values=-1)
            rec = {"layer": layer, "phase": ctx["phase"], "token": engine.token_index, "idx": ids}
            for k in keep:
                rec[k] = np.array(logits if k == "logits" else ctx[k], dtype=np.float32, copy=True)
            self.records.append(rec)
            return routed

        self.prev = engine.swap_router_hook(hook)

    def take(self, key: str = "idx") -> dict[int, np.ndarray]:
        return self.take_all((key,))[key]

    def take_all(self, keys: tuple[str, ...]) -> dict[str, dict[int, np.ndarray]]:
        """{key: {layer: the records' arrays concatenated}} for everything since the last take."""
        out = {k: {} for k in keys}
        for r in self.records:
            for k in keys:
                out[k].setdefault(r["layer"], []).append(r[k])
        self.records = []
        return {k: {L: np.concatenate(v, 0) for L, v in got.items()} for k, got in out.items()}

    def remove(self):
        self.session.engine.swap_router_hook(self.prev)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.remove()
