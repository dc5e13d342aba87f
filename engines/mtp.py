"""A multi-token-prediction block (Qwen3-Next's MTP, DeepSeek-V3's in the same form) in numpy: the draft a
checkpoint carries for itself.

Row t takes the model's last hidden state at t (before its final norm) and the embedding of token t+1, each
RMS-normed, concatenated and projected (`fc`), then one decoder layer (attention with its own KV cache, at token
t+1's position; MoE with its experts in memory) and a final norm into the model's own head: logits for token t+2.
Chained, the block's output state stands in for the model's hidden state at the next row. Weights by the
checkpoint's names after `mtp.` (transformers' and vLLM's): fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm,
layers.0.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.gate,
mlp.experts.E.{gate,up,down}_proj, mlp.shared_expert.*, mlp.shared_expert_gate}.
"""
from __future__ import annotations

import numpy as np

from engines.decoder import Decoder, rope_table
from workbench.routing import route


class MTPHead:
    # the decoder's blocks, the same numpy code (engines/decoder.py): norms, rotary, the causal softmax, an MLP
    xp = np
    rms_norm, silu, rope, mlp = Decoder.rms_norm, Decoder.silu, Decoder.rope, Decoder.mlp
    causal_softmax, from_numpy = Decoder.causal_softmax, Decoder.from_numpy

    def __init__(self, spec, w: dict[str, np.ndarray], embed, head):
        """w: the block's tensors (workbench.models.mtp.load_mtp); embed(ids) and head(x): the model's own, numpy in
        and out (the engine's: its kernels where it keeps the head encoded)."""
        self.spec, self.w, self.embed, self.head = spec, w, embed, head
        L = "layers.0."
        self.experts = [tuple(w[f"{L}mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                        for e in range(spec.num_experts)]
        self.cos, self.sin = rope_table(spec.max_position_embeddings, spec)
        self.reset()

    def reset(self):
        self.K = self.V = np.zeros((self.spec.num_kv_heads, 0, self.spec.head_dim), np.float32)
        self.start = 0

    def truncate(self, end: int):
        """Forget the cached rows at positions >= end."""
        if self.K.shape[1]:
            keep = max(0, end - self.start)
            self.K, self.V = self.K[:, :keep], self.V[:, :keep]

    def norm(self, x, name):
        return self.rms_norm(x, self.w[name])

    def forward(self, hidden: np.ndarray, ids, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of (hidden at position p-1, token at p) for p = start .. start+T-1, after the cached ones (whose
        positions end at start): (the block's states (T, d), logits (T, vocab))."""
        w, L = self.w, "layers.0."
        if not self.K.shape[1]:
            self.start = start
        e = self.embed(np.asarray(ids, np.int64)).astype(np.float32)
        x = np.concatenate([self.norm(e, "pre_fc_norm_embedding.weight"),
                            self.norm(hidden.astype(np.float32), "pre_fc_norm_hidden.weight")], -1) @ w["fc.weight"].T
        x = x + self.attention(self.norm(x, L + "input_layernorm.weight"), start)
        x = x + self.moe(self.norm(x, L + "post_attention_layernorm.weight"))
        return x, self.head(self.norm(x, "norm.weight"))

    def attention(self, x, start: int):
        s, w, p = self.spec, self.w, "layers.0.self_attn."
        T = x.shape[0]
        q = x @ w[p + "q_proj.weight"].T
        if s.attn_output_gate:
            q, gate = (a.reshape(T, -1) for a in np.split(q.reshape(T, s.num_heads, 2 * s.head_dim), 2, axis=-1))
        q = q.reshape(T, s.num_heads, s.head_dim).transpose(1, 0, 2)
        k = (x @ w[p + "k_proj.weight"].T).reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        v = (x @ w[p + "v_proj.weight"].T).reshape(T, s.num_kv_heads, s.head_dim).transpose(1, 0, 2)
        if p + "q_norm.weight" in w:
            q, k = self.norm(q, p + "q_norm.weight"), self.norm(k, p + "k_norm.weight")
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        self.K, self.V = np.concatenate([self.K, k], 1), np.concatenate([self.V, v], 1)
        S, rep = self.K.shape[1], s.num_heads // s.num_kv_heads
        att = (q.reshape(s.num_kv_heads, rep * T, s.head_dim) @ self.K.transpose(0, 2, 1)).reshape(
            s.num_kv_heads, rep, T, S) / np.float32(np.sqrt(s.head_dim))
        att = self.causal_softmax(att, T)
        y = (att.reshape(s.num_kv_heads, rep * T, S) @ self.V).reshape(s.num_heads, T, s.head_dim)
        y = y.transpose(1, 0, 2).reshape(T, -1)
        if s.attn_output_gate:
            y = y / (1.0 + np.exp(-gate))
        return y @ w[p + "o_proj.weight"].T

    def moe(self, x):
        w, p = self.w, "layers.0.mlp."
        idx, weights = route(self.spec, x @ w[p + "gate.weight"].T, None)
        out = np.zeros_like(x)
        for r in range(x.shape[0]):
            for e, g in zip(idx[r], weights[r]):
                out[r] += g * self.mlp(x[r], *self.experts[e])
        if p + "shared_expert.gate_proj.weight" in w:
            y = self.mlp(x, *(w[f"{p}shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")))
            out = out + y / (1.0 + np.exp(-(x @ w[p + "shared_expert_gate.weight"].T)))
        return out

