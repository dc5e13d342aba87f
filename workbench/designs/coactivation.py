"""Co-activation (mbolt's profiles, doramirdor/mbolt): the experts that fire together across adjacent layers. The
next MoE layer's experts are predicted from this layer's by how often each pair fired in the same token, counted on
held-out text (a trace's other half) and then on the run's own tokens as they route."""
from __future__ import annotations

import numpy as np

from workbench.designs.base import Predictor


class CoActivation(Predictor):
    params = {"width": 1.0, "online": 1}       # experts named, in multiples of top-k; keep counting while running

    def __init__(self, setup, **params):
        super().__init__(setup, **params)
        s = self.spec
        self.moe, self.k = list(s.moe_layers), max(1, int(round(self.width * s.top_k)))
        self.next = dict(zip(self.moe, self.moe[1:]))
        self.pairs = {L: np.zeros((s.num_experts, s.num_experts), np.float32) for L in self.next}
        sample = setup.sample() if setup.sample else None
        for L, nxt in self.next.items():
            if sample and L in sample and nxt in sample:
                a, b = np.asarray(sample[L]), np.asarray(sample[nxt])
                n = min(len(a), len(b))
                np.add.at(self.pairs[L], (np.repeat(a[:n], b.shape[1], 1).ravel(), np.tile(b[:n], a.shape[1]).ravel()), 1)
        self.prev = None                # (layer, experts) routed at the previous MoE layer of this token

    def predict(self, layer: int, ctx: dict) -> dict:
        routed = np.unique(np.asarray(ctx["routed"]).reshape(-1))
        decode = ctx["phase"] == "decode"
        if decode and self.online and self.prev is not None and self.next.get(self.prev[0]) == layer:
            a = self.prev[1]
            np.add.at(self.pairs[self.prev[0]], (np.repeat(a, len(routed)), np.tile(routed, len(a))), 1)
        self.prev = (layer, routed)
        if not decode or layer not in self.next:
            return {}
        score = self.pairs[layer][routed].sum(0)
        if not score.any():
            return {}
        top = np.argsort(-score, kind="stable")[:self.k]
        return {self.next[layer]: top[score[top] > 0].tolist()}
