"""Made checkpoints that route like real models: where the routing lies in a random-weight checkpoint's tensors.

Both of make-model's writers lay it out (engines/gguf_random.py for a GGUF, workbench/shapes.py for a Hugging Face
directory), in the tensors named as in a GGUF; experiments/routing_stats.py measures what it gives.
"""
from __future__ import annotations

import numpy as np

from workbench.errors import WorkbenchError

# Routing, made to have a real model's statistics (results/routing_realism.md: next-token reuse, per-layer LRU hits,
# hot experts, distinct experts, lookahead recall, against a real Qwen3-30B-A3B trace). Random weights route almost
# the same experts for every token (qwen3moe) or a new random set at every position (the DeltaNet shapes); real
# routing follows the token, its recent context and a per-layer skew. So a few dims of the residual are laid out
# (Layout) and each router reads only those, as the sum of four logits of known std:
#   token    the token's identity: the embedding's first TOKEN_DIMS dims (std 1)                       weight 1
#   context  the last few tokens' identities: the first full-attention layer's head 0 attends with a query and key
#            that are a constant in the rotary pairs of frequency BAND (so its score is a function of the
#            distance alone, high within a few tokens: RoPE as a window), reads the token dims as its values and
#            writes their window average into CONTEXT_DIMS; what makes the next token reuse experts     weight CONTEXT
#   private  PRIVATE_DIMS written by the previous layer's experts (a fresh random function of the token at each
#            layer), read by this layer's router alone: what the next layer's router cannot see from this layer's
#            input, so les's lookahead misses it                                                        weight PRIVATE
#   skew     a per-expert bias on the constant dim: hot and cold experts                               weight SKEW
# The other layers write into these dims only at OUTPUT_GAIN. CONTEXT, PRIVATE and SKEW depend on the experts per
# layer (512 experts need more context and less skew than 128 for the same statistics: _mix); they were fitted on
# few-layer slices of the 30B and 80B shapes with experiments/routing_stats.py, as results/routing_realism.md records.
# The std of the context and private dims in the residual (CONTEXT_STD, PRIVATE_STD, measured on those slices) sets
# the router weights that give each part its std.
TOKEN_DIMS, CONTEXT_DIMS, PRIVATE_DIMS = 32, 32, 16          # the context is the token dims averaged: as many
OUTPUT_GAIN, PRIVATE_GAIN = 0.02, 6.0
BAND, BAND_GAIN = (0.02, 0.12), 1.4       # rotary frequencies (radians per token) of the window; its q/k norm gain
MIX = {128: (0.8, 0.6, 1.5), 512: (4.0, 1.0, 1.3)}        # experts: (CONTEXT, PRIVATE, SKEW), interpolated in log2
CONTEXT_STD, PRIVATE_STD = {"qwen3_moe": 2.78, "qwen3_next": 0.30, "qwen3_5_moe": 0.30}, 1.0     # by family
_OUTPUTS = ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def _mix(experts: int) -> tuple[float, float, float]:
    """(CONTEXT, PRIVATE, SKEW) at this many experts per layer: MIX's, linear in log2(experts), held at its ends."""
    (e0, m0), (e1, m1) = sorted(MIX.items())
    f = min(1.0, max(0.0, np.log2(experts / e0) / np.log2(e1 / e0)))
    return tuple(a + f * (b - a) for a, b in zip(m0, m1))


class Layout:
    """Where the routing's dims lie in the residual and which layer writes the context (Routing, above)."""

    def __init__(self, spec):
        """spec: every block that has a router, the MTP blocks included (they count as layers)."""
        self.spec, layers = spec, spec.num_layers
        self.one = TOKEN_DIMS                             # the constant 1 (the skew's dim)
        self.context = TOKEN_DIMS + 1                     # .. + CONTEXT_DIMS
        self.private0 = self.context + CONTEXT_DIMS       # layer l's: private0 + l * PRIVATE_DIMS ..
        self.end = self.private0 + layers * PRIVATE_DIMS  # layers: the main ones and the MTP blocks
        if self.end > spec.hidden_size:
            raise WorkbenchError(f"{layers} layers need {self.end} routing dims, the hidden size is {spec.hidden_size}")
        full = [i for i in range(spec.num_layers) if not spec.is_linear(i)]
        self.writer = full[0] if full else None           # the layer whose attention writes the context
        n_rot = spec.rope_dim
        theta = spec.rope_theta ** (-2 * np.arange(n_rot // 2) / n_rot)
        band = np.flatnonzero((theta >= BAND[0]) & (theta <= BAND[1]))
        self.band = np.concatenate([band, band + n_rot // 2])           # both dims of each (NEOX) rotary pair
        self.gated = bool(spec.attn_output_gate)
        self.context_mix, self.private_mix, self.skew = _mix(spec.num_experts)

    def private(self, layer: int) -> slice:
        a = self.private0 + layer * PRIVATE_DIMS
        return slice(a, a + PRIVATE_DIMS)

    def gains(self, gname: str, rows: np.ndarray) -> np.ndarray:
        """The gain of each of these rows (residual dims) of an output projection: OUTPUT_GAIN on the routing's dims,
        PRIVATE_GAIN where the experts' down projection writes the next layer's private dims, else 1."""
        d = rows % self.spec.hidden_size
        out = np.where(d < self.end, OUTPUT_GAIN, 1.0).astype(np.float32)
        if gname.endswith("ffn_down_exps.weight"):
            p = self.private(int(gname.split(".")[1]) + 1)
            out[(d >= p.start) & (d < p.stop)] = PRIVATE_GAIN
        return out

    def floats(self, rng, gname: str, r: int, a: np.ndarray) -> np.ndarray:
        """Lays the routing into rows r.. of the float tensor `gname` (GGUF names; a: random, or ones for a norm),
        in place."""
        layer = int(gname.split(".")[1]) if gname.startswith("blk.") else None
        base = gname.rsplit(".", 1)[0]
        rows = np.arange(r, r + len(a))
        if gname.endswith(_OUTPUTS):
            a *= self.gains(gname, rows)[:, None]
        if base == "token_embd":
            a[:, :TOKEN_DIMS] = rng.standard_normal((len(a), TOKEN_DIMS), np.float32)
            a[:, self.one] = 1.0
            a[:, self.private(0)] = rng.standard_normal((len(a), PRIVATE_DIMS), np.float32) * PRIVATE_STD
        elif base.endswith("ffn_gate_inp"):
            n = len(a)
            a[:, :self.end] = 0
            a[:, :TOKEN_DIMS] = rng.standard_normal((n, TOKEN_DIMS), np.float32) / np.sqrt(TOKEN_DIMS)
            a[:, self.one] = rng.standard_normal(n, np.float32) * self.skew
            if self.writer is not None and layer >= self.writer:
                a[:, self.context:self.private0] = rng.standard_normal((n, CONTEXT_DIMS), np.float32) * (
                    self.context_mix / np.sqrt(CONTEXT_DIMS) / CONTEXT_STD[self.spec.family])
            a[:, self.private(layer)] = rng.standard_normal((n, PRIVATE_DIMS), np.float32) * (
                self.private_mix / np.sqrt(PRIVATE_DIMS) / PRIVATE_STD)
            a[:, self.end:] = 0
        elif layer == self.writer and base.endswith(("attn_q", "attn_k", "attn_v")):
            hd = self.spec.head_dim
            head = rows < hd * (2 if base.endswith("attn_q") and self.gated else 1)    # head 0 (and its gate)
            a[head] = 0
            if base.endswith("attn_v"):             # values: the token dims
                for i in np.flatnonzero(head & (rows < CONTEXT_DIMS)):
                    a[i, rows[i]] = 1.0
            else:                                   # query and key: a constant in the window's rotary pairs
                for i in np.flatnonzero(np.isin(rows, self.band)):
                    a[i, self.one] = 1.0
        elif layer == self.writer and base.endswith("attn_output"):
            a[:, :self.spec.head_dim] = 0           # head 0 writes the context dims alone
            for i in np.flatnonzero((rows >= self.context) & (rows < self.private0)):
                a[i, rows[i] - self.context] = 1.0
        elif layer == self.writer and base.endswith(("attn_q_norm", "attn_k_norm")):
            a[:, self.band] = BAND_GAIN
        return a

    def float_type(self, gname: str) -> bool:
        """Whether a GGUF holds `gname` in F16 (or F32) whatever its --type: the tensors the routing lays out."""
        return gname == "token_embd.weight" or (self.writer is not None and gname in {
            f"blk.{self.writer}.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output")})
