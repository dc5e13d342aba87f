"""`python -m workbench ladder edge0 --model demo --json`: Edge0's ladder, measured against the teacher.

Quality rungs (every expert resident, so only the math differs), each on the same held-out text
(TinyStories validation, --chunks x --chunk-tokens), decoded token by token with teacher forcing (a one-token
prefill, then decode steps, so streamed layers really route from predictions made a token earlier):
  int4 exact            the int4 pack (experts and rest), the real router everywhere
  +prerouter routing    the heads' prediction is the routing of the streamed layers
  +LoRA                 plus the recovery LoRA, unmerged (the Edge0 preset)
  and, beside the ladder, the alternative the paper argues against: the LoRA merged into the bf16 weights and
  requantized to int4; retention = (KL gain of merged) / (KL gain of unmerged), gains over +prerouter.
Per rung: held-out perplexity, mean KL(teacher || student) per token, top-1 agreement with the teacher.
Per layer: recall of the head's top-k against the real router's top-k at t+1 (teacher states, held-out
text), with two references (the previous token's experts; the next router applied to this state), and the
agreement of the executed (predicted) routing with the real router on the student's own states.
Speed: edge0 vs on_demand at one budget, alternating arms (A B A B ...), each a fresh bench, warm-up first: one
timing group of a sweep (experiments.sweep) on a local Ray.
One run record per rung and per A/B arm (config: {"ladder": "edge0", "rung": name}).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from workbench.edge0.artifacts import artifact_path
from workbench.edge0.serve import Heads, LoRA, Prerouter, edge0_counters, features, onehot
from workbench.presets import get_preset
from workbench.routing import route, topk_desc
from workbench.runs import write_run
from runtime.session import Session, open_session
from workbench.errors import WorkbenchError
from workbench.store import quant
from workbench.textdata import heldout_ids


def log_softmax(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def quality(t_logits: np.ndarray, s_logits: np.ndarray, ids: np.ndarray) -> dict:
    """Sums over positions: nll of the next token (T-1 positions), KL(teacher||student), top-1 agreement (T)."""
    lt, ls = log_softmax(t_logits), log_softmax(s_logits)
    kl = (np.exp(lt) * (lt - ls)).sum(-1)
    nll = -ls[np.arange(len(ids) - 1), ids[1:]]
    return {"nll": float(nll.sum()), "n_nll": len(nll), "kl": float(kl.sum()), "n": len(kl),
            "top1": int((t_logits.argmax(-1) == s_logits.argmax(-1)).sum())}


def finish(parts: list[dict]) -> dict:
    n, n_nll = sum(p["n"] for p in parts), sum(p["n_nll"] for p in parts)
    return {"heldout_ppl": float(np.exp(sum(p["nll"] for p in parts) / n_nll)),
            "kl_per_token": sum(p["kl"] for p in parts) / n, "top1_agreement": sum(p["top1"] for p in parts) / n,
            "tokens": n}


def chunks_of(tokenizer, n_chunks: int, chunk: int) -> list[np.ndarray]:
    ids = heldout_ids(tokenizer, "tinystories", n_chunks * chunk)
    if len(ids) < n_chunks * chunk:
        raise WorkbenchError(f"held-out text gave {len(ids)} tokens, need {n_chunks * chunk}")
    return [np.asarray(ids[i * chunk:(i + 1) * chunk]) for i in range(n_chunks)]


def teacher_pass(model, chunks):
    """Teacher logits per chunk and, per layer, (router input, top-k ids) of every position."""
    out = []
    with open_session(model, "teacher", budget="all") as s:
        for ids in chunks:
            cap = {}

            def hook(layer, logits, ctx, cap=cap):
                idx, w = route(s.spec, logits, s.engine.w.get(f"layers.{layer}.router_bias"))
                cap[layer] = (ctx["x"].copy(), idx.copy())
                return idx, w
            s.engine.swap_router_hook(hook)
            s.engine.reset()
            out.append((s.step(ids.tolist(), "prefill"), cap))
        return out, dict(s.engine.w), s.spec


def recall_table(spec, heads: Heads, passes, weights) -> list[dict]:
    """Per target layer: recall of the head's top-k (from token t) vs the real top-k at t+1, on teacher states."""
    moe, E, k = spec.moe_layers, spec.num_experts, spec.top_k
    rows = []
    for o in heads.owners:
        t = moe[moe.index(o) + 1]
        hit = hist = look = n = 0
        for _, cap in passes:
            x, idx = cap[o]
            f = features(x, idx, None, E)
            f[1:, spec.hidden_size + E:] = onehot(idx[:-1], E)          # the previous token's top-k (none at t=0)
            pred = route(spec, heads.logits(o, f[:-1]), weights.get(f"layers.{t}.router_bias"))[0]
            true = cap[t][1][1:]
            nl = np.asarray(weights[f"layers.{t}.mlp_norm"]) / np.asarray(weights[f"layers.{o}.mlp_norm"])
            la = topk_desc((x[:-1] * nl) @ np.asarray(weights[f"layers.{t}.router"]).T, k)
            for a_, b_ in ((pred, "h"), (cap[t][1][:-1], "p"), (la, "l")):
                m = sum(len(set(r) & set(q)) for r, q in zip(a_.tolist(), true.tolist()))
                if b_ == "h":
                    hit += m
                elif b_ == "p":
                    hist += m
                else:
                    look += m
            n += true.size
        rows.append({"layer": t, "owner": o, "recall": hit / n, "recall_prev_token": hist / n,
                     "recall_next_router_on_state": look / n, "positions": n // k})
    return rows


def student_pass(session: Session, chunks, t_logits, agree: dict | None = None) -> dict:
    """Teacher-forced token-by-token decode of every chunk; quality against the teacher."""
    pr = session.engine.predictor
    hook = session.engine.router_hook
    if agree is not None and isinstance(pr, Prerouter) and hook is not None:
        def compare(layer, logits, ctx):
            idx, w = hook(layer, logits, ctx)
            if ctx["phase"] == "decode" and layer in pr.streamed:
                real = route(session.spec, logits, session.engine.w.get(f"layers.{layer}.router_bias"))[0]
                a = agree.setdefault(layer, [0, 0])
                a[0] += len(set(idx[0].tolist()) & set(real[0].tolist()))
                a[1] += idx.shape[1]
            return idx, w
        session.engine.swap_router_hook(compare)
    parts = []
    for ids, tl in zip(chunks, t_logits):
        session.engine.reset()
        out = [session.step(ids[:1].tolist(), "prefill")[-1]]
        for i in range(1, len(ids)):
            out.append(session.step([int(ids[i])], "decode")[-1])
        parts.append(quality(tl, np.stack(out), ids))
    session.engine.swap_router_hook(hook)
    return finish(parts)


def requantized_merge(lora: LoRA, bf16_w: dict, kind: str) -> dict:
    """LoRA merged into the bf16 weights, rounded to bf16, requantized to the student's precision (int4)."""
    return {name: requantized_merge_one(bf16_w[name] + lora.scale * (B @ A), kind) for name, A, B in lora.targets()}


def delta_survival(lora: LoRA, bf16_w: dict, int4_w: dict, kind: str) -> dict:
    """How much of the LoRA's weight change a merge + requantization keeps, and how big it is against int4 rounding:
    survival = <Q(W + dW) - Q(W), dW> / |dW|^2 over all adapted projections (1: kept whole, 0: rounded away)."""
    num = den = 0.0
    ratios = []
    for name, A, B in lora.targets():
        dW = lora.scale * (B @ A)
        merged = requantized_merge_one(bf16_w[name] + dW, kind)
        num += float(((merged - int4_w[name]) * dW).sum())
        den += float((dW * dW).sum())
        ratios.append(float(np.sqrt((dW * dW).mean() / ((int4_w[name] - bf16_w[name]) ** 2).mean())))
    return {"delta_survival": num / den if den else None,
            "delta_rms_over_int4_error_rms_median": float(np.median(ratios)) if ratios else None}


def requantized_merge_one(w: np.ndarray, kind: str) -> np.ndarray:
    merged = quant.from_bf16(quant.to_bf16(w))
    return quant.decode(quant.encode(merged, kind), merged.shape, kind)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]


def edge0_rungs(skip_layers: int | None = None) -> list:
    edge0 = get_preset("edge0")
    pred = "prerouter" if skip_layers is None else f"prerouter:{skip_layers}"
    return [edge0.with_(name="int4 exact", predictor=None, routing="exact"),
            edge0.with_(name="+prerouter routing", predictor=pred, routing="prerouter:nolora"),
            edge0.with_(name="+LoRA", predictor=pred, routing="prerouter")]


def run_edge0(model: str = "demo", budget: str = "0.25", tokens: int = 48, rounds: int = 3, chunks: int = 4,
              chunk_tokens: int = 256, skip_layers: int | None = None, prompt: str = "Once upon a time",
              progress=None, record: bool = True) -> dict:
    say = progress or (lambda m: None)
    rungs = edge0_rungs(skip_layers)
    with open_session(model, rungs[0], budget="all") as s0:
        text = chunks_of(s0.tokenizer, chunks, chunk_tokens)
        hpath, lpath = artifact_path(s0.pack, "prerouter"), artifact_path(s0.pack, "lora")
        heads = Heads.load(s0.spec, s0.pack)
        lora = LoRA.load(s0.spec, s0.engine.w, s0.pack)
        rest_kind = s0.pack.quant["rest"]
        int4_w = {name: np.asarray(s0.engine.w[name]) for name, _, _ in lora.targets()}   # f32 (Encoded: dequantized)
    passes, bf16_w, spec = teacher_pass(model, text)
    t_logits = [p[0] for p in passes]
    teacher_row = {"rung": "teacher (bf16)", **finish([quality(t, t, ids) for t, ids in zip(t_logits, text)])}
    say(f"teacher: ppl {teacher_row['heldout_ppl']:.3f}")
    recall = recall_table(spec, heads, passes, bf16_w)
    artifacts = {"prerouter": str(hpath), "prerouter_sha256": sha(hpath), "lora": str(lpath), "lora_sha256": sha(lpath),
                 "heads_meta": {k: heads.meta.get(k) for k in ("created", "steps", "skip_layers", "hidden", "command")},
                 "lora_meta": {k: lora.meta.get(k) for k in ("created", "rank", "alpha", "targets", "command")}}
    rows = []
    for i, p in enumerate(rungs + [None]):
        merged = p is None
        p = p or rungs[1].with_(name="merge+requantize (alternative)")
        agree = {}
        merged_w = requantized_merge(lora, bf16_w, rest_kind) if merged else None
        with open_session(model, p, budget="all", weights=merged_w) as s:
            row = {"rung": p.name, **student_pass(s, text, t_logits, agree), **edge0_counters(s)}
            row["agreement_with_real_router"] = {L: a[0] / a[1] for L, a in sorted(agree.items())} or None
            say(f"{p.name}: ppl {row['heldout_ppl']:.3f} KL {row['kl_per_token']:.4f} top-1 {row['top1_agreement']:.3f}")
            if record:
                cfg = {**s.config(), "ladder": "edge0", "rung": p.name, "rung_index": i, "chunks": chunks,
                       "chunk_tokens": chunk_tokens, "data": "tinystories validation (held out)", "artifacts": artifacts,
                       "merged_requantized": merged}
                layers = [{**r, "agreement_with_real_router": (row["agreement_with_real_router"] or {}).get(r["layer"])}
                          for r in recall]
                row["run"] = str(write_run(f"edge0-{p.name}", cfg, row, layers, []))
        rows.append(row)
    base, unmerged, alt = rows[1]["kl_per_token"], rows[2]["kl_per_token"], rows[3]["kl_per_token"]
    retention = {"kl_prerouter": base, "kl_unmerged_lora": unmerged, "kl_merged_requantized": alt,
                 "gain_unmerged": base - unmerged, "gain_merged": base - alt,
                 "retention": (base - alt) / (base - unmerged) if base != unmerged else None,
                 **delta_survival(lora, bf16_w, int4_w, rest_kind)}
    ab = speed_ab(model, rungs[2].with_(name="edge0"), budget, tokens, rounds, prompt, say, record)
    return {"ladder": "edge0", "model": model, "teacher": teacher_row, "rungs": rows[:3], "merged_requantized": rows[3],
            "retention": retention, "recall": recall, "ab": ab, "artifacts": artifacts,
            "quality_data": f"tinystories validation, {chunks} x {chunk_tokens} tokens, teacher-forced decode"}


def speed_ab(model, edge0, budget, tokens, rounds, prompt, say, record) -> dict:
    """on_demand vs edge0 at one budget: the two arms of one timing group of a sweep (experiments.sweep, a local
    Ray), A B per round, each a fresh bench (warm-up first); Edge0's counters are those of its median round."""
    import tempfile

    from experiments.grid import AXES, Cell, Grid
    from workbench.runs import runs_dir
    from experiments.sweep import run_grid
    arms = [get_preset("on_demand"), edge0]
    cells = [Cell.of("bench", model, p, p.name, budget, tokens=tokens, rounds=rounds, prompt=prompt) for p in arms]
    labels = {c.id: {"ladder": "edge0", "rung": f"A/B {p.name}", "rounds": rounds, "tokens": tokens, "prompt": prompt}
              for c, p in zip(cells, arms)}
    out = {"budget": budget, "tokens": tokens, "rounds": rounds, "order": "A B per round, on_demand first", "arms": {}}
    with tempfile.TemporaryDirectory(prefix="wb-edge0-ab-") as scratch:
        res = run_grid(Grid("ladder_edge0_ab", cells, arms=AXES, labels=labels), resume=False, progress=False,
                       root=runs_dir() if record else Path(scratch))
        for p, r in zip(arms, res["rows"]):
            if r["status"] != "ok":
                raise WorkbenchError(f"ladder edge0, A/B arm {p.name}: {r['error']}")
            row = {k: v for k, v in json.loads((Path(r["run"]) / "summary.json").read_text()).items()
                   if k != "per_layer"}
            if p.name == "edge0":
                row["counters"] = "of the median round"
            if record:
                row["run"] = r["run"]
            say(f"A/B {p.name}: {row['tok_s']:.1f} tok/s ({row['tok_s_min']:.1f}-{row['tok_s_max']:.1f}), "
                f"hit {row['hit_rate']:.2f}")
            out["arms"][p.name] = row
    a, b = out["arms"]["on_demand"]["tok_s"], out["arms"]["edge0"]["tok_s"]
    out["speedup"] = b / a if a else None
    return out


def table(res: dict) -> str:
    lines = [f"ladder edge0 on {res['model']} ({res['quality_data']})",
             f"{'rung':34} {'ppl':>8} {'KL/token':>9} {'top-1':>6} {'consumed/routed':>16} {'dropped':>7}"]
    for r in [res["teacher"]] + res["rungs"] + [res["merged_requantized"]]:
        cr = f"{r['consumed']}/{r['edge0_routed']}" if r.get("edge0_routed") else ""
        lines.append(f"{r['rung'][:34]:34} {r['heldout_ppl']:8.3f} {r['kl_per_token']:9.4f} {r['top1_agreement']:6.3f} "
                     f"{cr:>16} {r.get('dropped', ''):>7}")
    rt = res["retention"]
    lines.append(f"retention of the LoRA's KL gain when merged and requantized: "
                 f"{rt['retention'] if rt['retention'] is None else round(rt['retention'], 3)} "
                 f"(gain unmerged {rt['gain_unmerged']:.4f}, merged {rt['gain_merged']:.4f}); the merge keeps "
                 f"{rt['delta_survival']:.2f} of the weight change, which is {rt['delta_rms_over_int4_error_rms_median']:.1f}x "
                 f"the int4 rounding error (rms, median projection)")
    lines.append("layer  recall(head)  recall(prev token)  recall(next router on state)")
    for r in res["recall"]:
        lines.append(f"{r['layer']:5d}  {r['recall']:12.3f}  {r['recall_prev_token']:18.3f}  "
                     f"{r['recall_next_router_on_state']:28.3f}")
    ab = res["ab"]
    lines.append(f"speed at budget {ab['budget']} ({ab['rounds']} alternating rounds, {ab['tokens']} tokens):")
    for name, r in ab["arms"].items():
        lines.append(f"  {name:10} {r['tok_s']:7.1f} tok/s ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}), hit "
                     f"{r['hit_rate']:.2f}, wait {1e3 * r['flash_wait_per_token_s']:.2f} ms/tok, "
                     f"{r['bytes_read_per_token'] / 1e3:.1f} KB read/tok")
    lines.append(f"  speedup {ab['speedup']:.2f}x")
    return "\n".join(lines)
