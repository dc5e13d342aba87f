"""The MoE decoder in torch, one module for both trainers (the `train` extra).

The demo model is trained as it: Hugging Face Qwen3-MoE names, so its state dict is the exported checkpoint
(training/demo.py). Edge0's trainers run a pack's model in its layers, frozen, one layer's weights at a time
(training/edge0_common.py: `Layer.forward` with the routed experts streamed), the routing and the adapters as
arguments; `from_pack` holds a whole pack in it, the reference the tests hold them to. It computes what the numpy engine
computes (engines/decoder.py) for these models: tests/test_training_model.py and tests/test_edge0.py check it.

    router(layer, xn, logits) -> (ids, weights)   in place of softmax top-k (Edge0's prerouter routing)
    delta(name, x) -> tensor or None              added to x W^T of projection `name` (an unmerged LoRA)
    cache {"pos", "kv"}                           incremental decoding: positions go on from cache["pos"]
    routed(x, ids, weights) -> tensor             the routed experts' sum, in place of the experts' modules
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_topk_prob: bool = True
    qk_norm: bool = True
    # the hybrid family (workbench/spec_hybrid.py): Gated DeltaNet layers, gated partial-RoPE attention, shared expert
    layer_types: list | None = None
    rotary_dim: int = 0
    attn_output_gate: bool = False
    linear: dict | None = None
    shared_expert_size: int = 0

    @classmethod
    def of_spec(cls, s) -> "MoEConfig":
        return cls(s.vocab_size, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.num_experts,
                   s.top_k, s.moe_intermediate_size, s.rms_norm_eps, s.rope_theta, s.norm_topk_prob,
                   s.qk_norm == "head", s.layer_types or None, s.rotary_dim, s.attn_output_gate, s.linear,
                   s.shared_expert_size)


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
    def __init__(self, c, layer: int):
        super().__init__()
        self.c, self.prefix = c, f"layers.{layer}."
        hd = c.head_dim
        self.gated = getattr(c, "attn_output_gate", False)     # q_proj also carries a sigmoid gate per output dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * hd * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False)
        if getattr(c, "qk_norm", True):
            self.q_norm = RMSNorm(hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def proj(self, name, x, delta):
        y = getattr(self, f"{name}_proj")(x)
        d = delta(self.prefix + name, x) if delta is not None else None
        return y if d is None else y + d

    def forward(self, x, cos, sin, delta=None, kv=None):
        B, T, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q = self.proj("q", x, delta).view(B, T, c.num_attention_heads, -1)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = self.proj("k", x, delta).view(B, T, c.num_key_value_heads, hd)
        v = self.proj("v", x, delta).view(B, T, c.num_key_value_heads, hd).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        r = cos.shape[-1]                       # partial RoPE: the rest of each head passes through
        q = torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], -1)
        k = torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], -1)
        if kv is not None:                      # incremental decoding: the cached keys and values come first
            if self.prefix in kv:
                k, v = torch.cat([kv[self.prefix][0], k], 2), torch.cat([kv[self.prefix][1], v], 2)
            kv[self.prefix] = (k, v)
        if T > 1 and k.shape[2] > T:
            raise ValueError("incremental decoding takes one token at a time")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1,
                                           enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        y = y.transpose(1, 2).reshape(B, T, -1)
        if self.gated:
            y = y * torch.sigmoid(gate.reshape(B, T, -1))
        return self.proj("o", y, delta)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (transformers' Qwen3.5 names), the recurrence token by token as engines/hybrid.py runs it.
    Its state (the convolution's last inputs, the delta-rule matrices) goes in the cache like keys and values."""

    def __init__(self, c, layer: int):
        super().__init__()
        L, d = c.linear, c.hidden_size
        self.prefix = f"layers.{layer}."
        self.hk, self.hv, self.dk, self.dv = L["num_key_heads"], L["num_value_heads"], L["key_head_dim"], L["value_head_dim"]
        self.tiled = L.get("value_heads") == "tiled"       # a qwen35moe GGUF's order (engines/hybrid.py)
        C = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj_qkv = nn.Linear(d, C, bias=False)
        self.in_proj_z = nn.Linear(d, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(d, self.hv, bias=False)
        self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, L["conv_kernel"], groups=C, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = RMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, d, bias=False)

    def forward(self, x, state=None):
        B, T, _ = x.shape
        K = self.conv1d.weight.shape[-1]
        qkv = self.in_proj_qkv(x)
        conv, S = state.get(self.prefix, (None, None)) if state is not None else (None, None)
        xs = torch.cat([qkv.new_zeros(B, K - 1, qkv.shape[-1]) if conv is None else conv, qkv], 1)
        w = self.conv1d.weight[:, 0]                                        # (C, K): depthwise, causal
        mixed = F.silu(sum(xs[:, j:j + T] * w[:, j] for j in range(K)))
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], -1)
        q = self.l2norm(q.view(B, T, hk, dk)) * dk ** -0.5
        k = self.l2norm(k.view(B, T, hk, dk))
        if self.tiled:
            q, k = q.repeat(1, 1, hv // hk, 1), k.repeat(1, 1, hv // hk, 1)
        else:
            q, k = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
        v = v.view(B, T, hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x))
        decay = torch.exp(-self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias))
        S = x.new_zeros(B, hv, dk, dv) if S is None else S
        out = []
        for t in range(T):
            S = S * decay[:, t, :, None, None]
            delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)) * beta[:, t, :, None]
            S = S + k[:, t, :, :, None] * delta[:, :, None, :]
            out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        if state is not None:
            state[self.prefix] = (xs[:, T:], S)
        y = self.norm(torch.stack(out, 1)) * F.silu(self.in_proj_z(x).view(B, T, hv, dv))
        return self.out_proj(y.reshape(B, T, -1))

    @staticmethod
    def l2norm(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class Expert(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.k, self.norm_topk_prob = c.num_experts_per_tok, getattr(c, "norm_topk_prob", True)
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts))
        if getattr(c, "shared_expert_size", 0):    # always on, scaled by its own sigmoid gate
            self.shared_expert = Expert(c.hidden_size, c.shared_expert_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def route(self, logits):
        """Softmax top-k (the weights renormalised over the k when the model says so): (ids, weights, probs)."""
        probs = logits.float().softmax(-1)
        w, idx = probs.topk(self.k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return idx, w, probs

    def forward(self, x, idx, w):
        """Each token through its k experts, weighted: x (..., d), idx and w (..., k)."""
        shape = x.shape
        x, flat, w = x.reshape(-1, shape[-1]), idx.reshape(-1), w.to(x.dtype).reshape(-1)
        out = torch.zeros_like(x)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.k
        start = 0
        for e, n in enumerate(counts):
            if n:
                r = rows[start:start + n]
                out = out.index_add(0, r, self.experts[e](x[r]) * w[order[start:start + n]].unsqueeze(-1))
            start += n
        return self.shared(x, out).reshape(shape)

    def shared(self, x, routed):
        """The routed experts' sum plus the shared expert where the model has one."""
        if hasattr(self, "shared_expert"):
            return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed


class Layer(nn.Module):
    def __init__(self, c, layer: int):
        super().__init__()
        self.index = layer
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if getattr(c, "layer_types", None) and c.layer_types[layer] == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, layer)
        else:
            self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c)

    def forward(self, x, cos, sin, router=None, delta=None, kv=None, collect=None, routed=None):
        """-> (x after the layer, its Switch load-balancing loss); routed(x, ids, weights) in place of the
        experts' modules (a frozen model's experts streamed from disk: training/edge0_common.py)."""
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(self.input_layernorm(x), kv)
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, delta, kv)
        xn = self.post_attention_layernorm(x)
        logits = self.mlp.gate(xn)
        idx, w, probs = self.mlp.route(logits)
        if router is not None:
            idx, w = router(self.index, xn, logits)
        if collect is not None:
            collect[self.index] = (xn.detach(), idx, logits.detach())
        x = x + (self.mlp(xn, idx, w) if routed is None else self.mlp.shared(xn, routed(xn, idx, w)))
        # Switch-style load balancing: fraction routed x mean probability, per expert
        E = logits.shape[-1]
        frac = torch.bincount(idx.reshape(-1), minlength=E).float() / idx.numel()
        return x, E * (frac * probs.reshape(-1, E).mean(0)).sum()


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MoEDecoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        rd = getattr(c, "rotary_dim", 0) or c.head_dim
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2, device="cpu").float() / rd))   # real on "meta" too
        self.register_buffer("inv_freq", inv, persistent=False)

    def route(self, layer: int, logits):
        """The model's own routing of `layer` for these router logits: (ids, weights)."""
        return self.model.layers[layer].mlp.route(logits)[:2]

    def rope(self, pos: int, T: int):
        """cos, sin of positions pos .. pos + T - 1, shaped to broadcast over (B, heads, T, rotary dims)."""
        f = torch.outer(torch.arange(pos, pos + T, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, ids, router=None, delta=None, cache: dict | None = None, collect: dict | None = None):
        """ids (B, T) -> (logits (B, T, V), the Switch load-balancing loss averaged over layers).
        collect: filled with {layer: (router input, executed ids, real router logits)}."""
        pos = cache.setdefault("pos", 0) if cache is not None else 0
        cos, sin = self.rope(pos, ids.shape[1])
        kv = cache.setdefault("kv", {}) if cache is not None else None
        x = self.model.embed_tokens(ids)
        aux = 0.0
        for layer in self.model.layers:
            x, a = layer(x, cos, sin, router, delta, kv, collect)
            aux = aux + a
        if cache is not None:
            cache["pos"] = pos + ids.shape[1]
        return self.lm_head(self.model.norm(x)), aux / len(self.model.layers)

    @classmethod
    def from_pack(cls, pack, weights: dict, experts: dict) -> "MoEDecoder":
        """A pack's model (weights, experts: workbench.edge0.artifacts.pack_weights), fp32 and frozen."""
        s = pack.spec
        m = cls(MoEConfig.of_spec(s))
        state = {state_name(k): torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items() if state_name(k)}
        for L, parts in experts.items():
            for part, a in parts.items():
                for e in range(s.num_experts):
                    state[f"model.layers.{L}.mlp.experts.{e}.{part}_proj.weight"] = torch.from_numpy(np.array(a[e], np.float32))
        m.load_state_dict(state)
        return m.requires_grad_(False).eval()


TOP = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
PER_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "router": "mlp.gate",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
             **{n: f"self_attn.{n}_proj" for n in "qkvo"},
             **{f"shared.{n}": f"mlp.shared_expert.{n}_proj" for n in ("gate", "up", "down")},
             **{f"lin_{n}": f"linear_attn.in_proj_{n}" for n in ("qkv", "z", "b", "a")},
             "shared_gate": "mlp.shared_expert_gate", "lin_conv": "linear_attn.conv1d", "lin_norm": "linear_attn.norm",
             "lin_out": "linear_attn.out_proj"}


def state_name(name: str) -> str | None:
    """A pack tensor's name in MoEDecoder's state dict; None for a tensor it has no place for (e.g. MTP's)."""
    if name in TOP:
        return TOP[name]
    head, _, rest = name.partition(".")
    i, _, rest = rest.partition(".")
    if head != "layers":
        return None
    if rest in ("lin_A_log", "lin_dt_bias"):
        return f"model.layers.{i}.linear_attn.{rest[4:]}"
    return f"model.layers.{i}.{PER_LAYER[rest]}.weight" if rest in PER_LAYER else None
