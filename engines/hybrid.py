"""Gated DeltaNet, the linear-attention layer of the hybrid family (Qwen3-Next, Qwen3.5-MoE, MiniCPM-V 4.7),
written against the decoder's array module like the rest of engines/decoder.py.

Each layer keeps two states instead of a KV cache: the last `conv_kernel - 1` inputs of its causal depthwise
convolution, and per value head a (key_dim, value_dim) matrix S updated by the gated delta rule

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

(q and k L2-normalised, q scaled by key_dim^-1/2; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)).
Prefill runs the same recurrence token by token (transformers' chunked form is the same sum regrouped; they
agree to float rounding), so prefill and decode share one code path.

Truncating a recurrent state cannot be done by forgetting positions: the state after each position is
checkpointed instead, and `truncate` restores the one it asks for. Kept: the state after every position of the
last decode call of up to `CHECKPOINT_WINDOW` tokens (speculative drafts roll back within these) and at its start,
of the last `checkpoint_window` positions (as many of the last CHECKPOINT_WINDOW as CHECKPOINT_BYTES of state
hold: a full-size model's states are large), and at the end of every multi-token call (a prefill: an evaluator
that reuses a prompt's cache cuts back to it). A truncate to any other position is refused.
"""
from __future__ import annotations

from workbench.errors import WorkbenchError
from workbench.spec_hybrid import CHECKPOINT_WINDOW, checkpoint_window


class GatedDeltaNet:
    """Mixed into the Decoder: the linear-attention layers and their per-position state checkpoints."""

    def reset_linear(self):
        s, xp = self.spec, self.xp
        self.lin, self.lin_ckpt, self.lin_keep = {}, {}, {0}
        if not s.layer_types:
            return
        L = s.linear
        channels = 2 * L["num_key_heads"] * L["key_head_dim"] + L["num_value_heads"] * L["value_head_dim"]
        self.checkpoint_window = checkpoint_window(s)
        for i in range(s.num_layers):
            if s.is_linear(i):
                self.lin[i] = (xp.zeros((L["conv_kernel"] - 1, channels), dtype=xp.float32),
                               xp.zeros((L["num_value_heads"], L["key_head_dim"], L["value_head_dim"]), dtype=xp.float32))
                self.lin_ckpt[i] = {0: self.lin[i]}

    def truncate(self, pos: int):
        if pos != self.pos and self.lin:
            if any(pos not in c for c in self.lin_ckpt.values()):
                raise WorkbenchError(f"cannot truncate the linear-attention state to position {pos}: checkpoints are "
                                     f"kept for the last call, the last {self.checkpoint_window} positions and each "
                                     f"prompt's end")
            for i, c in self.lin_ckpt.items():
                self.lin[i] = c[pos]
                for p in [p for p in c if p > pos]:
                    del c[p]
            self.lin_keep = {p for p in self.lin_keep if p <= pos}
        super().truncate(pos)

    def checkpoint(self, i: int, pos: int, state, last: bool, multi: bool):
        """pos: the position after this state; self.pos: where the call began."""
        c = self.lin_ckpt[i]
        c[pos] = state
        if last:
            if multi:
                self.lin_keep.add(pos)
            keep_from = min(self.pos, pos - self.checkpoint_window + 1)
            for p in [p for p in c if p < keep_from and p not in self.lin_keep]:
                del c[p]

    def l2norm(self, x):
        return x / self.xp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

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
            S = S * decay[t][:, None, None]
            delta = (v[t] - (k[t][:, None, :] @ S)[:, 0]) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            out.append((q[t][:, None, :] @ S)[:, 0])
            if (self.token_index > 0 and T <= CHECKPOINT_WINDOW) or T - t <= self.checkpoint_window:
                self.checkpoint(i, self.pos + t + 1, (xs[t + 1:t + K], S), last=t == T - 1, multi=T > 1)
        self.lin[i] = (xs[T:T + K - 1], S)
        y = self.rms_norm(xp.stack(out), W(p + "lin_norm")) * self.silu(self.linear(x, p + "lin_z").reshape(T, hv, dv))
        return self.linear(y.reshape(T, hv * dv), p + "lin_out")
