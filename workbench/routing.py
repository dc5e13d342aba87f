"""Routers: router logits -> (top-k expert ids, mixing weights), for every supported family.

`bias` (cache-aware routing) is added to the scores used to *select* experts only; the
mixing weights always come from the unbiased scores.
"""
from __future__ import annotations

import numpy as np

from workbench.spec import MoESpec


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first."""
    idx = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(scores, idx, -1), axis=-1, kind="stable")
    return np.take_along_axis(idx, order, -1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def softmax_topk(logits, k, norm_topk_prob, bias=None):
    probs = softmax(logits.astype(np.float32))
    idx = topk_desc(probs if bias is None else probs + bias, k)
    w = np.take_along_axis(probs, idx, -1)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return idx, w


def sigmoid_group(logits, k, n_group, topk_group, norm_topk_prob, scaling, correction=None, bias=None):
    """DeepSeek-V3: sigmoid scores; rank groups by the sum of their top-2 (bias-corrected) scores, keep the
    best topk_group groups, pick top-k among their experts; weights are the uncorrected scores."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float32)))
    choice = scores + (0.0 if correction is None else correction)
    if bias is not None:
        choice = choice + bias
    T, E = choice.shape
    groups = choice.reshape(T, n_group, E // n_group)
    group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)
    keep = topk_desc(group_score, topk_group)
    mask = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)
    idx = topk_desc(choice, k)
    w = np.take_along_axis(scores, idx, -1)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * scaling


def route(spec: MoESpec, logits: np.ndarray, correction=None, bias=None):
    if spec.router == "sigmoid_group":
        return sigmoid_group(logits, spec.top_k, spec.n_group, spec.topk_group, spec.norm_topk_prob,
                             spec.routed_scaling_factor, correction, bias)
    return softmax_topk(logits, spec.top_k, spec.norm_topk_prob, bias)
