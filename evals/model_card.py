"""Measure the demo model and write its card: every number in MODEL_CARD.md comes from here.

    python -m evals.model_card --model demo          # writes data/models/demo-moe/MODEL_CARD.md + model_card.json

Held-out perplexity per domain (teacher: bf16, exact routing; llama.cpp's method), and routing
statistics on held-out text: expert use per layer, its entropy, dead experts, and how often
layer L's top-k under layer L+1's router (with L+1's own norm) matches layer L+1's real top-k.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from evals.ppl import perplexity
from workbench.atomic import atomic_write
from workbench.registry import model_dir
from runtime.capture import RoutingCapture
from workbench.commands import flags
from workbench.predict import Lookahead
from workbench.routing import topk_desc
from runtime.session import Session, open_session
from workbench.textdata import heldout_ids

DOMAINS = ("tinystories", "wikitext2")


def routing_stats(session: Session, ids: list[int], ctx: int = 512) -> dict:
    """Use counts, entropy and lookahead agreement per layer over `ids` (chunks of ctx, exact routing)."""
    s, w = session.spec, session.engine.w
    moe = s.moe_layers
    look = Lookahead(s, w, depth=1)
    with RoutingCapture(session, keep=("h",)) as cap:
        for b in range(0, len(ids) - ctx + 1, ctx):
            session.engine.reset()
            session.step(ids[b:b + ctx], "prefill")
        records = cap.records
    topk = {L: np.concatenate([r["idx"] for r in records if r["layer"] == L]) for L in moe}
    ahead = {}
    for L in moe[:-1]:            # layer L+1's router (with its own norm) on layer L's residual stream
        z = np.concatenate([look.scores(L, r["h"], look.target(L)) for r in records if r["layer"] == L])
        ahead[L] = {"k": topk_desc(z, s.top_k), "2k": topk_desc(z, 2 * s.top_k)}
    rows = []
    for i, L in enumerate(moe):
        real = topk[L]
        counts = np.bincount(real.reshape(-1), minlength=s.num_experts)
        p = counts / counts.sum()
        ent = float(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(s.num_experts))
        row = {"layer": L, "tokens": int(real.shape[0]), "dead_experts": int((counts == 0).sum()),
               "min_share": float(p.min()), "max_share": float(p.max()), "entropy_norm": ent,
               "counts": counts.tolist()}
        if i + 1 < len(moe):
            nxt = topk[moe[i + 1]]
            for width in ("k", "2k"):
                pred = ahead[L][width]
                hits = [len(set(a) & set(b)) / s.top_k for a, b in zip(pred.tolist(), nxt.tolist())]
                row[f"lookahead_recall_{width}"] = float(np.mean(hits))
        rows.append(row)
    return {"layers": rows}


def measure(model: str = "demo", ctx: int = 512, chunks: int = 8, routing_tokens: int = 4096) -> dict:
    out = {"model": model, "ppl_method": f"llama.cpp: chunks of {ctx}, second half scored, {chunks} chunks",
           "heldout": {}}
    with open_session(model, "teacher") as s:
        for d in DOMAINS:
            ids = heldout_ids(s.tokenizer, d, ctx * chunks)
            r = perplexity(s, ids, n_ctx=ctx, chunks=chunks, progress=False)
            out["heldout"][d] = {"ppl": r["ppl"], "ppl_stderr": r["ppl_stderr"], "tokens_scored": r["tokens"]}
        out["routing"] = {d: routing_stats(s, heldout_ids(s.tokenizer, d, routing_tokens), ctx) for d in DOMAINS}
        spec = s.spec
        n_expert = 3 * spec.hidden_size * spec.moe_intermediate_size
        out["size"] = {"expert_params": n_expert * spec.num_experts * len(spec.moe_layers),
                       "params": int(sum(np.prod(v.shape) for v in s.engine.w.values())
                                     - (0 if "lm_head" in s.pack.tensors else np.prod(s.engine.w["lm_head"].shape))
                                     + n_expert * spec.num_experts * len(spec.moe_layers))}
        out["spec"] = spec.to_dict()
    with open_session(model, "resident") as q4:
        out["size"]["expert_bytes_q4"] = q4.pack.expert_nbytes
    return out


def render(m: dict, training: dict) -> str:
    s, size = m["spec"], m["size"]
    log = training["log"]
    marks = [r for r in log if r["step"] % 100 == 0 or r is log[-1]]
    curve = "\n".join(f"| {r['step']} | {r['tokens']:,} | {r['ce']:.3f} | {r['aux']:.3f} |" for r in marks)
    held = "\n".join(f"| {d} | {v['ppl']:.2f} ± {v['ppl_stderr']:.2f} | {v['tokens_scored']:,} |"
                     for d, v in m["heldout"].items())
    rt = []
    for d, r in m["routing"].items():
        for row in r["layers"]:
            la = lambda k: f"{row[k]:.3f}" if k in row else "–"
            rt.append(f"| {d} | {row['layer']} | {row['dead_experts']} | {row['min_share']:.4f} | {row['max_share']:.4f} "
                      f"| {row['entropy_norm']:.3f} | {la('lookahead_recall_k')} | {la('lookahead_recall_2k')} |")
    a = training["args"]
    return f"""# demo-moe: the workbench's demo model

A Qwen3-MoE language model trained on this project's machines, from scratch, on public text.
Every number below was measured by `python -m evals.model_card --model demo` (this file is
written by it); the training numbers come from `training_log.json`.

## Architecture and size
- `model_type: qwen3_moe` (transformers `Qwen3MoeForCausalLM` loads it): {s['num_layers']} layers, d_model {s['hidden_size']},
  {s['num_heads']} heads / {s['num_kv_heads']} KV heads of {s['head_dim']}, q/k norm, RoPE θ={s['rope_theta']:g},
  {s['num_experts']} experts per layer, top-{s['top_k']} (softmax, norm_topk_prob), expert FFN {s['moe_intermediate_size']},
  vocabulary {s['vocab_size']} (byte-level BPE trained with `tokenizers` on the training text), context {s['max_position_embeddings']}.
- Parameters: {size['params']:,}, of which experts {size['expert_params']:,} ({100 * size['expert_params'] / size['params']:.1f}%).
- One expert in a q4 pack (affine group-64, gate|up|down): {size['expert_bytes_q4']:,} bytes.
- Weights stored in bf16 (`model.safetensors`); this bf16 checkpoint with fp32 compute is the teacher.

## Data
Trained on `data/corpora/` (each folder has its SOURCE.txt with provenance and licence): a 2 MiB sample of the
TinyStories train split (CDLA-Sharing-1.0), tiny Shakespeare (public domain), and WikiText-2 *valid* (CC BY-SA 3.0).
Held out, never trained on: TinyStories *validation* (`tinystories_val_head.txt`) and WikiText-2 *test*.
Windows of {a['T']} tokens are drawn at random from one domain each, domains mixed by size within each batch.

## Training
```
python -m training.demo --out runs/train-demo --steps {a['steps']}
python -m training.demo --out runs/train-demo --export data/models/demo-moe
```
How the shipped checkpoint was actually run (it was resumed from checkpoints on a shared machine):
{chr(10).join('- ' + h for h in training.get('history', []))}

torch on the CPU, AdamW (β 0.9/0.95, weight decay 0.1), peak LR {a['lr']} with 100 warm-up steps and cosine decay to
10%, batch {a['batch']} × {a['T']} tokens, seed {a['seed']}, Switch-style load-balancing loss (coefficient 0.01).
Checkpointed every 50 steps (resumable). Trained for {training['step']} steps ({training['step'] * a['batch'] * a['T']:,} tokens).

| step | tokens | train CE | balance loss |
|---:|---:|---:|---:|
{curve}

## Held-out perplexity (teacher)
{m['ppl_method']}.

| data | ppl | tokens scored |
|---|---:|---:|
{held}

## Routing on held-out text
Share of routed slots per expert (min/max over the layer's {s['num_experts']} experts), the entropy of that
distribution normalised by log({s['num_experts']}) (1 = perfectly even), dead experts (never chosen), and
lookahead recall: the fraction of layer L+1's real top-{s['top_k']} that layer L+1's router (with its own norm)
applied to layer L's residual stream finds in its top-k / top-2k (what LES and smolmaxxing exploit).

| data | layer | dead | min share | max share | entropy | lookahead recall top-k | top-2k |
|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rt)}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    flags("model")(ap)
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args(argv)
    d = model_dir(a.model)
    m = measure(a.model, chunks=a.chunks)
    training = json.loads((d / "training_log.json").read_text())
    atomic_write(d / "model_card.json", json.dumps(m, indent=1) + "\n")
    atomic_write(d / "MODEL_CARD.md", render(m, training))
    print(f"wrote {d / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
