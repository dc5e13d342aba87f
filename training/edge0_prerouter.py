"""Train Edge0's prerouter heads on the teacher, from the training corpora only (never the held-out files).

    python -m training.edge0_prerouter --model demo

Data: windows of the training corpora (workbench.textdata.TRAIN) through the teacher (the bf16 pack, or a
GGUF's own blocks; exact routing; the workbench's engine, streaming: any size of model). For every token t and owner layer L the feature is
    concat[x_L(t) (the router input, after the post-attention norm), one-hot top-k of L at t, at t-1]
and the target is layer L+1's router logits at token t+1.
Heads: per owner layer, fc1 -> gelu -> fc2 plus a linear residual path warm-started from layer L+1's router
(with L+1's norm: LES's lookahead), fc2 starting at zero; trained to imitate the next router with
KL(softmax(target) || softmax(head)). Saved to <model dir>/edge0/prerouter.safetensors with provenance.
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
from runtime.session import prefills
from training.edge0_common import Clock, HeadSet, command_line, data_digest, onehot, open_pack, sample_windows
from workbench.commands import flags
from workbench.registry import REPO, tokenizer_for
from workbench.errors import WorkbenchError
from training.corpora import TRAIN, encode_train


def collect(pack, windows: np.ndarray, log=print):
    """{layer: (x fp16 (N, T, d), ids int16 (N, T, k), logits fp32 (N, T, E))}, exact routing: the workbench's own
    engine prefilling each window with the teacher's experts streamed (runtime.session.prefills), so a model bigger
    than memory is its own teacher in little memory."""
    s = pack.spec
    N, T = windows.shape
    out = {L: (np.zeros((N, T, s.hidden_size), np.float16), np.zeros((N, T, s.top_k), np.int16),
               np.zeros((N, T, s.num_experts), np.float32)) for L in s.moe_layers}
    clock = Clock()
    for n, got in enumerate(prefills(pack, windows, keep=("x", "logits"))):
        for L, (x, idx, lg) in out.items():
            x[n], idx[n], lg[n] = got["x"][L], got["idx"][L], got["logits"][L]
        if log and (n % 8 == 0 or n == N - 1):
            log(f"collect {n + 1}/{N} windows  {clock():.0f}s")
    return out


def batch_of(data, owners, moe, rows, pos, E):
    """Features at (row, pos) and targets at (row, pos + 1), per owner layer."""
    feats, targets = {}, {}
    for o in owners:
        x, idx, _ = data[o]
        t = moe[moe.index(o) + 1]
        cur = torch.from_numpy(idx[rows, pos].astype(np.int64))
        prev = torch.from_numpy(idx[rows, np.maximum(pos - 1, 0)].astype(np.int64))
        oh_prev = onehot(prev, E) * torch.from_numpy((pos > 0).astype(np.float32))[:, None]
        feats[o] = torch.cat([torch.from_numpy(x[rows, pos].astype(np.float32)), onehot(cur, E), oh_prev], -1)
        targets[o] = torch.from_numpy(data[t][2][rows, pos + 1])
    return feats, targets


def kl_and_recall(pred, target, k):
    """Mean KL(softmax(target) || softmax(pred)) and top-k recall of pred's top-k against target's."""
    lt = F.log_softmax(target, -1)
    kl = (lt.exp() * (lt - F.log_softmax(pred, -1))).sum(-1).mean()
    a, b = pred.topk(k, -1).indices, target.topk(k, -1).indices
    rec = (a[..., :, None] == b[..., None, :]).any(-1).float().mean()
    return kl, rec


def evaluate(heads, data, owners, moe, rows, E, k, chunk=4096):
    T = data[owners[0]][0].shape[1]
    rr, pp = np.meshgrid(rows, np.arange(T - 1), indexing="ij")
    rr, pp = rr.reshape(-1), pp.reshape(-1)
    res = {}
    with torch.no_grad():
        for o in owners:
            kls, recs, ns, hist = [], [], [], []
            for c in range(0, len(rr), chunk):
                f, tg = batch_of(data, [o], moe, rr[c:c + chunk], pp[c:c + chunk], E)
                kl, rec = kl_and_recall(heads(o, f[o]), tg[o], k)
                kls.append(kl.item())
                recs.append(rec.item())
                ns.append(len(f[o]))
                # reference: the experts layer L+1 used at token t (what the previous token did), vs at t+1
                t = moe[moe.index(o) + 1]
                same = torch.from_numpy(data[t][1][rr[c:c + chunk], pp[c:c + chunk]].astype(np.int64))
                b = tg[o].topk(k, -1).indices
                hist.append((same[..., :, None] == b[..., None, :]).any(-1).float().mean().item())
            w = np.asarray(ns, np.float64) / sum(ns)
            res[o] = {"kl": float(np.dot(w, kls)), "recall": float(np.dot(w, recs)),
                      "history_recall": float(np.dot(w, hist))}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags("model")(ap)
    ap.add_argument("--windows", type=int, default=512, help="training-corpus windows through the teacher")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per window")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--skip-layers", type=int, default=1, help="serving default: MoE layers routed exactly")
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: <model dir>/edge0/prerouter.safetensors")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    clock = Clock()

    pack = open_pack(a.model, "bf16")
    s = pack.spec
    moe, E, k = s.moe_layers, s.num_experts, s.top_k
    owners = moe[:-1]
    tok = tokenizer_for(pack)
    if tok is None:
        raise WorkbenchError(f"{pack.path}: no tokenizer: cannot encode the training corpora")
    data_ids = encode_train(tok)
    windows = sample_windows(data_ids, a.windows, a.ctx, rng)
    print(f"{a.windows} windows x {a.ctx} tokens from {', '.join(data_ids)}  ({clock():.0f}s)", flush=True)
    data = collect(pack, windows, log=lambda m: print(m, flush=True))
    n_val = max(1, int(round(a.val_frac * len(windows))))
    val_rows, train_rows = np.arange(len(windows) - n_val, len(windows)), np.arange(len(windows) - n_val)

    heads = HeadSet(owners, s.hidden_size, E, a.hidden)
    heads.warm_start({n: pack.tensor(n) for o in moe for n in (f"layers.{o}.router", f"layers.{o}.mlp_norm")}, s)
    before = evaluate(heads, data, owners, moe, val_rows, E, k)
    print("warm start (val):", json.dumps({o: {m: round(v, 3) for m, v in r.items()} for o, r in before.items()}),
          flush=True)
    opt = torch.optim.AdamW(heads.parameters(), lr=a.lr, weight_decay=0.0)
    T = a.ctx
    log = []
    for step in range(a.steps):
        lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, a.steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        rows = rng.choice(train_rows, size=a.batch)
        pos = rng.integers(0, T - 1, size=a.batch)
        feats, targets = batch_of(data, owners, moe, rows, pos, E)
        loss = 0.0
        for o in owners:
            lt = F.log_softmax(targets[o], -1)
            loss = loss + (lt.exp() * (lt - F.log_softmax(heads(o, feats[o]), -1))).sum(-1).mean()
        loss = loss / len(owners)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0 or step == 0:
            log.append({"step": step + 1, "kl": round(loss.item(), 4)})
            print(f"step {step + 1}/{a.steps} kl {loss.item():.4f}  {clock():.0f}s", flush=True)
    after = evaluate(heads, data, owners, moe, val_rows, E, k)
    print("trained (val):", json.dumps({o: {m: round(v, 3) for m, v in r.items()} for o, r in after.items()}),
          flush=True)

    ident = model_identity(pack)
    if model_identity(open_pack(a.model, "q4")) != ident:
        raise WorkbenchError("the teacher's and the student's packs come from different checkpoints")
    meta = {**ident, "format": 1, "owners": owners, "hidden": a.hidden, "hidden_size": s.hidden_size,
            "num_experts": E, "top_k": k, "num_layers": s.num_layers, "skip_layers": a.skip_layers,
            "features": "concat[x_L(t) router input, onehot topk_L(t), onehot topk_L(t-1)] -> logits L+1 at t+1",
            "activation": "gelu_tanh", "loss": "KL(softmax(next router) || softmax(head))",
            "warm_start": "res[:, :d] = router_{L+1} * (mlp_norm_{L+1} / mlp_norm_L); fc2 = 0",
            "data": {"corpora": {n: str(p.relative_to(REPO)) for n, p in TRAIN.items()},
                     "windows": a.windows, "ctx": a.ctx, "tokens": int(windows.size), "seed": a.seed,
                     "windows_sha256": data_digest(windows), "teacher": f"{pack.path.name}, exact routing",
                     "val_windows": int(n_val)},
            "steps": a.steps, "batch": a.batch, "lr": a.lr, "optimizer": "AdamW, cosine to 0.1x",
            "val_before": before, "val_after": after, "log": log, "command": command_line(),
            "train_seconds": round(clock(), 1), "threads": a.threads, "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = save_safetensors(a.out or artifact_path(pack, "prerouter"), heads.to_numpy(), "prerouter", meta)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB) in {clock():.0f}s", flush=True)


if __name__ == "__main__":
    main()
