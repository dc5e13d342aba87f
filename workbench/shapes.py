"""Real expert sizes: random-weight checkpoints with the dimensions of the seeds' models.

    python -m workbench make-model --shape qwen3.6-35b-a3b --layers 4 --experts 64

The checkpoint is a Hugging Face directory (config.json, float16 safetensors shards, the demo's tokenizer) that
every verb takes as --model. Its weights are random, so its own routing means nothing: drive it with a routing
trace (`bench --routing-trace`, `simulate`). It is labelled random in its card (random_weights.json, MODEL_CARD.md)
and in every run record made from it.

Every shape runs on the Qwen3-MoE decoder. For hybrid shapes (Gated DeltaNet layers, a gated shared expert: issue
15) only the expert shape is the real one (hidden size, moe intermediate size, experts, top-k); every layer gets
full attention with the real head counts and there is no shared expert. The layer count (and, if asked, the
expert count) is reduced; top-k stays the model's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

DEMO = Path(__file__).resolve().parents[1] / "data" / "models" / "demo-moe"
_T5 = "transformers 5.24's default config, documented as that of"

SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hybrid=False,
        source=f"{_T5} Qwen/Qwen3-30B-A3B-Base (Qwen3MoeConfig: d 2048, moe ff 768, 128 experts, top-8, 32/4 heads); "
               "48 layers and head_dim 128 from Qwen/Qwen3-30B-A3B's config.json"),
    "qwen3.6-35b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        source=f"{_T5} Qwen/Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig); transformers' qwen3_5_moe docs: Qwen3.6 "
               "checkpoints share the architecture and model_type of Qwen3.5"),
    "qwen3-next-80b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        source=f"{_T5} Qwen/Qwen3-Next-80B-A3B-Instruct (Qwen3NextConfig)"),
    "minicpm-v-4.7": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        source="MiniCPM-V 4.7 CookBook overview (openbmb/MiniCPM-V-4.7-35B-A3B: language backbone qwen3_5_moe_text, "
               "256 experts, 8 per token); the hidden and expert sizes are those of that backbone's Qwen3.5-35B-A3B "
               f"({_T5} Qwen/Qwen3.5-35B-A3B), consistent with LES's 1.29 MB experts at 3 bits"),
}


def card(shape: str, layers: int, experts: int) -> dict:
    s = SHAPES[shape]
    notes = [f"random weights (seeded normal, std 0.02): routing and text mean nothing; drive runs with a routing trace",
             f"{layers} of {s['num_hidden_layers']} layers"]
    if experts != s["num_experts"]:
        notes.append(f"{experts} of {s['num_experts']} experts per layer")
    if s["hybrid"]:
        notes.append("the real model's Gated DeltaNet / gated attention layers are not supported yet (issue 15): every "
                     "layer here is Qwen3-MoE full attention with the real head counts; the real expert shape only")
    if s.get("shared_expert"):
        notes.append(f"no shared expert (the real model has a {s['shared_expert']}-wide one, always resident: compute, not reads)")
    notes.append("vocabulary: the demo model's 4096-token tokenizer (embeddings are resident, never streamed)")
    return {"random_weights": True, "shape": shape, "layers": layers, "experts": experts,
            "top_k": s["num_experts_per_tok"], "hidden_size": s["hidden_size"],
            "moe_intermediate_size": s["moe_intermediate_size"], "source": s["source"], "notes": notes,
            "label": f"{shape} expert shape, RANDOM weights ({layers} layers, {experts} experts)"}


def random_label(model_dir) -> str | None:
    """The random-weights label of a checkpoint made here, or None."""
    p = Path(model_dir) / "random_weights.json"
    return json.loads(p.read_text())["label"] if p.is_file() else None


def checkpoint_path(shape: str, layers: int, experts: int | None = None) -> Path:
    """Where make-model writes a checkpoint by default: one directory per (shape, layers, experts) in the cache."""
    from workbench.registry import cache_dir
    return cache_dir() / "models" / f"{shape}-{layers}L-{experts or 'all'}E-random"


def checkpoint_bytes(shape: str, layers: int, experts: int | None = None) -> int:
    """The checkpoint's size on disk (float16 tensors; the JSON files and the tokenizer left out)."""
    s, V = SHAPES[shape], json.loads((DEMO / "config.json").read_text())["vocab_size"]
    d, ff, hd = s["hidden_size"], s["moe_intermediate_size"], s["head_dim"]
    attention = (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd * d
    per_layer = attention + (experts or s["num_experts"]) * (3 * d * ff + d) + 2 * d + 2 * hd
    return 2 * (2 * V * d + d + layers * per_layer)


def make_model(shape: str, layers: int, out, experts: int | None = None, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (one float16 safetensors shard per layer); refused when its disk lacks room."""
    if shape not in SHAPES:
        raise WorkbenchError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    experts = experts or s["num_experts"]
    if not 1 <= layers <= s["num_hidden_layers"]:
        raise WorkbenchError(f"--layers {layers}: {shape} has 1 to {s['num_hidden_layers']}")
    if not s["num_experts_per_tok"] <= experts <= s["num_experts"]:
        raise WorkbenchError(f"--experts {experts}: {shape} needs {s['num_experts_per_tok']} to {s['num_experts']}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise WorkbenchError(f"{out}: exists and is not empty")
    need, free = checkpoint_bytes(shape, layers, experts), free_bytes(out)
    if need > free:
        raise WorkbenchError(f"{out}: {shape} at {layers} layers and {experts} experts needs {need / 1e9:.2f} GB, "
                             f"the disk has {free / 1e9:.2f} GB free")
    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.update({k: s[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts_per_tok", "num_attention_heads",
                                  "num_key_value_heads", "head_dim")},
               num_experts=experts, num_hidden_layers=layers, intermediate_size=4 * s["hidden_size"],
               torch_dtype="float16")
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(tmp, cfg, rng)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    c = card(shape, layers, experts)
    (tmp / "random_weights.json").write_text(json.dumps({**c, "seed": seed}, indent=1))
    (tmp / "MODEL_CARD.md").write_text(f"# {c['label']}\n\nShape source: {c['source']}.\n\n" +
                                       "".join(f"- {n}\n" for n in c["notes"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    tmp.rename(out)            # the directory appears whole or not at all
    return out


def free_bytes(path) -> int:
    """Free bytes on the disk that holds `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _write(tmp: Path, cfg: dict, rng):
    from safetensors.numpy import save_file
    d, ff, h, kv, hd, V, layers, experts = (cfg[k] for k in (
        "hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "num_hidden_layers", "num_experts"))
    w = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
    one = lambda n: np.ones(n, np.float16)
    weight_map = {}

    def save(fname, tensors):            # one shard at a time: a layer of a real shape is about a gigabyte
        save_file(tensors, str(tmp / fname))
        weight_map.update({k: fname for k in tensors})

    save("model-embed.safetensors", {"model.embed_tokens.weight": w(V, d), "model.norm.weight": one(d),
                                     "lm_head.weight": w(V, d)})
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": one(d), p + "post_attention_layernorm.weight": one(d),
             p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
             p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
             p + "self_attn.q_norm.weight": one(hd), p + "self_attn.k_norm.weight": one(hd),
             p + "mlp.gate.weight": w(experts, d)}
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t.update({q + "gate_proj.weight": w(ff, d), q + "up_proj.weight": w(ff, d), q + "down_proj.weight": w(d, ff)})
        save(f"model-layer{i:03d}.safetensors", t)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(DEMO / "tokenizer.json", tmp / "tokenizer.json")
