"""Prediction recall and precision are computed against the real routing; checked on hand-made cases."""
from __future__ import annotations

import numpy as np

from workbench.predict import Lookahead, Shuffled, recall
from workbench.spec import MoESpec
from workbench.telemetry import LayerEvent, Telemetry


def spec(layers=4, experts=8, k=2, d=16):
    return MoESpec(family="qwen3_moe", vocab_size=10, hidden_size=d, num_layers=layers, num_heads=2, num_kv_heads=1,
                   head_dim=8, num_experts=experts, top_k=k, moe_intermediate_size=64)


def test_recall_by_hand():
    assert recall([1, 2, 3, 4], [2, 4, 5, 6]) == 0.5
    assert recall([], [1, 2]) == 0.0
    assert recall([0, 1, 2, 3], [3]) == 1.0


def test_per_layer_recall_and_precision_by_hand():
    tel = Telemetry(num_layers=2)
    # layer 1, token 0: predicted {1,2,3,4}, routed {2,5}: 1 of 2 routed predicted; 1 of 4 predictions used
    tel.add_event(LayerEvent(0, 1, "decode", routed=[2, 5], predicted=[1, 2, 3, 4], hit=[True, False]))
    # layer 1, token 1: predicted {5,6}, routed {5,6}
    tel.add_event(LayerEvent(1, 1, "decode", routed=[5, 6], predicted=[5, 6], hit=[True, True]))
    tel.add_event(LayerEvent(0, 0, "decode", routed=[0, 1], predicted=[], hit=[False, False]))
    rows = {r["layer"]: r for r in tel.per_layer()}
    assert rows[1]["recall"] == 3 / 4 and rows[1]["precision"] == 3 / 6
    assert rows[0]["recall"] is None                   # nothing predicted for the first layer
    assert rows[1]["hit_rate"] == 3 / 4 and rows[0]["hit_rate"] == 0.0


def test_lookahead_applies_the_target_layers_norm_and_router():
    s = spec()
    rng = np.random.default_rng(0)
    w = {f"layers.{i}.{n}": rng.normal(size=shape).astype(np.float32)
         for i in range(4) for n, shape in (("mlp_norm", (16,)), ("router", (8, 16)))}
    h = rng.normal(size=(1, 16)).astype(np.float32)
    for depth, width in ((1, 1), (2, 2)):
        pred = Lookahead(s, w, depth=depth, width=width).predict(0, {"phase": "decode", "h": h})
        target = depth
        x = w[f"layers.{target}.mlp_norm"] * h / np.sqrt((h * h).mean() + s.rms_norm_eps)
        expect = np.argsort(-(x @ w[f"layers.{target}.router"].T)[0])[: 2 * depth]
        assert list(pred) == [target] and pred[target] == expect.tolist()
    assert Lookahead(s, w, depth=1).predict(3, {"phase": "decode", "h": h}) == {}   # no layer after the last


def test_shuffled_keeps_marginal_frequencies():
    s = spec()
    usage = {L: [100, 0, 0, 50, 50, 0, 0, 0] for L in range(4)}
    sh = Shuffled(s, usage, seed=1)
    counts = np.zeros(8)
    for _ in range(2000):
        for e in sh.predict(0, {"phase": "decode"})[1]:
            counts[e] += 1
    assert counts[[1, 2, 5, 6, 7]].sum() == 0          # never-used experts are never drawn
    assert counts[0] > counts[3] and counts[0] > counts[4]
