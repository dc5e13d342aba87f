"""`bench`: one preset at one budget, warm-up first, then a cold measured run, the floor, and a run record."""
from __future__ import annotations

import functools

from experiments.routing_trace import drive
from workbench.disk_probe import probe
from workbench.floor import floor_tok_s
from workbench.presets import Predictor
from workbench.runs import write_run
from runtime.session import Session, open_session
from workbench.errors import WorkbenchError

WARMUP_TEXT = "The lighthouse keeper counted ships"      # not a prompt any measurement uses


def warmup_prompt(session: Session, prompt):
    """Other text than the measured prompt, so a warm-up names other experts."""
    if isinstance(prompt, str) and session.tokenizer is not None:
        return WARMUP_TEXT
    ids = list(prompt) if not isinstance(prompt, str) else session.encode(prompt)
    return [(t + 1) % session.spec.vocab_size for t in ids]


def measure(session: Session, prompt, tokens: int, warmup: int = 4, warm: bool = False) -> dict:
    """Warm up the code paths on other text, then measure cold: no expert in memory but what the design keeps
    (Session.cold_start) and the model's file out of the page cache. warm: today's warm measurement instead, the
    warm-up on the measured prompt and its experts kept."""
    if warmup:
        if warm:
            session.generate_text(prompt, warmup)
        else:
            session.generate(warmup_prompt(session, prompt), tokens=warmup)
        session.reset_telemetry()
    page_cache = None if warm else session.cold_start()
    out = session.generate_text(prompt, tokens)
    s = session.summary()
    n = max(1, s["produced"])              # per produced token, as bytes_read_per_token (a speculative step makes more)
    disk = session.device.as_probe() if session.device else probe()       # emulated: the profile's flash
    r = session.reader.stats()
    fl = floor_tok_s(session.pack, (s["compute_s"] + s["router_s"]) / n, s["bytes_read_per_token"], disk,
                     size=r["bytes_read"] // r["reads"] if r["reads"] else None, depth=session.reader.workers)
    res = {**s, **fl, "achieved_over_floor": s["tok_s"] / fl["floor_tok_s"], "cache_bytes": s["cache_peak_bytes"],
           "tokens": len(out["tokens"]), "text": out["text"], "engine": session.engine.name,
           "start": "warm" if warm else "cold", "page_cache_dropped": page_cache, "text_source": s["text"],
           "text_check": text_check(session, out),
           "spec_accepted_by_step": [t.produced - 1 for t in session.tel.tokens if t.phase == "decode" and t.drafted]}
    if session.preset.prefetch.predictor is Predictor.PREROUTER:     # Edge0: what its prediction staged and dropped
        from workbench.edge0.serve import edge0_counters
        res.update(edge0_counters(session))
    return res


REAL_TRACE = "data/traces/qwen3-30b-a3b-bigmoeonedge.parquet"      # the reference a run's routing is held to


@functools.lru_cache(maxsize=1)
def real_reuse() -> float:
    """Next-token expert reuse of the real Qwen3-30B-A3B trace (experiments.routing_stats): 0.38."""
    from experiments.routing_stats import routing_stats
    from experiments.traces import read_trace
    from workbench.registry import REPO
    tr = read_trace(REPO / REAL_TRACE)
    return routing_stats(tr["topk"], tr["meta"]["num_experts"])["reuse"]


def text_check(session: Session, out: dict) -> dict:
    """Whether a run's text or routing degenerated: the share of distinct tokens it decoded (a made checkpoint's own
    argmax repeats one or two), and next-token expert reuse (the share of a layer's experts at token t+1 it used at
    t) against the real trace's. degenerate: under a quarter distinct, or reuse over 1.5x the real trace's."""
    toks = out["tokens"]
    distinct = len(set(toks)) / max(1, len(toks))
    by_layer: dict = {}
    for e in session.tel.events:
        if e.phase == "decode":
            by_layer.setdefault(e.layer, []).append(set(e.routed))
    k = session.spec.top_k
    pairs = [len(a & b) / k for seq in by_layer.values() for a, b in zip(seq, seq[1:])]
    reuse = sum(pairs) / len(pairs) if pairs else float("nan")
    real = real_reuse()
    return {"distinct_tokens": distinct, "reuse": reuse, "real_trace_reuse": real,
            "degenerate": bool(distinct < 0.25 or reuse > 1.5 * real)}


def bench(model: str, preset: str, budget=None, tokens: int = 64, prompt: str = "Once upon a time",
          engine: str | None = None, direct: bool = True, record: bool = True, device: str | None = None,
          routing_trace: str | None = None, warm: bool = False, threads: int | None = None,
          text: str | None = None, **knobs) -> dict:
    """knobs: preset knobs changed by their flat names (Preset.with_). text: what the run decodes (runtime.text:
    None, forced text on a made checkpoint and the model's own tokens otherwise; "free"; a corpus or file)."""
    with open_session(model, preset, budget, prompt=prompt, tokens=tokens, engine=engine, direct=direct,
                      device=device, drive=drive(routing_trace), threads=threads, text=text, **knobs) as s:
        record_run = lambda summary, failed=False: write_run(
            s.preset.name, {**s.config(), "tokens": tokens, "prompt": prompt}, summary, s.tel.per_layer("decode"),
            s.tel.event_rows(), s.tel.token_rows(), failed=failed)
        try:
            res = measure(s, prompt, tokens, warm=warm)
        except WorkbenchError as e:      # a failed run is recorded too: what completed, and why it stopped
            if not record:
                raise
            done = s.tel.summary()
            path = record_run({"status": "failed", "error": str(e), "decode_steps": done["decode_steps"],
                               "prefill_tokens": done["prefill_tokens"], "read_retries": s.reader.retries}, failed=True)
            raise WorkbenchError(f"{e} (failed run recorded in {path})") from None
        res.update(preset=s.preset.name, budget=s.budget_text)
        if record:
            res["run"] = str(record_run(res))
    return res
