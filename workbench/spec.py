"""MoESpec: everything the engine needs to know about a decoder-only MoE model.

One spec covers the supported families; `from_hf_config` reads a Hugging Face
config.json and refuses, with a clear message, what it cannot run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from workbench.errors import WorkbenchError
from workbench.spec_hybrid import HYBRID, hybrid_spec, language_config, linear_attention_names


@dataclass
class MoESpec:
    family: str                      # qwen3_moe | qwen2_moe | olmoe | mixtral | dots1 | deepseek_v2 | deepseek_v3
                                     # | qwen3_next | qwen3_5_moe | minicpmv4_7 (the hybrid family: spec_hybrid.py)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    router: str = "softmax_topk"     # softmax_topk | sigmoid_group (the gating function: softmax | sigmoid)
    norm_topk_prob: bool = True
    n_group: int = 1                 # experts split into groups; the best topk_group groups survive,
    topk_group: int = 1              # ranked by group_rank: their top-2 sum (DeepSeek-V3) or max (DeepSeek-V2)
    group_rank: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    qk_norm: str = "none"            # none | head (Qwen3: RMSNorm per head) | full (OLMoE: over all heads)
    attention_bias: bool = False
    clip_qkv: float | None = None
    shared_expert_size: int = 0      # intermediate size of the always-on shared expert(s), 0 = none
    shared_expert_gate: bool = False # Qwen2-MoE scales the shared expert by sigmoid(gate(x))
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP instead of experts
    dense_intermediate_size: int = 0
    attention: str = "gqa"           # gqa | mla (DeepSeek's multi-head latent attention; head_dim = nope + rope)
    q_lora_rank: int = 0             # mla: rank of the query's down-projection, 0 = one plain q projection
    kv_lora_rank: int = 0            # mla: the latent that is cached instead of keys and values
    qk_rope_head_dim: int = 0        # mla: the part of each query/key head that carries (interleaved) RoPE
    v_head_dim: int = 0
    rope_theta: float = 10000.0
    rotary_dim: int = 0              # partial RoPE: the leading dims of each head that rotate (0 = the whole head)
    attn_output_gate: bool = False   # the q projection carries a per-dim sigmoid gate for the attention output
    layer_types: list[str] = field(default_factory=list)   # per layer "linear_attention" | "full_attention"
    linear: dict | None = None       # Gated DeltaNet sizes: num_key_heads, num_value_heads, key_head_dim,
                                     # value_head_dim, conv_kernel (spec_hybrid.py)
    rope_yarn: dict | None = None    # YaRN: factor, original_max_position_embeddings, beta_fast, beta_slow, truncate,
                                     # attention_factor (scales cos/sin), mscale_all_dim (latent attention's softmax)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.dense_layers]

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else (self.rotary_dim or self.head_dim)

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def attention_names(self, layer: int) -> list[str]:
        """The canonical tensors every attention block of this model has."""
        p = f"layers.{layer}."
        if self.is_linear(layer):
            return [p + n for n in linear_attention_names(self.family)]
        if self.attn_output_gate:
            return [p + n for n in ("q", "k", "v", "o", "q_norm", "k_norm")]
        if self.attention == "gqa":
            return [p + n for n in ("q", "k", "v", "o")]
        q = ["q"] if not self.q_lora_rank else ["q_a", "q_a_norm", "q_b"]
        return [p + n for n in q + ["kv_a", "kv_a_norm", "kv_b", "o"]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoESpec":
        return cls(**d)


SUPPORTED = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "dots1", "deepseek_v2", "deepseek_v3") + HYBRID


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(cfg: dict) -> dict:
    """rope_theta, and YaRN's parameters as transformers reads them (rope_parameters or the older rope_scaling)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind in ("default", None):
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (default, yarn)")
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or cfg["max_position_embeddings"] / orig
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    att = rp.get("attention_factor")
    if att is None:
        att = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else yarn_mscale(factor)
    return dict(rope_theta=theta, rope_yarn=dict(
        factor=float(factor), original_max_position_embeddings=int(orig), beta_fast=float(rp.get("beta_fast") or 32),
        beta_slow=float(rp.get("beta_slow") or 1), truncate=bool(rp.get("truncate", True)),
        attention_factor=float(att), mscale_all_dim=float(mscale_all or 0.0)))


def _first(x):
    return x[0] if isinstance(x, list) else x


def _n_experts(cfg: dict) -> int:
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not n:
        raise KeyError("num_experts")
    return n


def from_hf_config(cfg: dict, where: str = "config.json") -> MoESpec:
    family = cfg.get("model_type")
    if family not in SUPPORTED:
        raise WorkbenchError(f"{where}: model_type {family!r} is not a supported MoE family ({', '.join(SUPPORTED)})")
    try:
        cfg = language_config(cfg) if family in HYBRID else cfg
        heads = cfg["num_attention_heads"]
        common = dict(
            family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            **_rope(cfg), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")),
        )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        if family == "qwen3_moe":
            step = cfg.get("decoder_sparse_step", 1)
            dense = [i for i in range(common["num_layers"])
                     if i in cfg.get("mlp_only_layers", []) or (i + 1) % step != 0]
            return MoESpec(**common, num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", True),
                           qk_norm="head", attention_bias=bool(cfg.get("attention_bias", False)),
                           dense_layers=dense, dense_intermediate_size=cfg.get("intermediate_size", 0))
        if family == "qwen2_moe":
            step = cfg.get("decoder_sparse_step", 1)
            dense = [i for i in range(common["num_layers"])
                     if i in cfg.get("mlp_only_layers", []) or (i + 1) % step != 0]
            return MoESpec(**common, num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", False),
                           attention_bias=bool(cfg.get("qkv_bias", True)),
                           shared_expert_size=cfg.get("shared_expert_intermediate_size", 0), shared_expert_gate=True,
                           dense_layers=dense, dense_intermediate_size=cfg.get("intermediate_size", 0))
        if family == "olmoe":
            return MoESpec(**common, num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=cfg.get("norm_topk_prob", False),
                           qk_norm="full", attention_bias=bool(cfg.get("attention_bias", False)), clip_qkv=cfg.get("clip_qkv"))
        if family == "mixtral":
            return MoESpec(**common, num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
                           moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
        if family in ("deepseek_v2", "deepseek_v3"):
            return _deepseek(cfg, common)
        if family in HYBRID:
            return hybrid_spec(cfg, common, MoESpec)
        # dots1: Qwen3 attention with the DeepSeek-V3 sigmoid-group router and shared experts.
        if cfg.get("use_sliding_window") or any(t != "full_attention" for t in (cfg.get("layer_types") or [])):
            raise ValueError("sliding-window attention layers are not supported")
        return MoESpec(**common, num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["moe_intermediate_size"], router="sigmoid_group",
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), n_group=cfg.get("n_group") or 1,
                       topk_group=cfg.get("topk_group") or 1, routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                       qk_norm="head", attention_bias=bool(cfg.get("attention_bias", False)),
                       shared_expert_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
                       dense_layers=list(range(cfg.get("first_k_dense_replace") or 0)),
                       dense_intermediate_size=cfg.get("intermediate_size", 0))
    except KeyError as e:
        raise WorkbenchError(f"{where}: missing field {e.args[0]!r} for model_type {family!r}") from None
    except (ValueError, TypeError, AttributeError, IndexError, ZeroDivisionError) as e:   # a field of the wrong type or value
        raise WorkbenchError(f"{where}: {e}") from None


def _deepseek(cfg: dict, common: dict) -> MoESpec:
    """DeepSeek-V2/V3: latent attention, shared experts, leading dense layers; V2 routes by softmax (optionally
    within the best groups by their max), V3 by sigmoid with a selection bias within the best groups by top-2 sum."""
    if cfg.get("attention_bias"):
        raise ValueError("latent attention with biases is not supported")
    if not cfg.get("rope_interleave", True):
        raise ValueError("latent attention with rope_interleave false is not supported")
    mla = dict(attention="mla", q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
               qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
               head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], num_kv_heads=common["num_heads"])
    moe = dict(num_experts=_n_experts(cfg), top_k=cfg["num_experts_per_tok"],
               moe_intermediate_size=cfg["moe_intermediate_size"],
               routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
               shared_expert_size=(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
               dense_layers=list(range(cfg.get("first_k_dense_replace") or 0)),
               dense_intermediate_size=cfg.get("intermediate_size", 0))
    if cfg["model_type"] == "deepseek_v3":
        return MoESpec(**{**common, **mla}, **moe, router="sigmoid_group", norm_topk_prob=bool(cfg.get("norm_topk_prob")),
                       n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1)
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    # transformers' DeepseekV2TopkRouter does not renormalise the top-k weights, whatever norm_topk_prob says
    return MoESpec(**{**common, **mla}, **moe, router="softmax_topk", norm_topk_prob=False,
                   group_rank="max" if grouped else "top2_sum",
                   n_group=(cfg.get("n_group") or 1) if grouped else 1, topk_group=(cfg.get("topk_group") or 1) if grouped else 1)
