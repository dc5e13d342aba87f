"""Train Edge0's recovery LoRA on the student path, then save it beside the model (never merged).

    python -m training.edge0_lora --model demo

Student: the int4 pack (experts and rest dequantized), routed by the trained prerouter heads (frozen) exactly
as the numpy engine serves it, plus rank-16 adapters on attention q, k, v, o (the demo model, Qwen3-MoE, has
no shared expert to adapt; a hybrid's shared experts are left as they are). Teacher: the bf16 pack, exact
routing. A GGUF is both, in its own blocks: the student differs from its teacher by the routing only. A model
bigger than memory streams from disk layer by layer (training/edge0_common.TorchMoE), every phase included.
  phase 1  cross-entropy on teacher-written text: prompts from the training corpora, continued by the teacher
           (sampled); the loss is on the teacher's tokens
  phase 2  on-policy distillation: the student samples continuations, loss = reverse KL(student || teacher)
           per position on the student's own tokens
Progress is checked on windows of the training corpora (never the held-out files): forward KL(teacher ||
student) per token. Saved to <model dir>/edge0/lora.safetensors with provenance.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from workbench.edge0.artifacts import artifact_path, model_identity, save_safetensors
from workbench.edge0.serve import Heads
from training.edge0_common import (PROJ, Clock, HeadSet, LoRASet, TorchMoE, command_line, data_digest,
                                          open_pack, sample_windows)
from workbench.commands import flags
from workbench.registry import REPO, tokenizer_for
from workbench.errors import WorkbenchError
from workbench.host import peak_rss_bytes
from training.corpora import TRAIN, encode_train


def kl_teacher_student(t_logits, s_logits, mask=None):
    lt, ls = F.log_softmax(t_logits, -1), F.log_softmax(s_logits, -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    return kl.mean() if mask is None else (kl * mask).sum() / mask.sum()


def reverse_kl(s_logits, t_logits, mask):
    ls, lt = F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return (kl * mask).sum() / mask.sum()


def every(n: int) -> int:
    """Log a phase at about every quarter of its steps."""
    return max(1, min(20, n // 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags("model")(ap)
    ap.add_argument("--heads", default=None, help="default: <model dir>/edge0/prerouter.safetensors")
    ap.add_argument("--skip-layers", type=int, default=None, help="default: the heads' skip_layers")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="q,k,v,o")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--text-seqs", type=int, default=192, help="teacher-written sequences for phase 1")
    ap.add_argument("--text-len", type=int, default=112, help="teacher tokens per sequence")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--ce-steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rkl-rounds", type=int, default=20)
    ap.add_argument("--rkl-batch", type=int, default=8)
    ap.add_argument("--rkl-len", type=int, default=64, help="student tokens per on-policy sample")
    ap.add_argument("--rkl-steps", type=int, default=2, help="gradient steps per on-policy batch")
    ap.add_argument("--rkl-lr", type=float, default=1e-3)
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--val-ctx", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: <model dir>/edge0/lora.safetensors")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed + 1)
    gen = torch.Generator().manual_seed(a.seed)
    clock = Clock()

    tpack, spack = open_pack(a.model, "bf16"), open_pack(a.model, "q4")
    ident = model_identity(spack)
    if model_identity(tpack) != ident:
        raise WorkbenchError("the teacher's and the student's packs come from different checkpoints")
    student = TorchMoE(spack)
    teacher = student if tpack.path == spack.path else TorchMoE(tpack)     # teacher: exact routing, no adapters
    s = student.spec
    print(f"{spack.path}: {student.weights.f32_bytes / 2**30:.1f} GiB in f32, "
          f"{'streamed from disk layer by layer' if student.weights.streams else 'held in memory'}", flush=True)
    hpath = a.heads or artifact_path(spack, "prerouter")
    hn = Heads.load(s, spack, hpath)                       # checks shapes and that it was trained for this model
    heads = HeadSet.from_numpy(hn.t, hn.meta)
    for p in heads.parameters():
        p.requires_grad_(False)
    skip = int(a.skip_layers if a.skip_layers is not None else hn.meta.get("skip_layers", 1))
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if any(t not in PROJ for t in targets):
        raise WorkbenchError(f"--targets {a.targets!r}: choose among q, k, v, o")
    lora = LoRASet(student.proj_shapes(targets), rank=a.rank, alpha=a.alpha, seed=a.seed)
    route = dict(heads=heads, skip_layers=skip)

    tok = tokenizer_for(spack)
    corpora = encode_train(tok)
    val = torch.from_numpy(sample_windows(corpora, a.val_windows, a.val_ctx, rng))

    def val_kl():
        with torch.no_grad():
            return kl_teacher_student(t_val, student(val, lora=lora, **route), None).item()

    with torch.no_grad():
        t_val = teacher(val)
        base_kl = kl_teacher_student(t_val, student(val, **route)).item()
        exact_kl = 0.0 if teacher is student else kl_teacher_student(t_val, student(val)).item()
    print(f"val KL(teacher||student): exact routing {exact_kl:.4f}{' (the same weights)' if teacher is student else ''}, "
          f"prerouter {base_kl:.4f}  ({clock():.0f}s)", flush=True)

    # ---- phase 1: cross-entropy on teacher-written text
    P = a.prompt_len
    prompts = torch.from_numpy(sample_windows(corpora, a.text_seqs, P, rng))
    texts = []
    for b in range(0, a.text_seqs, 64):
        texts.append(teacher.sample(prompts[b:b + 64], a.text_len, gen, temperature=a.temperature))
    texts = torch.cat(texts)
    print(f"teacher wrote {a.text_seqs} x {a.text_len} tokens  ({clock():.0f}s)", flush=True)
    opt = torch.optim.AdamW(lora.parameters(), lr=a.lr, weight_decay=0.0)
    mask = torch.zeros(texts.shape[1] - 1)
    mask[P - 1:] = 1.0                                            # predict the teacher's tokens only
    log = []
    for step in range(a.ce_steps):
        for g in opt.param_groups:
            g["lr"] = a.lr * 0.5 * (1 + math.cos(math.pi * step / max(1, a.ce_steps)))
        rows = torch.from_numpy(rng.choice(len(texts), size=a.batch, replace=False))
        x = texts[rows]
        logits = student(x[:, :-1], lora=lora, **route)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        loss = (ce.view(x.shape[0], -1) * mask).sum() / (mask.sum() * x.shape[0])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % every(a.ce_steps) == 0:
            log.append({"phase": "ce", "step": step + 1, "ce": round(loss.item(), 4)})
            print(f"ce step {step + 1}/{a.ce_steps} loss {loss.item():.4f}  ({clock():.0f}s)", flush=True)
    kl1 = val_kl()
    print(f"val KL after phase 1: {kl1:.4f}  ({clock():.0f}s)", flush=True)

    # ---- phase 2: on-policy reverse KL against the teacher
    opt = torch.optim.AdamW(lora.parameters(), lr=a.rkl_lr, weight_decay=0.0)
    for r in range(a.rkl_rounds):
        pr = torch.from_numpy(sample_windows(corpora, a.rkl_batch, P, rng))
        seqs = student.sample(pr, a.rkl_len, gen, temperature=a.temperature, lora=lora, **route)
        x = seqs[:, :-1]
        with torch.no_grad():
            t_logits = teacher(x)
        m = torch.zeros(x.shape[0], x.shape[1])
        m[:, P - 1:] = 1.0                                        # positions whose next token the student sampled
        for _ in range(a.rkl_steps):
            loss = reverse_kl(student(x, lora=lora, **route), t_logits, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        log.append({"phase": "rkl", "round": r + 1, "rkl": round(loss.item(), 4)})
        if (r + 1) % every(a.rkl_rounds) == 0:
            print(f"rkl round {r + 1}/{a.rkl_rounds} reverse KL {loss.item():.4f}  ({clock():.0f}s)", flush=True)
    kl2 = val_kl()
    print(f"val KL after phase 2: {kl2:.4f}  ({clock():.0f}s)", flush=True)

    meta = {**ident, "format": 1, "rank": a.rank, "alpha": a.alpha, "scale": lora.scale, "targets": targets,
            "num_layers": s.num_layers,
            "shared_expert": "not adapted" if s.shared_expert_size else "none in this model: attention only",
            "student": ("the GGUF's own blocks, dequantized + prerouter routing, fp32" if teacher is student else
                        "int4 pack (experts q4, rest q4, dequantized) + prerouter routing, fp32"),
            "teacher": "the same weights, exact routing" if teacher is student else "bf16 pack, exact routing",
            "weights": "streamed from disk layer by layer" if student.weights.streams else "held in memory",
            "heads": {"path": str(hpath), "skip_layers": skip, "trained": hn.meta.get("created")},
            "phases": [{"name": "ce on teacher-written text", "steps": a.ce_steps, "batch": a.batch, "lr": a.lr,
                        "seqs": a.text_seqs, "prompt_len": P, "text_len": a.text_len, "temperature": a.temperature},
                       {"name": "on-policy reverse KL", "rounds": a.rkl_rounds, "batch": a.rkl_batch,
                        "len": a.rkl_len, "steps_per_round": a.rkl_steps, "lr": a.rkl_lr}],
            "data": {"corpora": {n: str(p.relative_to(REPO)) for n, p in TRAIN.items()}, "seed": a.seed,
                     "prompts_sha256": data_digest(prompts.numpy())},
            "val_kl_train_corpora": {"int4_exact": exact_kl, "int4_prerouter": base_kl, "after_ce": kl1,
                                     "after_rkl": kl2, "windows": a.val_windows, "ctx": a.val_ctx},
            "log": log, "command": command_line(), "train_seconds": round(clock(), 1), "threads": a.threads,
            "peak_rss_bytes": peak_rss_bytes(),
            "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = save_safetensors(a.out or artifact_path(spack, "lora"), lora.to_numpy(), "lora", meta)
    print(json.dumps(meta["val_kl_train_corpora"]))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) in {clock():.0f}s", flush=True)


if __name__ == "__main__":
    main()
