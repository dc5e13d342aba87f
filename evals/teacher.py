"""Student vs teacher on the same tokens: KL(teacher || student), top-1 agreement, both perplexities,
and per-layer routing agreement.

The tokens and scored positions are those of the perplexity method (evals.ppl: llama.cpp chunks,
second half scored, or strided windows), like llama.cpp's --kl-divergence. Routing is captured
with a router hook on both engines (the teacher routes exactly; the student with its preset's
routing, on its own hidden states) at every position of every window; agreement per layer is
the mean over tokens of |top-k(teacher) & top-k(student)| / k, and `routing_exact` the share of
tokens whose top-k sets are equal.
"""
from __future__ import annotations

import math
import time

import numpy as np

from evals.common import RoutingCapture, decoded, forward, mean_stderr, routing_overlap, text_ids
from evals.ppl import tokens_needed, window_nll, windows
from workbench.errors import WorkbenchError


class TeacherTrace:
    """The teacher's log-probs, NLL and routing per window, computed once and reusable for many students."""

    def __init__(self, teacher, ids, n_ctx, chunks=None, stride=None, progress=True, data: str = ""):
        from tqdm import tqdm
        if n_ctx > teacher.spec.max_position_embeddings:
            raise WorkbenchError(f"--ctx {n_ctx}: the model's context is {teacher.spec.max_position_embeddings} tokens")
        self.ids, self.n_ctx, self.chunks, self.stride, self.data = list(ids), n_ctx, chunks, stride, data
        self.wins = windows(len(ids), n_ctx, chunks, stride)
        self.pack_id = teacher.pack.content_id()
        self.where, self.vocab = str(teacher.pack_path), teacher.spec.vocab_size
        self.layers = list(teacher.spec.moe_layers)
        self.items = []
        cap = RoutingCapture(teacher)
        try:
            for b, e, first in tqdm(self.wins, desc="teacher", unit="chunk", disable=not progress):
                nll, lp = window_nll(forward(teacher, ids[b:e]), ids, b, first, e)
                self.items.append((nll, lp.astype(np.float32), cap.take()))
        finally:
            cap.remove()


def compare(student, trace: TeacherTrace, progress: bool = True, decode: bool = False) -> dict:
    """decode: the student runs each window one token a step (evals.common.decoded), as decoding does; else in one
    forward, as the teacher does."""
    from tqdm import tqdm
    s = student.spec
    if (s.vocab_size, list(s.moe_layers)) != (trace.vocab, trace.layers):
        raise WorkbenchError(f"{student.pack_path}: {s.vocab_size} tokens and MoE layers {list(s.moe_layers)}, its "
                             f"teacher {trace.where} {trace.vocab} and {trace.layers}: not the same model's")
    ids = trace.ids
    kl, agree, nll_s, nll_t = [], [], [], []
    overlap = {L: [] for L in trace.layers}
    exact = {L: [] for L in trace.layers}
    cap = RoutingCapture(student)
    t0 = time.perf_counter()
    try:
        for (b, e, first), (t_nll, t_lp, t_route) in tqdm(list(zip(trace.wins, trace.items)),
                                                          desc=f"student {student.preset.name}", unit="chunk",
                                                          disable=not progress):
            s_nll, s_lp = window_nll((decoded if decode else forward)(student, ids[b:e]), ids, b, first, e)
            s_route = cap.take()
            t_lp64 = t_lp.astype(np.float64)
            s_lp = s_lp.astype(np.float32).astype(np.float64)   # the teacher's are stored as float32: round alike
            kl.append((np.exp(t_lp64) * (t_lp64 - s_lp)).sum(-1))
            agree.append(t_lp.argmax(-1) == s_lp.argmax(-1))
            nll_s.append(s_nll)
            nll_t.append(t_nll)
            for L in trace.layers:
                o, x = routing_overlap(t_route[L], s_route[L])
                overlap[L].append(o)
                exact[L].append(x)
    finally:
        cap.remove()
    kl, agree = np.concatenate(kl), np.concatenate(agree).astype(np.float64)
    nll_s, nll_t = np.concatenate(nll_s), np.concatenate(nll_t)
    kl_mean, kl_se = mean_stderr(kl)
    top1, top1_se = mean_stderr(agree)
    ms, ses = mean_stderr(nll_s)
    mt, set_ = mean_stderr(nll_t)
    ra = [float(np.concatenate(overlap[L]).mean()) for L in trace.layers]
    rx = [float(np.concatenate(exact[L]).mean()) for L in trace.layers]
    return {
        "kl": kl_mean, "kl_stderr": kl_se, "kl_max": float(kl.max()), "kl_p99": float(np.percentile(kl, 99)),
        "kl_median": float(np.median(kl)),
        "top1": top1, "top1_stderr": top1_se,
        "ppl": math.exp(ms), "ppl_stderr": math.exp(ms) * ses,
        "ppl_teacher": math.exp(mt), "ppl_teacher_stderr": math.exp(mt) * set_,
        "ppl_ratio": math.exp(ms - mt),
        "routing_agreement": ra, "routing_exact": rx, "routing_layers": trace.layers,
        "routing_agreement_mean": float(np.mean(ra)) if ra else None,
        "tokens": int(kl.size), "routed_tokens": int(sum(len(o) for o in overlap[trace.layers[0]])) if trace.layers else 0,
        "chunks": len(trace.wins), "ctx": trace.n_ctx, "stride": trace.stride,
        "method": "llama.cpp" if trace.stride is None else "strided", "seconds": time.perf_counter() - t0,
        "student_forward": "decoded: one token a step" if decode else "one forward a window",
    }


def teacher_trace(model: str, data: str = "wikitext2", n_ctx: int = 512, chunks: int | None = 4,
                  stride: int | None = None, progress: bool = True, engine: str | None = None, direct: bool = True,
                  budget=None) -> TeacherTrace:
    """The teacher's side on `data`'s tokens, once for any number of students (run's `trace`)."""
    from runtime.session import open_session
    from workbench.host import peak_rss_bytes
    with open_session(model, "teacher", budget, prompt=None, engine=engine, direct=direct) as t:
        need = tokens_needed(n_ctx, chunks, stride)
        ids = text_ids(t.tokenizer, data, need)
        ids = ids[:need] if need else ids
        trace = TeacherTrace(t, ids, n_ctx, chunks, stride, progress, data)
    trace.peak_rss_bytes = peak_rss_bytes()         # the high-water mark of the process through the teacher
    return trace


def run(model: str, preset: str, budget=None, data: str = "wikitext2", n_ctx: int = 512, chunks: int | None = 4,
        stride: int | None = None, progress: bool = True, record: bool = True, engine: str | None = None,
        direct: bool = True, trace: TeacherTrace | None = None, device: str | None = None,
        teacher_budget=None, teacher_model: str | None = None, decode: bool = False) -> dict:
    """device: the preset's reads emulate that device's flash (the teacher, the reference, reads this machine's).
    The teacher runs first and alone, its log-probs kept per window, then the student: the two are never in memory
    together. teacher_budget (default: the teacher's own, every expert): a teacher bigger than memory streams too;
    it routes exactly, so its logits are the all-resident teacher's at any budget. teacher_model (default: model):
    the teacher's checkpoint, where the student's is another (a GGUF made from a bf16 directory, whose own teacher
    would be its quantized self). decode: the student decodes each window a token a step (compare)."""
    from evals.common import record as write_record
    from runtime.session import open_session
    from workbench.host import peak_rss_bytes
    from workbench.presets import get_preset
    if isinstance(preset, str):
        get_preset(preset)                  # an unknown preset is refused before the teacher runs
    if trace is None:
        trace = teacher_trace(teacher_model or model, data, n_ctx, chunks, stride, progress, engine, direct,
                              teacher_budget)
    with open_session(model, preset, budget, prompt=None, engine=engine, direct=direct, device=device) as s:
        res = compare(s, trace, progress, decode)
        res.update(model=model, preset=s.preset.name, budget=s.budget_text, data=trace.data, teacher_pack=trace.pack_id,
                   teacher_model=teacher_model or model, teacher_budget=teacher_budget,
                   teacher_peak_rss_bytes=getattr(trace, "peak_rss_bytes", None), peak_rss_bytes=peak_rss_bytes(),
                   **s.labels())
        params = {"data": trace.data, "ctx": trace.n_ctx, "chunks": trace.chunks, "stride": trace.stride}
        layers = [{"layer": L, "routing_agreement": a, "routing_exact": x}
                  for L, a, x in zip(res["routing_layers"], res["routing_agreement"], res["routing_exact"])]
        res["run"] = write_record("teacher", s, params, {k: v for k, v in res.items() if k != "run"}, layers,
                                  enabled=record)
    return res
