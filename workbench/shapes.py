"""Real expert sizes: random-weight checkpoints with the dimensions of the seeds' models.

    python -m workbench make-model --shape qwen3.6-35b-a3b --layers 4 --experts 64
    python -m workbench make-model --shape qwen3-next-80b-a3b --out next.gguf      # full size, real architecture

The checkpoint is a Hugging Face directory (config.json, float16 safetensors shards, the demo's tokenizer) that
every verb takes as --model, or a GGUF (engines/gguf_random.py). Its weights are random, but its routing is laid
out to have a real model's statistics (workbench/made_routing.py); or drive it with a routing trace
(`bench --routing-trace`, `simulate`). It is labelled random in its card
(random_weights.json and MODEL_CARD.md, or the GGUF's `workbench.random_weights` key) and in every run record made
from it.

In a Hugging Face directory every shape runs on the Qwen3-MoE decoder: for hybrid shapes (Gated DeltaNet layers, a
gated shared expert: issue 15) only the expert shape is the real one (hidden size, moe intermediate size, experts,
top-k); every layer gets full attention with the real head counts and there is no shared expert. A GGUF has the
real architecture (`hf_config`). The layer count (and, if asked, the expert count) may be reduced; top-k stays the
model's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError

DEMO = Path(__file__).resolve().parents[1] / "data" / "models" / "demo-moe"
_T5 = "transformers 5.24's default config, documented as that of"
RANDOM_KEY = "workbench.random_weights"          # the card, as JSON, in a GGUF's metadata
# the hybrid family's Gated DeltaNet and attention layout (Qwen3NextConfig's and Qwen3_5MoeTextConfig's defaults);
# each shape's `arch`: its model_type, and the rope_theta and context length of its published config.json
_DELTANET = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                 partial_rotary_factor=0.25, shared_expert_intermediate_size=512)

SHAPES = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hybrid=False,
        arch=dict(model_type="qwen3_moe", rope_theta=1e6, max_position_embeddings=40960, intermediate_size=6144),
        source=f"{_T5} Qwen/Qwen3-30B-A3B-Base (Qwen3MoeConfig: d 2048, moe ff 768, 128 experts, top-8, 32/4 heads); "
               "48 layers and head_dim 128 from Qwen/Qwen3-30B-A3B's config.json"),
    "qwen3.6-35b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        arch=dict(model_type="qwen3_5_moe", rope_theta=1e7, max_position_embeddings=262144, mtp_num_hidden_layers=1,
                  **_DELTANET),
        source=f"{_T5} Qwen/Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig); transformers' qwen3_5_moe docs: Qwen3.6 "
               "checkpoints share the architecture and model_type of Qwen3.5; one MTP layer "
               "(mtp_num_hidden_layers in the published config.json)"),
    "qwen3-next-80b-a3b": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        arch=dict(model_type="qwen3_next", rope_theta=1e7, max_position_embeddings=262144, intermediate_size=5632,
                  mtp_num_hidden_layers=1, **_DELTANET),
        source=f"{_T5} Qwen/Qwen3-Next-80B-A3B-Instruct (Qwen3NextConfig); one MTP layer (mtp_num_hidden_layers in "
               "the published config.json)"),
    "minicpm-v-4.7": dict(
        hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, hybrid=True, shared_expert=512,
        arch=dict(model_type="qwen3_5_moe", rope_theta=1e7, max_position_embeddings=262144, **_DELTANET),
        source="MiniCPM-V 4.7 CookBook overview (openbmb/MiniCPM-V-4.7-35B-A3B: language backbone qwen3_5_moe_text, "
               "256 experts, 8 per token); the hidden and expert sizes are those of that backbone's Qwen3.5-35B-A3B "
               f"({_T5} Qwen/Qwen3.5-35B-A3B), consistent with LES's 1.29 MB experts at 3 bits"),
}


def card(shape: str, layers: int, experts: int, gguf: str | None = None) -> dict:
    """The random-weights card; gguf: the GGUF type mix (--type) when the checkpoint is a GGUF of the real
    architecture."""
    s = SHAPES[shape]
    notes = ([f"random quantized blocks ({gguf}: random quants, scales set for mean 0, std 0.02): text means "
              f"nothing; routing is laid out, not learned (the token, its last few tokens through one attention "
              f"head, a per-layer part the next layer cannot see, a per-expert skew), to have a real Qwen3-30B-A3B "
              f"trace's reuse, LRU hits, hot and distinct experts and lookahead recall (results/routing_realism.md)"]
             if gguf else
             ["random weights (seeded normal, std 0.02): text means nothing; routing is laid out as in make-model's "
              "GGUFs (workbench/made_routing.py), fitted there on the real architecture; or drive runs with a "
              "routing trace"])
    notes += [f"{layers} of {s['num_hidden_layers']} layers"]
    if experts != s["num_experts"]:
        notes.append(f"{experts} of {s['num_experts']} experts per layer")
    if gguf:
        notes.append(f"the real architecture, llama.cpp's {ARCH[s['arch']['model_type']]}"
                     + (f": Gated DeltaNet layers, full attention every {s['arch']['full_attention_interval']}th, a "
                        f"{s['shared_expert']}-wide gated shared expert" if s["hybrid"] else "")
                     + (f"; {mtp} multi-token-prediction (MTP, llama.cpp's nextn) block after the {layers} layers"
                        if (mtp := s["arch"].get("mtp_num_hidden_layers")) else ""))
    else:
        if s["hybrid"]:
            notes.append("the real model's Gated DeltaNet / gated attention layers are not supported yet (issue 15): "
                         "every layer here is Qwen3-MoE full attention with the real head counts; the real expert "
                         "shape only")
        if s.get("shared_expert"):
            notes.append(f"no shared expert (the real model has a {s['shared_expert']}-wide one, always resident: "
                         f"compute, not reads)")
    notes.append("vocabulary: the demo model's 4096-token tokenizer (embeddings are resident, never streamed)")
    what = f"{ARCH[s['arch']['model_type']]} GGUF ({gguf})" if gguf else "expert shape"
    return {"random_weights": True, "shape": shape, "layers": layers, "experts": experts,
            "top_k": s["num_experts_per_tok"], "hidden_size": s["hidden_size"],
            "moe_intermediate_size": s["moe_intermediate_size"], "source": s["source"], "notes": notes,
            "label": f"{shape} {what}, RANDOM weights ({layers} layers, {experts} experts)"}


def random_card(src) -> dict | None:
    """The random-weights card of a checkpoint made here (a directory or a GGUF), or None."""
    p = Path(src)
    if p.suffix == ".gguf" and p.is_file():
        from workbench.models.gguf_model import _gguf, _value
        try:
            field = _gguf().GGUFReader(str(p), "r").get_field(RANDOM_KEY)
        except Exception:            # not a readable GGUF: whoever opens it says why
            return None
        return json.loads(_value(field)) if field is not None else None
    p = p / "random_weights.json"
    return json.loads(p.read_text()) if p.is_file() else None


def random_label(src) -> str | None:
    """The random-weights label of a checkpoint made here, or None."""
    c = random_card(src)
    return c["label"] if c else None


ARCH = {"qwen3_moe": "qwen3moe", "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe"}    # llama.cpp's names


def hf_config(shape: str, layers: int | None = None, experts: int | None = None) -> dict:
    """The real model's language config (transformers' field names) at `layers` and `experts`, with the demo's
    vocabulary: what a GGUF of the shape is written from (workbench.spec.from_hf_config reads it)."""
    s, demo = SHAPES[shape], json.loads((DEMO / "config.json").read_text())
    return {**{k: s[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts_per_tok", "num_attention_heads",
                                  "num_key_value_heads", "head_dim")},
            **s["arch"], "num_hidden_layers": layers or s["num_hidden_layers"],
            "num_experts": experts or s["num_experts"], "vocab_size": demo["vocab_size"],
            "bos_token_id": demo["bos_token_id"], "eos_token_id": demo["eos_token_id"],
            "rms_norm_eps": 1e-6, "norm_topk_prob": True, "tie_word_embeddings": False, "hidden_act": "silu"}


def check_request(shape: str, layers: int, experts: int | None) -> int:
    """Refuses an unknown shape or a layer / expert count it cannot have; the expert count."""
    if shape not in SHAPES:
        raise WorkbenchError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    experts = experts or s["num_experts"]
    if not 1 <= layers <= s["num_hidden_layers"]:
        raise WorkbenchError(f"--layers {layers}: {shape} has 1 to {s['num_hidden_layers']}")
    if not s["num_experts_per_tok"] <= experts <= s["num_experts"]:
        raise WorkbenchError(f"--experts {experts}: {shape} needs {s['num_experts_per_tok']} to {s['num_experts']}")
    return experts


def checkpoint_path(shape: str, layers: int, experts: int | None = None, gguf: str | None = None) -> Path:
    """Where make-model writes a checkpoint by default: one directory (or, given its --type, GGUF) per (shape,
    layers, experts) in the cache."""
    from workbench.registry import cache_dir
    name = f"{shape}-{layers}L-{experts or 'all'}E-random"
    return cache_dir() / "models" / (f"{name}-{gguf}.gguf" if gguf else name)


def checkpoint_bytes(shape: str, layers: int, experts: int | None = None) -> int:
    """The checkpoint's size on disk (float16 tensors; the JSON files and the tokenizer left out)."""
    s, V = SHAPES[shape], json.loads((DEMO / "config.json").read_text())["vocab_size"]
    d, ff, hd = s["hidden_size"], s["moe_intermediate_size"], s["head_dim"]
    attention = (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd * d
    per_layer = attention + (experts or s["num_experts"]) * (3 * d * ff + d) + 2 * d + 2 * hd
    return 2 * (2 * V * d + d + layers * per_layer)


def make_model(shape: str, layers: int, out, experts: int | None = None, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (one float16 safetensors shard per layer); refused when its disk lacks room."""
    experts = check_request(shape, layers, experts)
    s = SHAPES[shape]
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


# the GGUF name under which workbench.made_routing lays each tensor out, by its Hugging Face name's end
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate": "ffn_gate_inp", "down_proj": "ffn_down_exps"}


def _gguf_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    for hf, g in _GGUF_NAMES.items():
        if name.endswith(f".{hf}.weight"):
            return f"blk.{parts[2]}.{g}.weight"
    return None


def _write(tmp: Path, cfg: dict, rng):
    from safetensors.numpy import save_file
    from workbench.made_routing import Layout
    from workbench.spec import from_hf_config
    d, ff, h, kv, hd, V, layers, experts = (cfg[k] for k in (
        "hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "num_hidden_layers", "num_experts"))
    layout = Layout(from_hf_config(cfg))

    def laid(name: str, a: np.ndarray) -> np.ndarray:      # the routing laid out (workbench.made_routing), float16
        if g := _gguf_name(name):
            a = layout.floats(rng, g, 0, a.reshape(1, -1) if a.ndim == 1 else a).reshape(a.shape)
        return a.astype(np.float16)

    w = lambda name, *shape: laid(name, rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    one = lambda name, n: laid(name, np.ones(n, np.float32))
    weight_map = {}

    def save(fname, tensors):            # one shard at a time: a layer of a real shape is about a gigabyte
        save_file(tensors, str(tmp / fname))
        weight_map.update({k: fname for k in tensors})

    e, n, o = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
    save("model-embed.safetensors", {e: w(e, V, d), n: one(n, d), o: w(o, V, d)})
    for i in range(layers):
        p = f"model.layers.{i}."
        norms = {"input_layernorm": d, "post_attention_layernorm": d, "self_attn.q_norm": hd, "self_attn.k_norm": hd}
        t = {p + f"{k}.weight": one(p + f"{k}.weight", v) for k, v in norms.items()}
        for k, shape in (("self_attn.q_proj", (h * hd, d)), ("self_attn.k_proj", (kv * hd, d)),
                         ("self_attn.v_proj", (kv * hd, d)), ("self_attn.o_proj", (d, h * hd)),
                         ("mlp.gate", (experts, d))):
            t[p + f"{k}.weight"] = w(p + f"{k}.weight", *shape)
        for x in range(experts):
            for k, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
                t[f"{p}mlp.experts.{x}.{k}.weight"] = w(f"{p}mlp.experts.{x}.{k}.weight", *shape)
        save(f"model-layer{i:03d}.safetensors", t)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(DEMO / "tokenizer.json", tmp / "tokenizer.json")
