"""Train the demo MoE (Qwen3-MoE architecture) on the public corpora, in torch on the CPU.

    python -m training.demo --out runs/train-demo --steps 700
    python -m training.demo --out runs/train-demo --export data/models/demo-moe

The draft model speculative decoding verifies against the demo (runtime.speculative.DraftModel): the same family at
a smaller size, trained on the same corpora with the demo's tokenizer.

    python -m training.demo --size draft --tokenizer data/models/demo-moe/tokenizer.json --out runs/train-draft \
        --steps 2000
    python -m training.demo --out runs/train-draft --export data/models/demo-draft

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

from training.corpora import EOS, TRAIN, encode_train
from training.model import MoEDecoder
from workbench.atomic import atomic_path, replace_dir


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


SIZES = {"demo": DemoConfig(),
         "draft": DemoConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)}

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


# ---------------------------------------------------------------- model (HF Qwen3-MoE names: training/model.py)

class DemoMoE(MoEDecoder):
    def __init__(self, c: DemoConfig):
        super().__init__(c)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)


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


def train(out: Path, steps: int, minutes: float, batch: int, T: int, lr: float, seed: int, ckpt_every: int,
          size: str = "demo", tokenizer: Path | None = None):
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    c = SIZES[size]
    tok_path = out / "tokenizer.json"
    if tokenizer and not tok_path.exists():
        tok_path.write_bytes(tokenizer.read_bytes())
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
    ap.add_argument("--size", choices=SIZES, default="demo", help="the demo, or its draft model's size")
    ap.add_argument("--tokenizer", type=Path, help="a tokenizer.json to train with (default: train one)")
    ap.add_argument("--export", type=Path, help="export the checkpoint in --out to this HF directory and exit")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.export:
        export(a.out, a.export)
    else:
        train(a.out, a.steps, a.minutes, a.batch, a.ctx, a.lr, a.seed, a.ckpt_every, a.size, a.tokenizer)


if __name__ == "__main__":
    main()
