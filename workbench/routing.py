"""Routers: router logits -> (top-k expert ids, mixing weights), for every supported family.

`bias` (cache-aware routing) is added to the scores used to *select* experts only; the
mixing weights always come from the unbiased scores. CacheBias is that policy, a Router (workbench.designs).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from workbench.designs.base import Router
from workbench.spec import MoESpec


def along_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """np.take_along_axis(a, idx, -1) by one fancy index (a tenth of its Python overhead: this runs per layer)."""
    flat, fi = a.reshape(-1, a.shape[-1]), idx.reshape(-1, idx.shape[-1])
    return flat[np.arange(flat.shape[0])[:, None], fi].reshape(idx.shape)


@njit(cache=True, nogil=True)
def topk_rows(scores, k, out):
    """out[r] = the k largest of scores[r], largest first, the lower index first among equals (a stable sort's
    order): one pass keeping a sorted top-k, as a decode step routes one row of a few dozen experts."""
    for r in range(scores.shape[0]):
        n = 0
        for e in range(scores.shape[1]):
            v = scores[r, e]
            if n == k:
                if not v > scores[r, out[r, k - 1]]:
                    continue
                j = k - 1
            else:
                j = n
                n += 1
            while j > 0 and scores[r, out[r, j - 1]] < v:
                out[r, j] = out[r, j - 1]
                j -= 1
            out[r, j] = e


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row (last axis), largest first; among equal scores the lower index first.
    Compiled: this runs at every MoE layer of every token, where numpy's argpartition and argsort cost more than the
    work."""
    rows = np.ascontiguousarray(scores).reshape(-1, scores.shape[-1])
    out = np.empty((rows.shape[0], k), np.int64)
    topk_rows(rows, k, out)
    return out.reshape(*scores.shape[:-1], k)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def best_groups(choice, n_group, topk_group, rank="top2_sum"):
    """Mask (-inf) every expert outside the topk_group best groups, groups ranked by the sum of their
    top-2 scores (DeepSeek-V3, llama.cpp) or by their best score (DeepSeek-V2's group_limited_greedy)."""
    T, E = choice.shape
    groups = choice.reshape(T, n_group, E // n_group)
    group_score = groups.max(-1) if rank == "max" else np.sort(groups, axis=-1)[..., -2:].sum(-1)
    keep = topk_desc(group_score, topk_group)
    mask = np.zeros((T, n_group), dtype=bool)
    np.put_along_axis(mask, keep, True, -1)
    return np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)


def select(scores, k, norm_topk_prob, scaling=1.0, n_group=1, topk_group=1, group_rank="top2_sum",
           correction=None, bias=None):
    """Top-k experts by score (plus the selection-only correction and bias), within the best groups;
    weights are the unbiased scores of the chosen, optionally renormalised, times the routed scaling."""
    choice = scores
    for add in (correction, bias):
        if add is not None:
            choice = choice + add
    if n_group > 1:
        choice = best_groups(choice, n_group, topk_group, group_rank)
    if scores.ndim == 2 and scores.dtype == np.float32 and choice.dtype == np.float32:
        idx, w = np.empty((scores.shape[0], k), np.int64), np.empty((scores.shape[0], k), np.float32)
        _select_rows(np.ascontiguousarray(scores), np.ascontiguousarray(choice), k, norm_topk_prob,
                     np.float32(scaling), idx, w)
        return idx, w
    idx = topk_desc(choice, k)
    w = along_rows(scores, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, (w if scaling == 1.0 else w * np.float32(scaling))


@njit(cache=True, nogil=True)
def _select_rows(scores, choice, k, norm, scaling, idx, w):
    """select()'s top-k and weights in one compiled call (float32 rows; the sum runs in float32 in the same order
    as numpy's below eight terms)."""
    topk_rows(choice, k, idx)
    for r in range(scores.shape[0]):
        total = np.float32(0.0)
        for j in range(k):
            w[r, j] = scores[r, idx[r, j]]
            total += w[r, j]
        if norm:
            total = total + np.float32(1e-20)
            for j in range(k):
                w[r, j] = w[r, j] / total
        if scaling != np.float32(1.0):
            for j in range(k):
                w[r, j] = w[r, j] * scaling


@njit(cache=True, nogil=True)
def _softmax_select(logits, k, norm, scaling, idx, w):
    """select(softmax(logits), ...) without groups or biases, in one compiled call: numpy's calls cost a decode
    step's routing about twice this at full size (43 against 23 us a layer). Its sum's order and exp's rounding
    differ from numpy's by an ulp or so."""
    p = np.empty_like(logits)
    for r in range(logits.shape[0]):
        m = logits[r].max()
        total = np.float32(0.0)
        for e in range(logits.shape[1]):
            p[r, e] = np.exp(logits[r, e] - m)
            total += p[r, e]
        for e in range(logits.shape[1]):
            p[r, e] = p[r, e] / total
    _select_rows(p, p, k, norm, scaling, idx, w)


def softmax_topk(logits, k, norm_topk_prob, bias=None, n_group=1, topk_group=1, group_rank="max", scaling=1.0):
    return select(softmax(logits.astype(np.float32)), k, norm_topk_prob, scaling, n_group, topk_group, group_rank,
                  bias=bias)


def sigmoid_group(logits, k, n_group, topk_group, norm_topk_prob, scaling, correction=None, bias=None, group_rank="top2_sum"):
    """DeepSeek-V3: sigmoid scores, a selection-only correction, the best groups by their top-2 sum."""
    return select(1.0 / (1.0 + np.exp(-logits.astype(np.float32))), k, norm_topk_prob, scaling, n_group, topk_group,
                  group_rank, correction, bias)


def route(spec: MoESpec, logits: np.ndarray, correction=None, bias=None):
    """correction: the checkpoint's selection bias (DeepSeek-V3's e_score_correction_bias, GGUF exp_probs_b),
    applied after either gate, as llama.cpp's build_moe_ffn does."""
    logits = logits.astype(np.float32)
    if spec.router == "softmax_topk" and spec.n_group == 1 and correction is None and bias is None and logits.ndim == 2:
        idx, w = np.empty((logits.shape[0], spec.top_k), np.int64), np.empty((logits.shape[0], spec.top_k), np.float32)
        _softmax_select(logits, spec.top_k, spec.norm_topk_prob, np.float32(spec.routed_scaling_factor), idx, w)
        return idx, w
    scores = 1.0 / (1.0 + np.exp(-logits)) if spec.router == "sigmoid_group" else softmax(logits)
    return select(scores, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor, spec.n_group,
                  spec.topk_group, spec.group_rank, correction, bias)


class CacheBias(Router):
    """smol_bias's routing (cache_bias:BETA), on the design interface: `beta` added to the selection score of each of
    the layer's experts whose bytes are in the cache (an entry still being read, which has done(), gets none)."""
    params = {"beta": 0.05}

    def route(self, layer, logits, ctx):
        bias = np.zeros(self.spec.num_experts, np.float32)
        for (L, e) in self.cache.keys(layer):
            v = self.cache.peek((L, e))
            if L == layer and v is not None and not hasattr(v, "done"):
                bias[e] = self.beta
        return self.exact(layer, logits, bias)
