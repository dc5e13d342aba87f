"""Perplexity, by llama.cpp's method or with a sliding window.

llama.cpp (`llama-perplexity`): the text is tokenized once and cut into non-overlapping chunks of
n_ctx tokens; each chunk is evaluated from an empty KV cache and only the second half of it is
scored (the tokens after position n_ctx/2, each predicted with at least n_ctx/2 tokens of context).
The estimate is exp(mean NLL) and its standard error is ppl * sqrt(var(NLL) / (n - 1)), var being
the mean of NLL^2 minus the squared mean, exactly as llama.cpp prints "PPL = X +/- Y".

Strided (`stride=S`): windows of n_ctx tokens starting every S tokens; each window scores only the
tokens no earlier window scored (the first window scores all but its first token), so every token
is scored once with up to n_ctx - S tokens of guaranteed context (the Hugging Face recipe).
"""
from __future__ import annotations

import math
import time

import numpy as np

from evals.common import forward, log_softmax, mean_stderr, text_ids
from workbench.errors import WorkbenchError


def windows(n_tokens: int, n_ctx: int, chunks: int | None = None, stride: int | None = None) -> list[tuple[int, int, int]]:
    """(begin, end, first_target) per window: tokens [begin, end) are run, targets [first_target, end) scored."""
    if n_ctx < 4:
        raise WorkbenchError(f"--ctx {n_ctx}: too small (at least 4)")
    out = []
    if stride is None:
        n = n_tokens // n_ctx
        if chunks is not None:
            n = min(n, chunks)
        for i in range(n):
            b = i * n_ctx
            out.append((b, b + n_ctx, b + n_ctx // 2 + 1))
    else:
        if not 0 < stride < n_ctx:
            raise WorkbenchError(f"--stride {stride}: must be between 1 and --ctx - 1 ({n_ctx - 1}), so that windows "
                                 "overlap and every token is scored once")
        prev_end, b = 0, 0
        while prev_end < n_tokens and (chunks is None or len(out) < chunks):
            e = min(b + n_ctx, n_tokens)
            first = max(prev_end, b + 1)
            if first < e:
                out.append((b, e, first))
            prev_end = e
            b += stride
    if not out:
        raise WorkbenchError(f"{n_tokens} tokens: not enough text for one window of {n_ctx}")
    return out


def tokens_needed(n_ctx: int, chunks: int | None, stride: int | None) -> int | None:
    if chunks is None:
        return None
    return chunks * n_ctx if stride is None else (chunks - 1) * stride + n_ctx


def window_nll(logits: np.ndarray, ids, b: int, first: int, e: int) -> tuple[np.ndarray, np.ndarray]:
    """NLL of targets ids[first:e] from the window's logits (row j predicts token b + j + 1); also the log-probs."""
    lp = log_softmax(logits[first - 1 - b: e - 1 - b])
    tgt = np.asarray(ids[first:e])
    return -lp[np.arange(len(tgt)), tgt], lp


def perplexity(session, ids: list[int], n_ctx: int = 512, chunks: int | None = None, stride: int | None = None,
               bos: bool = False, progress: bool = True) -> dict:
    """Perplexity of `ids` under the session's model. bos: put BOS at the start of every window (llama.cpp add_bos)."""
    from tqdm import tqdm
    limit = session.spec.max_position_embeddings
    if n_ctx > limit:
        raise WorkbenchError(f"--ctx {n_ctx}: the model's context is {limit} tokens")
    if bos and session.spec.bos_token_id is None:
        raise WorkbenchError("--bos: the model has no BOS token")
    wins = windows(len(ids), n_ctx, chunks, stride)
    nll, per_chunk = [], []
    t0 = time.perf_counter()
    for b, e, first in tqdm(wins, desc=f"ppl {session.preset.name}", unit="chunk", disable=not progress):
        w = list(ids[b:e])
        if bos:
            w[0] = session.spec.bos_token_id
        v, _ = window_nll(forward(session, w), ids, b, first, e)
        nll.append(v)
        per_chunk.append(float(np.exp(v.mean())))
    nll = np.concatenate(nll)
    mean, se = mean_stderr(nll)
    ppl = math.exp(mean)
    return {"ppl": ppl, "ppl_stderr": ppl * se, "nll": mean, "nll_stderr": se, "tokens": int(nll.size),
            "chunks": len(wins), "ctx": n_ctx, "method": "llama.cpp" if stride is None else "strided",
            "stride": stride, "bos": bos, "per_chunk_ppl": per_chunk, "seconds": time.perf_counter() - t0}


def run(model: str, preset: str, budget=None, data: str = "wikitext2", n_ctx: int = 512, chunks: int | None = None,
        stride: int | None = None, bos: bool = False, progress: bool = True, record: bool = True,
        engine: str | None = None, direct: bool = True, device: str | None = None) -> dict:
    from evals.common import record as write_record
    from runtime.session import open_session
    with open_session(model, preset, budget, prompt=None, engine=engine, direct=direct, device=device) as s:
        need = tokens_needed(n_ctx, chunks, stride)
        ids = text_ids(s.tokenizer, data, need)
        if need:
            ids = ids[:need]
        res = perplexity(s, ids, n_ctx, chunks, stride, bos, progress)
        res.update(model=model, preset=s.preset.name, budget=s.budget_text, data=data, **s.labels())
        params = {"data": data, "ctx": n_ctx, "chunks": chunks, "stride": stride, "bos": bos}
        res["run"] = write_record("ppl", s, params, {k: v for k, v in res.items() if k != "run"}, enabled=record)
    return res
