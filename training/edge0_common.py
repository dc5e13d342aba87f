"""Torch pieces shared by the Edge0 trainers (the `train` extra): heads, adapters, and the model (training/model.py).

TorchMoE runs a pack's own dequantized weights (the teacher: the bf16 pack; the student: the int4 pack; a GGUF is
both) in the shared torch decoder (the numpy engine's math) in fp32, over whole sequences at once, its weights
held in memory where the model fits and streamed from disk layer by layer where it does not:
  exact routing                           the real router at every layer
  prerouter routing (heads, skip_layers)  a streamed layer L+1 at position t takes routing from the head of
                                          owner L on position t-1's features (position 0 routes exactly, as
                                          a one-token prefill does in the engine), through the same
                                          softmax-top-k; the one-hots are of the routing executed
  LoRA deltas                             y = x W^T + (x A^T) B^T * scale on attention q, k, v, o
so a sequence run here in parallel gives what the numpy engine gives decoding it token by token.
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils.checkpoint import checkpoint

from engines.ggml_kernels import dequantize
from training.model import MoEConfig, MoEDecoder, state_name
from workbench.edge0.artifacts import model_identity
from workbench.host import available_memory_bytes, cores
from workbench.spec_hybrid import split_fused_projections
from workbench.errors import WorkbenchError
from workbench.registry import GGUF_STORAGE, resolve_pack
from workbench.store.pack import PARTS, SHARD_BITS, SHARD_MASK, Pack

PROJ = ("q", "k", "v", "o")


def open_pack(model: str, precision: str) -> Pack:
    """precision: "bf16" (the teacher's pack) or "q4" (the student's: int4 experts and rest). A GGUF is both,
    in its own blocks (its index): converting it again would be another model, and a second copy of the file."""
    if str(model).endswith(".gguf"):
        return Pack(resolve_pack(model, *GGUF_STORAGE, progress=False))
    return Pack(resolve_pack(model, "contiguous", precision, precision, progress=False))


def command_line() -> str:
    return " ".join(["python -m " + sys.modules["__main__"].__spec__.name if getattr(
        sys.modules["__main__"], "__spec__", None) else sys.argv[0]] + sys.argv[1:])


def onehot(idx, E: int):
    """(..., k) distinct ids -> (..., E) float 0/1."""
    return F.one_hot(idx, E).sum(-2).float()


def head_features(xn, idx, E: int):
    """concat[x_L(t), one-hot top-k at t, one-hot top-k at t-1 (zeros at t=0)] for a (B, T, .) sequence."""
    oh = onehot(idx, E)
    prev = torch.cat([torch.zeros_like(oh[:, :1]), oh[:, :-1]], 1)
    return torch.cat([xn, oh, prev], -1)


class Head(nn.Module):
    def __init__(self, f: int, hidden: int, E: int):
        super().__init__()
        self.fc1 = nn.Linear(f, hidden)
        self.fc2 = nn.Linear(hidden, E)
        self.res = nn.Linear(f, E, bias=False)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, f):
        return self.res(f) + self.fc2(F.gelu(self.fc1(f), approximate="tanh"))


class HeadSet(nn.Module):
    """One head per owner layer L, predicting layer L+1's router logits one token ahead."""

    def __init__(self, owners, d: int, E: int, hidden: int):
        super().__init__()
        self.owners = list(owners)
        self.heads = nn.ModuleDict({str(o): Head(d + 2 * E, hidden, E) for o in self.owners})

    def forward(self, owner: int, f):
        return self.heads[str(owner)](f)

    def warm_start(self, w: dict, spec):
        """Residual path = layer L+1's router applied to this state, with L+1's own norm: the router input x_L is
        w_L * h / rms(h), so router_{L+1}(w_{L+1} * h / rms(h)) = router_{L+1} diag(w_{L+1} / w_L) x_L (LES's lookahead)."""
        d, moe = spec.hidden_size, spec.moe_layers
        with torch.no_grad():
            for o in self.owners:
                t = moe[moe.index(o) + 1]
                wl = torch.tensor(np.asarray(w[f"layers.{o}.mlp_norm"]))
                wl = torch.where(wl.abs() < 1e-4, torch.full_like(wl, 1e-4) * torch.sign(wl + 1e-12), wl)
                ratio = torch.tensor(np.asarray(w[f"layers.{t}.mlp_norm"])) / wl
                res = self.heads[str(o)].res.weight
                res.zero_()
                res[:, :d] = torch.tensor(np.asarray(w[f"layers.{t}.router"])) * ratio[None, :]

    def to_numpy(self) -> dict:
        return {f"heads.{o}.{n}": p.detach().float().numpy().copy()
                for o in self.owners for n, p in self.heads[str(o)].named_parameters()}

    @classmethod
    def from_numpy(cls, t: dict, meta: dict) -> "HeadSet":
        hs = cls(meta["owners"], meta["hidden_size"], meta["num_experts"], meta["hidden"])
        with torch.no_grad():
            for o in hs.owners:
                for n, p in hs.heads[str(o)].named_parameters():
                    p.copy_(torch.from_numpy(t[f"heads.{o}.{n}"]))
        return hs


class LoRASet(nn.Module):
    """Rank-r adapters on attention projections: delta(x) = (x A^T) B^T * alpha / r (B starts at zero)."""

    def __init__(self, shapes: dict[str, tuple], rank: int = 16, alpha: float = 16.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.names = sorted(shapes)
        self.A = nn.ParameterDict({n.replace(".", "_"): nn.Parameter(torch.randn(rank, shapes[n][1], generator=g)
                                                                    / math.sqrt(shapes[n][1])) for n in self.names})
        self.B = nn.ParameterDict({n.replace(".", "_"): nn.Parameter(torch.zeros(shapes[n][0], rank))
                                   for n in self.names})

    def delta(self, name: str, x):
        k = name.replace(".", "_")
        if k not in self.A:
            return None
        return (x @ self.A[k].T) @ self.B[k].T * self.scale

    def to_numpy(self) -> dict:
        out = {}
        for n in self.names:
            _, L, proj = n.split(".")
            k = n.replace(".", "_")
            out[f"lora.{L}.{proj}.A"] = self.A[k].detach().float().numpy().copy()
            out[f"lora.{L}.{proj}.B"] = self.B[k].detach().float().numpy().copy()
        return out

    @classmethod
    def from_numpy(cls, t: dict, meta: dict) -> "LoRASet":
        shapes = {}
        for n in t:
            if n.endswith(".A"):
                base = n[:-2]
                _, L, proj = base.split(".")
                shapes[f"layers.{L}.{proj}"] = (t[base + ".B"].shape[0], t[n].shape[1])
        ls = cls(shapes, rank=int(meta["rank"]), alpha=float(meta["alpha"]))
        with torch.no_grad():
            for n in ls.names:
                _, L, proj = n.split(".")
                k = n.replace(".", "_")
                ls.A[k].copy_(torch.from_numpy(t[f"lora.{L}.{proj}.A"]))
                ls.B[k].copy_(torch.from_numpy(t[f"lora.{L}.{proj}.B"]))
        return ls


class RoutedExperts(torch.autograd.Function):
    """Each token through its k experts, weighted, with the experts fetched as they are needed and never saved for
    the backward pass: it fetches them again. each(fn, groups) gives fn(group, (gate (ff, d), up (ff, d),
    down (d, ff))) for each (expert, rows, slots) group, in order (Weights.each_expert: on a pool, each expert read,
    dequantized and computed with by one thread)."""

    @staticmethod
    def forward(ctx, x, w, idx, each):
        ctx.save_for_backward(x, w, idx)
        ctx.each = each

        def one(group, mats):
            (_, rows, slots), (g, u, d) = group, mats
            xr = x[rows]
            return (F.silu(xr @ g.T) * (xr @ u.T)) @ d.T * w[rows, slots, None]
        out = torch.zeros_like(x)
        groups = list(RoutedExperts.groups(idx))
        for (_, rows, _), y in zip(groups, each(one, groups)):
            out[rows] += y                                      # a token takes an expert once: rows are distinct
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, idx = ctx.saved_tensors

        def one(group, mats):
            (_, rows, slots), (g, u, d) = group, mats
            xr, dy = x[rows], dout[rows]
            a, b = xr @ g.T, xr @ u.T
            sa = torch.sigmoid(a)
            dw = (dy * ((a * sa * b) @ d.T)).sum(-1)             # silu(a) * b, through down
            dh = (dy * w[rows, slots, None]) @ d
            da = dh * b * sa * (1 + a * (1 - sa))                # silu'(a) = s (1 + a (1 - s))
            return da @ g + (dh * a * sa) @ u, dw
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        groups = list(RoutedExperts.groups(idx))
        for (_, rows, slots), (dxe, dwe) in zip(groups, ctx.each(one, groups)):
            dx[rows] += dxe
            dw[rows, slots] = dwe
        return dx, dw, None, None

    @staticmethod
    def groups(idx):
        """(expert, rows, slots) for every expert some token chose, in id order."""
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        k = idx.shape[-1]
        start = 0
        for e, n in enumerate(torch.bincount(flat).tolist()):
            if n:
                o = order[start:start + n]
                yield e, o // k, o % k
                start += n


class Weights:
    """A pack's frozen weights as f32 tensors, dequantized when asked for: the top (embedding, final norm, lm_head,
    always held), one layer's other tensors, one expert's three matrices. Held after the first ask when the whole
    model fits in `hold` bytes; otherwise read and dequantized at every ask (a model bigger than memory), GGUF
    blocks by ggml's own to_float."""

    def __init__(self, pack: Pack, hold: int):
        self.pack, s = pack, pack.spec
        self.f32_bytes = 4 * (sum(int(np.prod(t["shape"])) for t in pack.tensors.values())
                              + s.num_experts * len(s.moe_layers) * 3 * s.hidden_size * s.moe_intermediate_size)
        self.streams = self.f32_bytes > hold
        self.held: dict = {}
        self.fds = [os.open(p, os.O_RDONLY) for p in pack.data_paths]
        self.workers = cores()
        self.pool = ThreadPoolExecutor(self.workers)
        top = {n: self._tensor(n) for n in ("embed", "norm", "lm_head") if n in pack.tensors}
        top.setdefault("lm_head", top["embed"])
        self.top = {state_name(n): torch.from_numpy(a) for n, a in top.items()}

    def __del__(self):
        self.pool.shutdown(wait=False)
        for fd in self.fds:
            os.close(fd)

    def _tensor(self, name: str) -> np.ndarray:
        t = self.pack.tensors[name]
        if t["kind"].startswith("gguf:"):
            return dequantize(self.pack.tensor_bytes(name), tuple(t["shape"]), t["kind"])
        return np.array(self.pack.tensor(name), np.float32)

    def _memo(self, key, make):
        if key in self.held:
            return self.held[key]
        v = make()
        if not self.streams:
            self.held[key] = v
        return v

    def layer(self, i: int) -> dict:
        """{name in the Layer module: tensor} of layer i, its experts left out."""
        def make():
            w = {n: self._tensor(n) for n in self.pack.tensors if n.startswith(f"layers.{i}.")}
            if self.pack.spec.family == "qwen3_next":
                split_fused_projections(self.pack.spec, w)
            cut = len(f"model.layers.{i}.")
            return {state_name(n)[cut:]: torch.from_numpy(np.ascontiguousarray(a, np.float32)) for n, a in w.items()
                    if state_name(n)}
        return self._memo(("layer", i), make)

    def each_expert(self, L: int, fn, groups):
        """fn(group, expert(L, group[0])) for each group, in order, a few ahead on the pool's threads: one thread
        reads, dequantizes and computes with an expert while it is in its cache (ggml and torch let go of the GIL)."""
        ahead = collections.deque()
        for g in groups:
            ahead.append(self.pool.submit(lambda g=g: fn(g, self.expert(L, g[0]))))
            if len(ahead) > 2 * self.workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()

    def expert(self, L: int, e: int) -> tuple:
        def make():
            p = self.pack
            chunks = [np.frombuffer(os.pread(self.fds[off >> SHARD_BITS], n, off & SHARD_MASK), np.uint8)
                      for off, n in p.expert_reads(L, e)]
            kinds = p.kinds_of(L)
            if all(k.startswith("gguf:") for k in kinds.values()):
                raw = p.decode_expert(L, e, chunks, raw=True)
                parts = {q: dequantize(raw[q], p.expert_shapes[q], kinds[q]) for q in PARTS}
            else:
                parts = p.decode_expert(L, e, chunks)
            return tuple(torch.from_numpy(np.ascontiguousarray(parts[q], np.float32)) for q in PARTS)
        return self._memo(("expert", L, e), make)


class TorchMoE(nn.Module):
    """A pack's model in torch (training/model.py's layers, fp32, frozen), its weights from `Weights`: held when the
    model fits in `hold` bytes (default: half the memory available), else streamed layer by layer, each layer
    recomputed for the backward pass (activation checkpointing) so that no more than one layer's tensors are in
    memory at once. The prerouter routing and the adapters are arguments of forward and step."""

    def __init__(self, pack: Pack, hold: int | None = None):
        super().__init__()
        s = self.spec = pack.spec
        if (s.router != "softmax_topk" or (s.shared_expert_size and not s.layer_types) or s.dense_layers or s.attention_bias
                or s.clip_qkv is not None or s.qk_norm not in ("head", "none") or s.attention != "gqa" or s.rope_yarn
                or s.n_group > 1 or s.routed_scaling_factor != 1.0):
            raise WorkbenchError(f"{pack.path}: the Edge0 trainers support Qwen3-MoE-like models (softmax top-k router, "
                                 f"no shared expert, no dense layers, plain RoPE) and the hybrid family; this is {s.family}")
        self.pack = pack
        self.identity = model_identity(pack)
        if hold is None:
            hold = (available_memory_bytes() or 8 << 30) // 2
        self.weights = Weights(pack, hold)
        with torch.device("meta"):                      # the modules' shapes only: their tensors come from weights
            self.model = MoEDecoder(MoEConfig.of_spec(s))
        self.model.requires_grad_(False)

    def proj_shapes(self, projs=PROJ) -> dict:
        shape = lambda name: tuple(self.pack.tensors[name]["shape"])
        return {f"layers.{i}.{p}": shape(f"layers.{i}.{p}") for i in range(self.spec.num_layers)
                for p in projs if not self.spec.is_linear(i)}          # attention layers only (no q, k, v, o in DeltaNet)

    def layer(self, i, x, cos, sin, router, delta, kv=None, collect=None):
        """Layer i on x with its weights as Weights gives them; its experts through RoutedExperts."""
        w = self.weights

        def routed(xn, idx, wts):
            shape = xn.shape
            out = RoutedExperts.apply(xn.reshape(-1, shape[-1]), wts.to(xn.dtype).reshape(-1, idx.shape[-1]),
                                      idx.reshape(-1, idx.shape[-1]), lambda fn, groups: w.each_expert(i, fn, groups))
            return out.reshape(shape)
        return torch.func.functional_call(self.model.model.layers[i], w.layer(i), (x, cos, sin),
                                          dict(router=router, delta=delta, kv=kv, collect=collect, routed=routed),
                                          strict=False)[0]

    def embed(self, ids):
        return F.embedding(ids, self.weights.top["model.embed_tokens.weight"])

    def logits(self, x):
        top = self.weights.top
        xn = torch.func.functional_call(self.model.model.norm, {"weight": top["model.norm.weight"]}, (x,))
        return F.linear(xn, top["lm_head.weight"])

    def forward(self, ids, heads: HeadSet | None = None, skip_layers: int = 1, lora: LoRASet | None = None,
                collect: bool = False):
        """ids (B, T) -> logits (B, T, V); collect: also {layer: (router input, executed ids, real router logits)}."""
        moe = self.spec.moe_layers
        streamed = set(moe[skip_layers:]) if heads is not None else set()
        got = {} if collect else None
        delta = lora.delta if lora is not None else None
        cos, sin = self.model.rope(0, ids.shape[1])
        checkpointing = self.weights.streams and torch.is_grad_enabled()

        def run(i, x, feats):
            """Layer i given the owner's features (None: it routes exactly) -> (x, the features it owns)."""
            mine = {}

            def router(i, xn, logits):
                used = logits
                if i in streamed:           # position t routes from the owner's head at t-1 (t=0: exactly)
                    used = torch.cat([logits[:, :1], heads(moe[moe.index(i) - 1], feats)[:, :-1]], 1)
                idx, wts = self.model.route(i, used)
                if heads is not None and i in moe[:-1] and moe[moe.index(i) + 1] in streamed:
                    mine["f"] = head_features(xn, idx, self.spec.num_experts)
                return idx, wts
            return self.layer(i, x, cos, sin, router, delta, collect=got), mine.get("f")

        x, feats = self.embed(ids), None
        for i in range(self.spec.num_layers):
            if checkpointing:
                x, feats = checkpoint(run, i, x, feats, use_reentrant=False)
            else:
                x, feats = run(i, x, feats)
        out = self.logits(x)
        return (out, got) if collect else out

    # ------------------------------------------------------------ incremental decoding (sampling)

    @torch.no_grad()
    def step(self, tok, cache: dict, heads: HeadSet | None = None, skip_layers: int = 1, lora: LoRASet | None = None):
        """One token per row (tok: (B,)) with a KV cache; the same routing as forward() gives at that position."""
        moe = self.spec.moe_layers
        pos = cache.get("pos", 0)
        staged, prev = cache.setdefault("staged", {}), cache.setdefault("prev", {})
        streamed = set(moe[skip_layers:]) if heads is not None else set()
        nxt = {}                                    # staged for the next token (not this one)

        def router(i, xn, logits):
            idx, wts = self.model.route(i, staged.pop(i) if (i in streamed and pos > 0) else logits)
            j = moe.index(i)
            if heads is not None and j + 1 < len(moe) and moe[j + 1] in streamed:
                oh = onehot(idx, self.spec.num_experts)
                nxt[moe[j + 1]] = heads(i, torch.cat([xn, oh, prev.get(i, torch.zeros_like(oh))], -1))
                prev[i] = oh
            return idx, wts

        cos, sin = self.model.rope(pos, 1)
        x = self.embed(tok[:, None])
        delta, kv = (lora.delta if lora is not None else None), cache.setdefault("kv", {})
        for i in range(self.spec.num_layers):
            x = self.layer(i, x, cos, sin, router, delta, kv=kv)
        cache["pos"] = pos + 1
        cache["staged"] = nxt
        return self.logits(x)[:, 0]

    @torch.no_grad()
    def sample(self, prompts, new_tokens: int, gen: torch.Generator, temperature: float = 1.0, **route_kw):
        """prompts (B, P) -> (B, P + new_tokens); every token (prompt too) goes through step()."""
        cache = {}
        seq = [prompts[:, i] for i in range(prompts.shape[1])]
        for t in seq[:-1]:
            self.step(t, cache, **route_kw)
        last = seq[-1]
        for _ in range(new_tokens):
            z = self.step(last, cache, **route_kw) / max(temperature, 1e-6)
            last = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)[:, 0]
            seq.append(last)
        return torch.stack(seq, 1)


def sample_windows(data: dict[str, np.ndarray], n: int, T: int, rng: np.random.Generator) -> np.ndarray:
    """n windows of T tokens, corpora mixed by size (as the demo model was trained)."""
    names = list(data)
    sizes = np.array([len(data[k]) for k in names], dtype=np.float64)
    rows = []
    for c in rng.choice(len(names), size=n, p=sizes / sizes.sum()):
        d = data[names[c]]
        st = rng.integers(0, len(d) - T - 1)
        rows.append(d[st:st + T])
    return np.stack(rows)


def data_digest(windows: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(windows, np.int64).tobytes()).hexdigest()[:16]


class Clock:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0
