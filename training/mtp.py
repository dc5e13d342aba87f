"""Train a multi-token-prediction (MTP) head for the demo model, the demo frozen, in torch on the CPU.

    python -m training.mtp --model demo --out runs/train-mtp --steps 1000 --windows 4096
    python -m training.mtp --model demo --out runs/train-mtp --export data/models/demo-moe/mtp/mtp.safetensors

The head is Qwen3-Next's (transformers' and vLLM's names, `mtp.*`): the embedding of token t+1 and the model's last
hidden state at t (before its final norm), each RMS-normed, concatenated and projected back to the model's width
(`fc`), through one decoder layer of the model's own kind (attention and MoE) and a final norm, into the model's own
head: it predicts token t+2. Chained, its output state stands in for the model's at the next step, so it drafts
several tokens (runtime.speculative.MTPDraft). The hidden states are computed once, for a fixed set of training
windows (the demo's corpora, the held-out files never seen), then the head trains on them; the demo's embedding and
head are shared and frozen.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from training.corpora import encode_train
from training.model import Layer, MoEConfig, MoEDecoder, RMSNorm
from workbench.atomic import atomic_path, atomic_write

PREFIX = "mtp."


class MTP(nn.Module):
    """One MTP block. forward(emb of t+1, hidden at t, rope of the positions t+1) -> its state (pre-norm)."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        d = c.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(d, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, c.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([Layer(c, c.num_hidden_layers)])     # its attention's KV under its own name
        self.norm = RMSNorm(d, c.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, kv=None):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
        x, aux = self.layers[0](x, cos, sin, kv=kv)
        return x, aux


def load_demo(model_dir: Path) -> tuple[MoEDecoder, MoEConfig]:
    from safetensors.torch import load_file
    cfg = json.loads((model_dir / "config.json").read_text())
    c = MoEConfig(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                  cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_experts"], cfg["num_experts_per_tok"],
                  cfg["moe_intermediate_size"], cfg["rms_norm_eps"], cfg["rope_theta"], cfg["norm_topk_prob"])
    m = MoEDecoder(c)
    m.load_state_dict({k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()})
    return m.requires_grad_(False).eval(), c


@torch.no_grad()
def hidden_states(m: MoEDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The model's last hidden states (before its final norm), (B, T, d)."""
    cos, sin = m.rope(0, ids.shape[1])
    x = m.model.embed_tokens(ids)
    for layer in m.model.layers:
        x, _ = layer(x, cos, sin)
    return x


def windows(model_dir: Path, n: int, T: int, seed: int) -> torch.Tensor:
    from tokenizers import Tokenizer
    data = encode_train(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    rng = np.random.default_rng(seed)
    names, sizes = list(data), np.array([len(v) for v in data.values()], np.float64)
    rows = []
    for k in rng.choice(len(names), size=n, p=sizes / sizes.sum()):
        d = data[names[k]]
        s = rng.integers(0, len(d) - T - 1)
        rows.append(d[s:s + T])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def mtp_loss(m: MoEDecoder, head: MTP, ids, hid):
    """Cross-entropy of the head's prediction of token t+2 from (hidden t, token t+1), every t of the windows."""
    T = ids.shape[1]
    cos, sin = m.rope(1, T - 1)                         # the head's row t sits at token t+1's position
    x, aux = head(m.model.embed_tokens(ids[:, 1:]), hid[:, :-1], cos, sin)
    logits = m.lm_head(head.norm(x[:, :-1]))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 2:].reshape(-1)), aux, logits


def train(model_dir: Path, out: Path, steps: int, n_windows: int, batch: int, T: int, lr: float, seed: int):
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    m, c = load_demo(model_dir)
    ids = windows(model_dir, n_windows, T, seed)
    t0 = time.time()
    hid = torch.cat([hidden_states(m, ids[i:i + batch]) for i in range(0, len(ids), batch)])
    print(f"{len(ids)} windows of {T}: hidden states in {time.time() - t0:.0f} s", flush=True)
    head = MTP(c)
    last = m.model.layers[-1].state_dict()              # start from the model's last layer: a working layer
    head.layers[0].load_state_dict(last)
    with torch.no_grad():                               # and from passing the hidden state through
        head.fc.weight.zero_()
        head.fc.weight[:, c.hidden_size:] = torch.eye(c.hidden_size)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng, log = np.random.default_rng(seed + 1), []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / steps)))
        b = torch.from_numpy(rng.choice(len(ids), size=batch, replace=False))
        ce, aux, _ = mtp_loss(m, head, ids[b], hid[b])
        loss = ce + 0.01 * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log.append({"step": step, "ce": round(ce.item(), 4)})
            print(log[-1], f"{time.time() - t0:.0f}s", flush=True)
    with atomic_path(out / "mtp.pt") as tmp:
        torch.save({"head": head.state_dict(), "log": log, "args": dict(steps=steps, windows=n_windows, batch=batch,
                                                                        T=T, lr=lr, seed=seed)}, tmp)


def export(out: Path, dst: Path):
    """The head's tensors in bf16 under Qwen3-Next's names (mtp.*), and its training log beside them."""
    from safetensors.torch import save_file
    state = torch.load(out / "mtp.pt", weights_only=False)
    tensors = {PREFIX + k: v.to(torch.bfloat16).contiguous() for k, v in state["head"].items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write(dst.with_name("mtp_training_log.json"), json.dumps({"args": state["args"], "log": state["log"]},
                                                                     indent=1) + "\n")
    print(f"exported {len(tensors)} tensors to {dst}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("data/models/demo-moe"))
    ap.add_argument("--out", type=Path, default=Path("runs/train-mtp"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=4096, help="training windows whose hidden states are computed")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export", type=Path, help="export the head trained in --out to this safetensors file and exit")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = Path("data/models/demo-moe") if str(a.model) == "demo" else a.model
    if a.export:
        export(a.out, a.export)
    else:
        train(model, a.out, a.steps, a.windows, a.batch, a.ctx, a.lr, a.seed)


if __name__ == "__main__":
    main()
