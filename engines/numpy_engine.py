"""The numpy reference engine: the decoder (engines/decoder.py) in exact fp32 numpy, for every supported family.

Its expert-compute object runs each routed expert on the f32 arrays the streamer hands over (the pack's parts
dequantized) and sums the results in expert-id order, so the arrival order never changes the numbers.
"""
from __future__ import annotations

import weakref
import numpy as np
from threadpoolctl import threadpool_limits

from engines.base import Hooks, dense_weights
from engines.decoder import Decoder
from workbench.errors import WorkbenchError
from workbench.store.pack import Pack
from workbench.streamer import ExpertStreamer
from workbench.telemetry import Telemetry


class NumpyExperts:
    def __init__(self, decoder: Decoder):
        self.decoder = weakref.proxy(decoder)      # the decoder holds these

    def begin(self, layer: int, x, idx, weights):
        """compute(experts, their f32 weights) for the streamer, called on each batch as it arrives."""
        self.layer, self.x, self.idx, self.weights, self.contrib = layer, x, idx, weights, {}
        return self.compute

    def compute(self, es, ews):
        x, idx, weights = self.x, self.idx, self.weights
        for e, ew in zip(es, ews):
            rows, slot = np.nonzero(idx == e)
            self.contrib[e] = (rows, self.decoder.mlp(x[rows], ew["gate"], ew["up"], ew["down"])
                               * weights[rows, slot][:, None])

    def compute_low(self, es):
        """Experts `es` from the low tier's copies, dequantized."""
        low = self.decoder.low
        for e in es:
            if not low.holds(self.layer, e):
                raise WorkbenchError(f"layer {self.layer}: the router marked expert {e} for the low tier, which does "
                                     f"not hold it (its low_experts())")
        self.compute(es, [low.weights(self.layer, e) for e in es])

    def combine(self, needed):
        out = np.zeros_like(self.x)
        for e in needed:                        # a fixed order: the same sum whatever the arrival order
            rows, y = self.contrib[e]
            out[rows] += y                      # rows are distinct: a token picks an expert once
        return out


class NumpyEngine(Decoder):
    name = "numpy"
    computes_low = True

    @classmethod
    def resident_bytes(cls, pack) -> int:
        return 4 * sum(int(np.prod(t["shape"])) for t in pack.tensors.values())       # all f32

    def __init__(self, pack: Pack, streamer: ExpertStreamer, telemetry: Telemetry, hooks: Hooks = Hooks(),
                 weights: dict | None = None, max_context: int | None = None):
        super().__init__(pack, streamer, telemetry, hooks)
        # Decode matmuls are tiny: one BLAS thread is faster, and leaves the other cores to the reader pool.
        threadpool_limits(limits=1, user_api="blas")
        self.setup(dense_weights(pack) if weights is None else weights, max_context, NumpyExperts(self))
