"""Gated DeltaNet, the linear-attention layer of the hybrid family (Qwen3-Next, Qwen3.5-MoE, MiniCPM-V 4.7),
written against the decoder's array module like the rest of engines/decoder.py.

Each layer keeps two states instead of a KV cache: the last `conv_kernel - 1` inputs of its causal depthwise
convolution, and per value head a (key_dim, value_dim) matrix S updated by the gated delta rule

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

(q and k L2-normalised, q scaled by key_dim^-1/2; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)).
Prefill runs the same recurrence token by token (transformers' chunked form is the same sum regrouped; they
agree to float rounding), so prefill and decode share one code path.

Truncating a recurrent state cannot be done by forgetting positions: the states a caller can return to are
checkpointed instead, and `truncate` restores the one it asks for. Kept: the state after each position of the last
decode call of up to `CHECKPOINT_WINDOW` tokens (a speculative batch rolls back within it) and at its start, at
the end of every prefill (an evaluator that reuses a prompt's cache cuts back to it), and position 0 (a fresh
state). A truncate to any other position is refused. A full-size model's state is tens of MiB a position, so
nothing else is kept.
"""
from __future__ import annotations

from workbench.errors import WorkbenchError
from workbench.spec_hybrid import CHECKPOINT_WINDOW


class GatedDeltaNet:
    """Mixed into the Decoder: the linear-attention layers and their per-position state checkpoints."""

    def reset_linear(self):
        s, xp = self.spec, self.xp
        self.lin, self.lin_ckpt, self.lin_keep = {}, {}, set()
        if not s.layer_types:
            return
        L = s.linear
        channels = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
        for i in range(s.num_layers):
            if s.is_linear(i):
                self.lin[i] = (xp.zeros((L["conv_kernel"] - 1, channels), dtype=xp.float32),
                               xp.zeros((L["num_value_heads"], L["key_head_dim"], L["value_head_dim"]), dtype=xp.float32))
                self.lin_ckpt[i] = {}

    def truncate(self, pos: int):
        if pos == 0 and self.lin:
            self.reset_linear()
        elif pos != self.pos and self.lin:
            if any(pos not in c for c in self.lin_ckpt.values()):
                raise WorkbenchError(f"cannot truncate the linear-attention state to position {pos}: checkpoints are "
                                     f"kept for the last call, its start, each prompt's end and position 0")
            for i, c in self.lin_ckpt.items():
                self.lin[i] = c[pos]
                for p in [p for p in c if p > pos]:
                    del c[p]
            self.lin_keep = {p for p in self.lin_keep if p <= pos}
        super().truncate(pos)

    def checkpoint(self, i: int, pos: int, state, last: bool):
        """pos: the position after this state; self.pos: where the call began."""
        c = self.lin_ckpt[i]
        c[pos] = state
        if last:
            if self.token_index == 0:
                self.lin_keep.add(pos)
            for p in [p for p in c if p < self.pos and p not in self.lin_keep]:
                del c[p]

    def l2norm(self, x):
        return x / self.xp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    def delta_rule(self, S, q, k, v, beta, decay):
        """One token's step on the state S (heads, key dim, value dim): (the new state, the heads' outputs)."""
        S = S * decay[:, None, None]
        delta = (v - (k[:, None, :] @ S)[:, 0]) * beta[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        return S, (q[:, None, :] @ S)[:, 0]

    def gated_delta_net(self, i: int, x):
        s, xp, W, p = self.spec, self.xp, self.W, f"layers.{i}."
        L, T = s.linear, x.shape[0]
        hk, hv, dk, dv = L["num_key_heads"], L["num_value_heads"], L["key_head_dim"], L["value_head_dim"]
        conv, S = self.lin[i]
        xs = xp.concatenate([conv, self.linear(x, p + "lin_qkv")], axis=0)          # (K-1+T, channels)
        kern = W(p + "lin_conv").reshape(xs.shape[1], -1)                    # (channels, K): depthwise, causal
        K = kern.shape[1]
        mixed = self.silu(sum(xs[j:j + T] * kern[:, j] for j in range(K)))
        q = self.l2norm(mixed[:, :hk * dk].reshape(T, hk, dk)) * self.scalar(dk ** -0.5)
        k = self.l2norm(mixed[:, hk * dk:2 * hk * dk].reshape(T, hk, dk))
        v = mixed[:, 2 * hk * dk:].reshape(T, hv, dv)
        if L.get("value_heads") == "tiled":          # value head j reads key head j % hk (llama.cpp's qwen35moe)
            q, k = xp.tile(q, (1, hv // hk, 1)), xp.tile(k, (1, hv // hk, 1))
        else:                                        # grouped: j reads j // (hv / hk), as Hugging Face's
            q, k = xp.repeat(q, hv // hk, axis=1), xp.repeat(k, hv // hk, axis=1)
        beta = 1.0 / (1.0 + xp.exp(-self.linear(x, p + "lin_b")))
        decay = xp.exp(-xp.exp(W(p + "lin_A_log")) * xp.logaddexp(self.scalar(0.0), self.linear(x, p + "lin_a") + W(p + "lin_dt_bias")))
        out = []
        for t in range(T):
            S, o = self.delta_rule(S, q[t], k[t], v[t], beta[t], decay[t])
            out.append(o)
            if (self.token_index > 0 and T <= CHECKPOINT_WINDOW) or t == T - 1:
                state = (xp.array(xs[t + 1:t + K]), S)          # a copy: a view would hold all of the call's xs
                self.checkpoint(i, self.pos + t + 1, state, last=t == T - 1)
        self.lin[i] = state
        y = self.rms_norm(xp.stack(out), W(p + "lin_norm")) * self.silu(self.linear(x, p + "lin_z").reshape(T, hv, dv))
        return self.linear(y.reshape(T, hv * dv), p + "lin_out")
