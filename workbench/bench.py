"""`bench`: one preset at one budget, warm-up first, cold reads, the floor, and a run record."""
from __future__ import annotations

from workbench.floor import floor_tok_s, probe
from workbench.runs import write_run
from workbench.session import Session

SUMMARY_KEYS = ("tok_s", "prefill_tok_s", "hit_rate", "bytes_read", "bytes_read_per_token", "flash_wait_s",
                "flash_wait_per_token_s", "dequant_s", "compute_s", "router_s", "other_s", "decode_s",
                "prefetch_recall", "prefetch_precision", "prefetch_issued", "prefetch_wasted", "wasted_bytes")


def measure(session: Session, prompt, tokens: int, warmup: int = 4) -> dict:
    """Warm up (code paths, not the cache: the measured run starts with its own prefill), then measure."""
    if warmup:
        session.generate(prompt, tokens=warmup)
        session.tel.events.clear()
        session.tel.tokens.clear()
        session.tel.prefetch_issued = session.tel.prefetch_used = session.tel.prefetch_wasted = 0
        session.tel.wasted_bytes = 0
    out = session.generate(prompt, tokens=tokens)
    s = session.summary()
    n = max(1, s["decode_steps"])
    fl = floor_tok_s(session.pack, (s["compute_s"] + s["router_s"]) / n, s["bytes_read_per_token"], probe())
    res = {k: s[k] for k in SUMMARY_KEYS}
    res.update(fl, cache_bytes=s["cache_peak_bytes"], budget_bytes=s["budget_bytes"], peak_rss_bytes=s["peak_rss_bytes"],
               reader_mode=s["reader_mode"], achieved_over_floor=s["tok_s"] / fl["floor_tok_s"],
               per_layer=s["per_layer"], tokens=len(out["tokens"]), decode_steps=s["decode_steps"], text=out["text"])
    return res


def bench(model: str, preset: str, budget=None, tokens: int = 64, prompt: str = "Once upon a time",
          engine: str = "numpy", direct: bool = True, record: bool = True) -> dict:
    with Session(model, preset, budget=budget, engine=engine, direct=direct) as s:
        res = measure(s, prompt, tokens)
        res.update(preset=s.preset.name, budget=s.budget_text)
        if record:
            path = write_run(s.preset.name, {**s.config(), "tokens": tokens, "prompt": prompt}, res,
                             s.tel.per_layer("decode"), s.tel.event_rows(), s.tel.token_rows())
            res["run"] = str(path)
    return res
