"""Shared pieces of the evaluation layer: log-probabilities, routing capture, run records (a session: runtime.session.open_session)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from runtime.capture import RoutingCapture  # noqa: F401  (the eval modules use it from here)
from workbench.errors import WorkbenchError

REPO = Path(__file__).resolve().parents[1]
PRESET_ORDER = ("teacher", "resident", "on_demand", "les", "smol", "smol_bias", "edge0")


def emulated(res: dict) -> str:
    """The prefix of a result line whose reads emulated a device's flash."""
    return f"EMULATED {res['device']['name']} flash: " if res.get("emulated") else ""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (logits: (T, V))."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def forward(session, ids) -> np.ndarray:
    """Logits (T, V) of `ids` from an empty KV cache."""
    session.engine.reset()
    return session.step(list(map(int, ids)), "prefill")


def decoded(session, ids) -> np.ndarray:
    """Logits (T, V) of `ids` from an empty KV cache, one token a step as decoding runs them: what a lever that acts
    while decoding (drop_misses: the experts not in memory then) does to the output shows here, not in `forward`."""
    session.engine.reset()
    out = [session.step([int(ids[0])], "prefill")]
    out += [session.step([int(t)], "decode") for t in ids[1:]]
    return np.concatenate(out)


def trim_telemetry(session, keep: int = 20000):
    """Long evaluations and servers must not grow the session's telemetry lists without bound
    (live views read the bounded `ring`)."""
    tel = session.tel
    with tel.lock:
        if len(tel.events) > 2 * keep:
            del tel.events[:-keep]
        if len(tel.tokens) > 2 * keep:
            del tel.tokens[:-keep]


def mean_stderr(values) -> tuple[float, float]:
    """Mean and standard error of the mean (sqrt(var / (n - 1)), var the population variance), as llama.cpp."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    if n == 0:
        return float("nan"), float("nan")
    mean = float(v.mean())
    var = float((v * v).mean() - mean * mean)
    return mean, (math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0)


def routing_overlap(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token: |set(a) & set(b)| / k, and whether the sets are equal. a, b: (T, k) expert ids."""
    a, b = np.sort(a, -1), np.sort(b, -1)
    k = a.shape[-1]
    inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
    return inter / k, (inter == k)


def record(kind: str, session, params: dict, summary: dict, layers: list[dict] | None = None,
           enabled: bool = True) -> str | None:
    """Write a run record whose config carries {"eval": kind, ...}; returns its path (None when disabled)."""
    if not enabled:
        return None
    from workbench.runs import write_run
    cfg = {"eval": kind, **session.config(), **params}
    summ = dict(summary)
    try:
        s = session.summary()
        summ.setdefault("engine", {k: s[k] for k in ("hit_rate", "hits", "misses", "prefill_tokens", "prefill_tok_s",
                                                     "cache_peak_bytes", "budget_bytes", "peak_rss_bytes")
                                   if k in s})
    except Exception:   # telemetry is a bonus in an eval record
        pass
    return str(write_run(session.preset.name, cfg, summ, layers or [], []))


def text_ids(tokenizer, data: str, need: int | None = None) -> list[int]:
    """Token ids of a held-out corpus (tinystories, wikitext2) or a text file, tokenized as one text.

    With `need`, only a prefix of the text (cut at a line break) is tokenized when it yields comfortably
    more than `need` tokens; the first `need` tokens are then those of the whole text.
    """
    from workbench.textdata import text_of
    if tokenizer is None:
        raise WorkbenchError("the model has no tokenizer")
    text = text_of(data)
    if need:
        cut = need * 12
        while cut < len(text):
            nl = text.rfind("\n", 0, cut)
            ids = tokenizer.encode(text[: nl if nl > 0 else cut]).ids
            if len(ids) >= need + 64:
                return ids
            cut *= 2
    return tokenizer.encode(text).ids
