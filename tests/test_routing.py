"""Routers, checked on hand-worked examples."""
import numpy as np

from workbench.routing import sigmoid_group, softmax_topk, topk_desc


def test_softmax_topk_normalises_the_chosen_weights():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]], np.float32))
    idx, w = softmax_topk(logits, 2, norm_topk_prob=True)
    assert idx.tolist() == [[1, 3]]
    np.testing.assert_allclose(w, [[0.4 / 0.7, 0.3 / 0.7]], rtol=1e-6)
    idx, w = softmax_topk(logits, 2, norm_topk_prob=False)
    np.testing.assert_allclose(w, [[0.4, 0.3]], rtol=1e-6)


def test_sigmoid_group_by_hand():
    # 8 experts in 4 groups of 2. Sigmoid scores (chosen through their logits):
    s = np.array([0.90, 0.10,   0.60, 0.55,   0.70, 0.20,   0.30, 0.35], np.float32)
    logits = np.log(s / (1 - s))[None]
    # Group scores = sum of each group's top-2: 1.00, 1.15, 0.90, 0.65 -> keep groups 1 and 0 (topk_group=2).
    # Survivors: experts 0,1,2,3. Top-2 among them: 0 (0.90) and 2 (0.60), though expert 4 (0.70) beats 2:
    # its group lost. Weights: normalised scores times routed scaling 2.5.
    idx, w = sigmoid_group(logits, k=2, n_group=4, topk_group=2, norm_topk_prob=True, scaling=2.5)
    assert sorted(idx[0].tolist()) == [0, 2]
    np.testing.assert_allclose(sorted(w[0].tolist(), reverse=True), [2.5 * 0.9 / 1.5, 2.5 * 0.6 / 1.5], rtol=1e-5)


def test_sigmoid_group_correction_bias_selects_but_does_not_weigh():
    s = np.array([0.90, 0.10, 0.60, 0.55, 0.70, 0.20, 0.30, 0.35], np.float32)
    logits = np.log(s / (1 - s))[None]
    # A correction of +0.5 on expert 7 lifts group 3 to 0.30+0.85=1.15: it ties group 1 and beats group 0
    # (1.00), which is dropped with its 0.90 expert; among experts 2,3,6,7 the corrected top-2 is 7 and 2.
    corr = np.zeros(8, np.float32)
    corr[7] = 0.5
    idx, w = sigmoid_group(logits, k=2, n_group=4, topk_group=2, norm_topk_prob=False, scaling=1.0, correction=corr)
    assert sorted(idx[0].tolist()) == [2, 7]
    # the weights are the *uncorrected* sigmoid scores
    np.testing.assert_allclose(sorted(w[0].tolist()), [0.35, 0.60], rtol=1e-5)


def test_deepseek_v2_groups_rank_by_their_best_expert():
    # softmax probabilities, 8 experts in 4 groups of 2 (they sum to 1, so log() gives logits that reproduce them)
    p = np.array([0.20, 0.01,   0.12, 0.11,   0.18, 0.02,   0.17, 0.19], np.float32)
    logits = np.log(p)[None]
    # group_limited_greedy ranks groups by their max: 0.20, 0.12, 0.18, 0.19 -> keep groups 0 and 3;
    # top-2 among experts 0,1,6,7: 0 and 7. Ranked by top-2 sum (0.21, 0.23, 0.20, 0.36) groups 3 and 1 win: 7, 6.
    idx, w = softmax_topk(logits, 2, norm_topk_prob=False, n_group=4, topk_group=2, group_rank="max", scaling=1.5)
    assert idx[0].tolist() == [0, 7]
    np.testing.assert_allclose(w[0], [1.5 * 0.20, 1.5 * 0.19], rtol=1e-5)
    idx, _ = softmax_topk(logits, 2, norm_topk_prob=False, n_group=4, topk_group=2, group_rank="top2_sum")
    assert idx[0].tolist() == [7, 6]


def test_selection_bias_applies_after_a_softmax_gate_too():
    # a deepseek2 GGUF with softmax gating and exp_probs_b: llama.cpp adds the bias to the probabilities
    from workbench.routing import route
    from workbench.spec import MoESpec
    spec = MoESpec(family="deepseek_v2", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                   head_dim=8, num_experts=4, top_k=1, moe_intermediate_size=8, norm_topk_prob=False)
    probs = np.array([[0.4, 0.3, 0.2, 0.1]], np.float32)
    idx, w = route(spec, np.log(probs), correction=np.array([0, 0.15, 0, 0], np.float32))
    assert idx[0].tolist() == [1]
    np.testing.assert_allclose(w[0], [0.3], rtol=1e-5)


def test_cache_bias_changes_selection_not_weights():
    probs = np.array([[0.30, 0.28, 0.22, 0.20]], np.float32)
    bias = np.array([0, 0, 0.1, 0], np.float32)          # expert 2 is in memory
    idx, w = softmax_topk(np.log(probs), 2, norm_topk_prob=False, bias=bias)
    assert idx[0].tolist() == [2, 0]
    np.testing.assert_allclose(w[0], [0.22, 0.30], rtol=1e-5)


def test_topk_desc_orders_largest_first():
    assert topk_desc(np.array([[1.0, 5.0, 3.0, 4.0]]), 3).tolist() == [[1, 3, 2]]


def test_compiled_topk_and_select_equal_a_stable_numpy_sort():
    """The compiled top-k (per layer, every token) is a stable descending sort's first k, ties to the lower index,
    for every rank and float type; select's weights are numpy's: the chosen scores, renormalised, scaled."""
    from workbench.routing import select
    rng = np.random.default_rng(0)
    for shape, k in [((1, 32), 4), ((7, 64), 8), ((3, 5, 128), 10), ((2, 8), 8), ((4, 6), 1)]:
        for dtype in (np.float32, np.float64):
            s = np.round(rng.standard_normal(shape) * 3).astype(dtype)          # rounded: many ties
            want = np.argsort(-s, axis=-1, kind="stable")[..., :k]
            assert (topk_desc(s, k) == want).all(), (shape, k, dtype)
    for T, E, k in [(1, 32, 4), (5, 128, 8), (3, 64, 6)]:
        for norm, scaling in [(True, 1.0), (False, 2.5), (True, 2.5)]:
            s = rng.random((T, E), dtype=np.float32)
            idx, w = select(s, k, norm, scaling)
            want = np.take_along_axis(s, np.argsort(-s, axis=-1, kind="stable")[:, :k], -1)
            if norm:
                want = want / (want.sum(-1, keepdims=True) + 1e-20)
            assert (idx == np.argsort(-s, axis=-1, kind="stable")[:, :k]).all()
            np.testing.assert_allclose(w, want * np.float32(scaling), rtol=2e-7, atol=0)


def test_routing_by_softmax_in_one_call_chooses_as_the_general_path():
    """route's compiled softmax and select (a softmax gate without groups or biases: every decode step of most
    families) chooses the general path's experts (numpy's softmax, then select), ties to the lower index, and
    weighs them alike to float32 rounding (exp's rounding and the sum's order differ by an ulp or so)."""
    from workbench.routing import route, select, softmax
    from workbench.spec import MoESpec
    rng = np.random.default_rng(1)
    for T, E, k in [(1, 512, 10), (4, 64, 8), (16, 128, 6), (2, 8, 8)]:
        for norm, scaling in [(True, 1.0), (False, 1.0), (True, 2.5)]:
            spec = MoESpec(family="qwen3_moe", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                           num_kv_heads=1, head_dim=8, num_experts=E, top_k=k, moe_intermediate_size=8,
                           norm_topk_prob=norm, routed_scaling_factor=scaling)
            for logits in (rng.standard_normal((T, E)) * 4, np.round(rng.standard_normal((T, E)) * 3)):  # ties
                logits = logits.astype(np.float32)
                idx, w = route(spec, logits)
                want_idx, want_w = select(softmax(logits), k, norm, scaling)
                assert (idx == want_idx).all(), (T, E, k, norm)
                np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-9)
