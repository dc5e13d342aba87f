"""The workbench's logits on a GGUF against stock llama.cpp's, position by position, and what moves them.

    python -m experiments.llamacpp_logits --type q4_k_m          # the demo exported as q4_k_m

Each row is one way of running the file, against three references: llama.cpp with its defaults (flash
attention, f16 KV cache), llama.cpp with attention in f32 (flash attention off, f32 KV cache) and the workbench
on the GGUF's blocks. A row gives the per-position max |logit difference| (median, 90th percentile, max) and the
positions whose greedy token differs, with the reference's top-2 margin there. All run teacher-forced on one
text: PREFILL tokens as a batch, then one at a time.
"""
from __future__ import annotations

import argparse

import numpy as np

PREFILL = 8
F32 = 0                 # ggml's type id of float32
LLAMA = {"llama.cpp, flash attention off": {"flash_attn_type": 0},
         "llama.cpp, f32 attention (no flash, f32 KV)": {"flash_attn_type": 0, "type_k": F32, "type_v": F32}}
WORKBENCH = {"workbench (the GGUF's blocks)": {}, "workbench, numpy engine (blocks dequantized)": {"engine": "numpy"},
             "workbench, attention norms one ulp up": {"nudge": True},
             "workbench, re-quantized to q4 (Session before 550bf51)": {"experts": "q4", "rest": "q4"}}


def text(tokens: int) -> str:
    from workbench.registry import REPO
    stories = (REPO / "data/corpora/tinystories/tinystories_val_head.txt").read_text().split("\n\n")
    return next(s for s in stories if len(s) > 7 * tokens)


def steps(forward, ids) -> np.ndarray:
    return np.concatenate([forward(ids[:PREFILL])] + [forward([t]) for t in ids[PREFILL:]])


def llama_logits(path, ids, context=None) -> np.ndarray:
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=max(256, len(ids)), context=context) as llm:
        return steps(llm.forward, ids)


def workbench_logits(path, ids, nudge: bool = False, **kw) -> np.ndarray:
    """nudge: every attention norm's weights one float32 step up (a calibration: what one ulp does)."""
    from runtime.session import open_session
    with open_session(str(path), "resident", **kw) as s:
        if nudge:
            w = s.engine.w
            for n in [n for n in w if n.endswith(".attn_norm")]:
                w[n] = np.nextafter(w[n], np.float32(np.inf))
        s.engine.reset()
        return steps(lambda t: s.step(list(t), "decode" if s.engine.pos else "prefill"), ids)


def row(name: str, z: np.ndarray, ref: np.ndarray) -> str:
    err = np.abs(z - ref).max(-1)
    top = np.sort(ref, -1)
    flips = np.flatnonzero(z.argmax(-1) != ref.argmax(-1))
    return (f"{name:58s} {np.median(err):7.4f} {np.quantile(err, 0.9):7.4f} {err.max():7.4f}   "
            f"{[(int(i), round(float(top[i, -1] - top[i, -2]), 3)) for i in flips]}")


def main(argv=None):
    from engines.llamacpp_engine import GGUF_TYPES, LlamaCpp, resolve_gguf
    from workbench.commands import flags
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags("model", "tokens", model={"help": "a .gguf, or a workbench model exported to GGUF"})(ap)
    ap.add_argument("--type", default="q4_k_m", choices=GGUF_TYPES)
    args = ap.parse_args(argv)
    path = resolve_gguf(args.model, args.type)
    with LlamaCpp(path, n_ctx=256) as llm:
        ids = llm.tokenize(text(args.tokens))[:args.tokens]
    runs = {"llama.cpp (defaults)": llama_logits(path, ids)}
    runs.update({name: llama_logits(path, ids, ctx) for name, ctx in LLAMA.items()})
    for name, kw in WORKBENCH.items():
        runs[name] = workbench_logits(path, ids, **kw)
    print(f"{path.name}: {len(ids)} tokens, prefill {PREFILL} then one at a time")
    for ref in ("llama.cpp (defaults)", "llama.cpp, f32 attention (no flash, f32 KV)", "workbench (the GGUF's blocks)"):
        print(f"\nagainst {ref}:\n{'':58s}  median     p90     max   greedy flips (position, top-2 margin)")
        for name, z in runs.items():
            if name != ref:
                print(row(name, z, runs[ref]))

if __name__ == "__main__":
    main()
