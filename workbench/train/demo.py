"""Train the demo MoE (Qwen3-MoE architecture) on the public corpora, in torch on the CPU.

    python -m workbench.train.demo --out runs/train-demo --steps 700
    python -m workbench.train.demo --out runs/train-demo --export data/models/demo-moe

Seeded and resumable: a checkpoint (weights, optimizer, RNG, step) is written
atomically every --ckpt-every steps and picked up on restart. The export is a
Hugging Face directory (config.json, model.safetensors in bf16, tokenizer.json)
that transformers' Qwen3MoeForCausalLM loads.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.atomic import atomic_path, replace_dir
from workbench.train.corpora import EOS, TRAIN, encode_train


@dataclass
class DemoConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    router_aux_loss_coef: float = 0.01


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # the GPT-2 split regex
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in TRAIN.values()], trainer)
    tok.save(str(out))
    return tok


# ---------------------------------------------------------------- model (HF Qwen3-MoE names)

class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_attention_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Expert(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.k = c.num_experts_per_tok
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = logits.float().softmax(-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)  # norm_topk_prob
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.k
        start = 0
        for e, n in enumerate(counts):
            if n:
                r = rows[start:start + n]
                y = self.experts[e](x[r]) * w.reshape(-1)[order[start:start + n]].unsqueeze(-1)
                out.index_add_(0, r, y)
            start += n
        # Switch-style load balancing: fraction routed x mean probability, per expert.
        frac = torch.bincount(flat, minlength=len(self.experts)).float() / flat.numel()
        aux = len(self.experts) * (frac * probs.mean(0)).sum()
        return out.reshape(shape), aux


class Layer(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, aux = self.mlp(self.post_attention_layernorm(x))
        return x + y, aux


class Inner(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DemoMoE(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids):
        T = ids.shape[1]
        f = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.model.embed_tokens(ids)
        aux = 0.0
        for layer in self.model.layers:
            x, a = layer(x, cos, sin)
            aux = aux + a
        return self.lm_head(self.model.norm(x)), aux / len(self.model.layers)


# ---------------------------------------------------------------- training

def batches(data: dict[str, np.ndarray], rng: np.random.Generator, batch: int, T: int):
    """Each row is a random window from one domain, domains mixed within a batch by their size."""
    names = list(data)
    sizes = np.array([len(data[n]) for n in names], dtype=np.float64)
    p = sizes / sizes.sum()
    while True:
        rows = []
        for n in rng.choice(len(names), size=batch, p=p):
            d = data[names[n]]
            s = rng.integers(0, len(d) - T - 1)
            rows.append(d[s:s + T + 1])
        yield torch.from_numpy(np.stack(rows).astype(np.int64))


def atomic_torch_save(obj, path: Path):
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def lr_at(step, total, peak, warmup=100):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))


def train(out: Path, steps: int, minutes: float, batch: int, T: int, lr: float, seed: int, ckpt_every: int):
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    c = DemoConfig()
    tok_path = out / "tokenizer.json"
    if tok_path.exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(c.vocab_size, tok_path)
    data = {k: v.astype(np.int32) for k, v in encode_train(tok).items()}
    print({n: len(d) for n, d in data.items()}, flush=True)
    model = DemoMoE(c)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(seed)
    step, log = 0, []
    ck = out / "ckpt.pt"
    if ck.exists():
        state = torch.load(ck, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        step, log = state["step"], state["log"]
        print(f"resumed at step {step}", flush=True)
    gen = batches(data, rng, batch, T)
    t0 = time.time()
    model.train()
    while step < steps and (time.time() - t0) < minutes * 60:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        b = next(gen)
        logits, aux = model(b[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, c.vocab_size), b[:, 1:].reshape(-1))
        loss = ce + c.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            log.append({"step": step, "ce": round(ce.item(), 4), "aux": round(float(aux.detach()), 4),
                        "tokens": step * batch * T})
            print(log[-1], f"{(time.time() - t0):.0f}s", flush=True)
        if step % ckpt_every == 0 or step == steps:
            atomic_torch_save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.bit_generator.state,
                               "torch_rng": torch.get_rng_state(), "step": step, "log": log,
                               "config": asdict(c), "args": dict(steps=steps, batch=batch, T=T, lr=lr, seed=seed)}, ck)
    atomic_torch_save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng.bit_generator.state,
                       "torch_rng": torch.get_rng_state(), "step": step, "log": log,
                       "config": asdict(c), "args": dict(steps=steps, batch=batch, T=T, lr=lr, seed=seed)}, ck)
    print(f"stopped at step {step}/{steps}", flush=True)


# ---------------------------------------------------------------- export

def export(out: Path, dst: Path):
    from safetensors.torch import save_file

    state = torch.load(out / "ckpt.pt", weights_only=False)
    c = DemoConfig(**state["config"])
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state["model"].items()}
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    eos = 0  # <|endoftext|> is the first special token
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": 4 * c.hidden_size,
        "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": False,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "bfloat16",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}) + "\n")
    (tmp / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "unk_token": EOS,
        "model_max_length": c.max_position_embeddings}, indent=2) + "\n")
    (tmp / "training_log.json").write_text(json.dumps({"args": state["args"], "step": state["step"],
                                                      "log": state["log"]}, indent=1) + "\n")
    replace_dir(tmp, dst)
    print(f"exported step {state['step']} to {dst}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/train-demo"))
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--minutes", type=float, default=110.0, help="stop (after a checkpoint) past this wall time")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export", type=Path, help="export the checkpoint in --out to this HF directory and exit")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.export:
        export(a.out, a.export)
    else:
        train(a.out, a.steps, a.minutes, a.batch, a.ctx, a.lr, a.seed, a.ckpt_every)


if __name__ == "__main__":
    main()
