"""Read a GGUF MoE checkpoint (llama.cpp's format) lazily, with the same interface as HFModel.

    m = GGUFModel("model.gguf")
    m.spec, m.names(), m.tensor(name), m.tensor_shape(name), m.expert(layer, e), m.path

plus what the pack writer uses to keep llama.cpp's quantized blocks as they are:
    m.tensor_kind(name) / m.expert_kinds(layer)   "f32" or "gguf:<TYPE>" (e.g. gguf:Q4_K)
    m.tensor_raw(name) / m.expert_raw(layer, e)   the bytes exactly as they lie in the GGUF
    m.tokenizer_json()                            a Hugging Face tokenizer.json built from the GGUF vocab
    m.source_info()                               what the pack header records about the source

Architectures: qwen3moe, qwen2moe, olmoe, llama with experts (Mixtral), dots1, deepseek2 (DeepSeek-V2/V3:
latent attention; softmax gating is deepseek_v2, sigmoid deepseek_v3). Every other architecture is refused
with a clear error. deepseek2 keeps the latent up-projection either whole (attn_kv_b, legacy files) or split
for llama.cpp's absorbed attention (attn_k_b transposed per head, attn_v_b); the split form is joined back
into the Hugging Face kv_b layout (dequantized, so that one tensor is stored f32).

Shapes: GGUF stores ne[] fastest-first (ne0 = row length); numpy order is the reverse, so a tensor
with ne [d, ff, E] is (E, ff, d) here, and one expert's rows are one contiguous byte range.
llama.cpp's converter permutes the Q/K rows of `llama` models (for its interleaved RoPE); they are
un-permuted on read (whole rows move, so quantized rows can move too). qwen*/olmoe/dots1 use NEOX
RoPE and are stored as in Hugging Face.

Multi-token prediction (llama.cpp's nextn blocks, e.g. in Qwen3-Next and Qwen3.5/3.6-MoE files): the last
`{arch}.nextn_predict_layers` of the `{arch}.block_count` blocks are MTP blocks (a decoder block plus
blk.N.nextn.*). The model is the main layers; every tensor of those blocks is accepted, listed in `mtp_tensors`
and never read as the model's (so it is in no index or pack); `mtp_layers` and source_info say how many. The
first block is read, dequantized, only to draft (`mtp_block`: draft=mtp).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from workbench.errors import WorkbenchError
from workbench.models.gguf_hybrid import BLOCKS as HYBRID_BLOCKS, hybrid_derived, hybrid_gguf_spec
from workbench.spec import MoESpec, yarn_mscale

PARTS = ("gate", "up", "down")
ARCHES = ("qwen3moe", "qwen2moe", "olmoe", "llama", "dots1", "deepseek2", "qwen3next", "qwen35moe")
_FAMILY = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe", "llama": "mixtral", "dots1": "dots1",
           "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe"}
SOFTMAX, SIGMOID = 1, 2          # llama.cpp's expert_gating_func values

# llama.cpp tensor names (gguf.TENSOR_NAMES) -> workbench canonical names; {i} is the block.
_GLOBAL = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_BLOCK = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v", "attn_output.weight": "o",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_q_a.weight": "q_a", "attn_q_a_norm.weight": "q_a_norm", "attn_q_b.weight": "q_b",
    "attn_kv_a_mqa.weight": "kv_a", "attn_kv_a_norm.weight": "kv_a_norm", "attn_kv_b.weight": "kv_b",
    "ffn_gate_inp.weight": "router", "exp_probs_b.bias": "router_bias",
    "ffn_gate_shexp.weight": "shared.gate", "ffn_up_shexp.weight": "shared.up", "ffn_down_shexp.weight": "shared.down",
    "ffn_gate_inp_shexp.weight": "shared_gate",
    "ffn_gate.weight": "dense.gate", "ffn_up.weight": "dense.up", "ffn_down.weight": "dense.down",
}
_STACKED = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
            "ffn_gate_up_exps.weight": "gate_up"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
# An MTP (nextn) block's tensors -> the names after `mtp.` that workbench.models.mtp.load_mtp gives (Hugging Face's)
NEXTN = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight",
          "nextn.embed_tokens.weight": None, "nextn.shared_head_head.weight": None,     # the model's own: not read
          **{f"{g}.weight": f"layers.0.{h}.weight" for g, h in (
              ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
              ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
              ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"),
              ("attn_k_norm", "self_attn.k_norm"), ("ffn_gate_inp", "mlp.gate"),
              ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"), ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
              ("ffn_down_shexp", "mlp.shared_expert.down_proj"), ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"))},
          **{f"ffn_{p}_exps.weight": f"layers.0.mlp.experts.{{}}.{p}_proj.weight" for p in ("gate", "up", "down")}}
_SPLIT_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")   # old Mixtral GGUFs: one tensor per expert
_KV_B_SPLIT = {"attn_k_b.weight": "k_b", "attn_v_b.weight": "v_b"}


_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_PRE = {  # tokenizer.ggml.pre -> the Hugging Face pre-tokenizer that splits the same way
    "gpt-2": _BYTELEVEL, "default": _BYTELEVEL,
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {**_BYTELEVEL, "use_regex": False}]},
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise WorkbenchError("reading GGUF needs the gguf package: pip install -e '.[llamacpp]'") from None
    return gguf


def _value(field):
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    parts = [field.parts[i] for i in field.data]
    if len(parts) == 1 and parts[0].dtype == np.uint8:
        return bytes(parts[0]).decode("utf-8")
    vals = [p.tolist()[0] if p.size == 1 else bytes(p).decode("utf-8") for p in parts]
    return vals[0] if len(vals) == 1 else vals


def dequantize(raw: np.ndarray, type_name: str, shape: tuple) -> np.ndarray:
    """GGUF bytes of one tensor (any type the gguf package knows) -> float32 of `shape` (numpy order)."""
    gguf = _gguf()
    qt = gguf.GGMLQuantizationType[type_name]
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        out = gguf.quants.dequantize(raw, qt)
    else:
        out = gguf.quants.dequantize(raw.reshape(rows, -1), qt)
    return np.asarray(out, dtype=np.float32).reshape(shape)


def row_nbytes(type_name: str, row: int) -> int:
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if row % block:
        raise WorkbenchError(f"a row of {row} values does not split into {type_name} blocks of {block}")
    return row // block * size


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes convert_hf_to_gguf's LlamaModel.permute for Q (n_head) or K (n_kv_head)."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


class GGUFModel:
    """A GGUF file, memory-mapped and read tensor by tensor."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise WorkbenchError(f"{self.path}: no such GGUF file")
        gguf = _gguf()
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # the reader raises ValueError/struct errors on a bad or truncated file
            raise WorkbenchError(f"{self.path}: not a readable GGUF file ({e})") from None
        try:
            self._load()
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:  # UnicodeDecodeError too
            raise WorkbenchError(f"{self.path}: malformed GGUF metadata ({type(e).__name__}: {e})") from None

    def _load(self):
        self.arch = _value(self.reader.get_field("general.architecture"))
        self.raw = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > self.path.stat().st_size:
                raise WorkbenchError(f"{self.path}: truncated: tensor {t.name} ends past the end of the file")
        if self.arch not in ARCHES:
            raise WorkbenchError(f"{self.path}: GGUF architecture {self.arch!r} is not a supported MoE family "
                                 f"(qwen3moe, qwen2moe, olmoe, llama with experts (Mixtral), dots1, deepseek2, qwen3next, "
                                 f"qwen35moe)")
        self.where: dict[str, str] = {}                   # canonical -> GGUF tensor name
        self.stacked: dict[tuple[int, str], str] = {}     # (layer, gate|up|down|gate_up) -> GGUF name
        self.split: dict[tuple[int, int, str], str] = {}  # (layer, expert, part) -> GGUF name (old Mixtral)
        self.kv_b_split: dict[int, dict[str, str]] = {}  # layer -> {k_b, v_b} -> GGUF name (deepseek2, absorbed)
        first_mtp = self._mtp_blocks()
        self.mtp_tensors: list[str] = []                  # the MTP blocks' tensors: accepted, never read
        unknown = []
        for name in self.raw:
            if name in _GLOBAL:
                self.where[_GLOBAL[name]] = name
                continue
            m = _BLK.fullmatch(name)
            if not m:
                unknown.append(name)
                continue
            i, rest = int(m[1]), m[2]
            if first_mtp is not None and i >= first_mtp:
                self.mtp_tensors.append(name)
                continue
            if rest in HYBRID_BLOCKS.get(self.arch, {}):
                self.where[f"layers.{i}.{HYBRID_BLOCKS[self.arch][rest]}"] = name
            elif rest in _BLOCK:
                self.where[f"layers.{i}.{_BLOCK[rest]}"] = name
            elif rest in _STACKED:
                self.stacked[(i, _STACKED[rest])] = name
            elif rest == "attn_qkv.weight":
                for p in "qkv":
                    self.where[f"layers.{i}.{p}"] = name
            elif rest in _KV_B_SPLIT:
                self.kv_b_split.setdefault(i, {})[_KV_B_SPLIT[rest]] = name
                self.where[f"layers.{i}.kv_b"] = name
            elif ms := _SPLIT_EXPERT.fullmatch(rest):
                self.split[(i, int(ms[2]), ms[1])] = name
            else:
                unknown.append(name)
        if unknown:   # e.g. rope_freqs (rope scaling), *_exps_s scales, MTP blocks: no place in MoESpec
            raise WorkbenchError(f"{self.path}: tensor {unknown[0]} has no place in a workbench MoE model "
                                 f"({len(unknown)} such tensors)")
        self.spec = self._spec()
        self.derived = hybrid_derived(self) if self.arch in HYBRID_BLOCKS else {}
        self._derived_shapes: dict[str, list[int]] = {}     # built once for its shape, not on every plan pass
        self._check_complete()

    def _mtp_blocks(self) -> int | None:
        """The first MTP block (blocks from there to block_count are nextn blocks), or None when there are none."""
        self.mtp_layers = int(self.meta("{arch}.nextn_predict_layers", 0) or 0)
        if not self.mtp_layers:
            return None
        blocks = int(self.meta("{arch}.block_count", 0) or 0)
        if not 0 < self.mtp_layers < blocks:
            raise WorkbenchError(f"{self.path}: {self.arch}.nextn_predict_layers {self.mtp_layers} leaves no main "
                                 f"layers of {self.arch}.block_count {blocks}")
        return blocks - self.mtp_layers

    def mtp_tensors_of_block(self) -> dict[str, str | None]:
        """{GGUF name: its name after `mtp.`, or None where it is the model's own (embedding, head)} of the first MTP
        block: the one that drafts."""
        if not self.mtp_layers:
            raise WorkbenchError(f"{self.path}: no MTP layers ({self.arch}.nextn_predict_layers is 0): draft=mtp needs "
                                 f"a checkpoint with a multi-token-prediction block")
        first, out = self.spec.num_layers, {}
        for name in self.mtp_tensors:
            block, rest = _BLK.fullmatch(name).groups()
            if int(block) != first:
                continue
            if rest not in NEXTN:
                raise WorkbenchError(f"{self.path}: MTP tensor {name} has no place in an MTP block of the Qwen3-Next kind")
            out[name] = NEXTN[rest]
        return out

    def mtp_block(self) -> dict[str, np.ndarray]:
        """The first MTP block's tensors by their names after `mtp.`, f32, experts one tensor each: what
        workbench.models.mtp.load_mtp gives of a Hugging Face checkpoint. Norms as the file holds them (llama.cpp's
        converter wrote the hybrid family's as 1 + w)."""
        out = {}
        for gname, name in self.mtp_tensors_of_block().items():
            if name is None:
                continue
            a = self._dequantized(gname)
            if "{}" in name:
                out.update((name.format(e), a[e]) for e in range(a.shape[0]))
            else:
                out[name] = a.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else a
        return out

    # ------------------------------------------------------------ metadata

    def meta(self, key: str, default=None):
        v = _value(self.reader.get_field(key.format(arch=self.arch)))
        return default if v is None else v

    def _ne(self, name: str) -> list[int]:
        return [int(x) for x in self.raw[name].shape]

    def _spec(self) -> MoESpec:
        a, m = self.arch, self.meta
        n_expert = int(m("{arch}.expert_count", 0))
        if n_expert == 0:
            raise WorkbenchError(f"{self.path}: {a} model without experts ({a}.expert_count is 0): not an MoE")

        def need(key):
            v = m(key)
            if v is None:
                raise WorkbenchError(f"{self.path}: GGUF metadata lacks {key.format(arch=a)}")
            return v[0] if isinstance(v, list) else v     # per-layer arrays: the workbench needs them uniform
        n_layer = int(need("{arch}.block_count")) - self.mtp_layers      # the main layers
        if not 0 < n_layer <= len(self.raw) or n_expert > sum(int(t.n_elements) for t in self.raw.values()):
            raise WorkbenchError(f"{self.path}: {n_layer} blocks of {n_expert} experts do not fit its {len(self.raw)} tensors")
        d = int(need("{arch}.embedding_length"))
        heads = int(need("{arch}.attention.head_count"))
        kv = m("{arch}.attention.head_count_kv", heads)
        kv = kv[0] if isinstance(kv, list) else kv
        head_dim = int(m("{arch}.attention.key_length", d // heads))
        moe = [i for i in range(n_layer) if f"layers.{i}.router" in self.where]
        if not moe:
            raise WorkbenchError(f"{self.path}: no ffn_gate_inp (router) tensors: not an MoE checkpoint")
        ff = m("{arch}.expert_feed_forward_length")
        if ff is None:
            ff = self._expert_ff(moe[0])
        ff = int(ff[0] if isinstance(ff, list) else ff)
        if "token_embd.weight" not in self.raw:
            raise WorkbenchError(f"{self.path}: GGUF lacks token_embd.weight")
        vocab = self._ne("token_embd.weight")[1]
        dense = [i for i in range(n_layer) if i not in moe]
        dense_ff = int(m("{arch}.feed_forward_length", 0) or 0)
        if dense:
            dense_ff = self._ne(self.where[f"layers.{dense[0]}.dense.gate"])[1]
        eos, bos = m("tokenizer.ggml.eos_token_id"), m("tokenizer.ggml.bos_token_id")
        common = dict(family=_FAMILY.get(a, a), vocab_size=vocab, hidden_size=d, num_layers=n_layer, num_heads=int(heads),
                      num_kv_heads=int(kv), head_dim=head_dim, num_experts=n_expert,
                      top_k=int(need("{arch}.expert_used_count")), moe_intermediate_size=ff,
                      rope_theta=_f32(m("{arch}.rope.freq_base", 10000.0)),
                      rms_norm_eps=_f32(m("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
                      tie_word_embeddings="output.weight" not in self.raw,
                      max_position_embeddings=int(m("{arch}.context_length", 4096)),
                      bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
                      attention_bias=f"layers.{moe[0]}.q_bias" in self.where,
                      dense_layers=dense, dense_intermediate_size=dense_ff)
        shexp = f"layers.{moe[0]}.shared.gate" in self.where
        common["rope_yarn"] = self._yarn()
        # how llama.cpp itself runs each architecture (src/models/<arch>.cpp, build_moe_ffn arguments)
        if a == "deepseek2":
            return self._deepseek2_spec(common, ff)
        if a in HYBRID_BLOCKS:
            return hybrid_gguf_spec(common, m, self._ne(self.where[f"layers.{moe[0]}.shared.gate"])[1],
                                    tiled=a == "qwen35moe")
        if a == "qwen3moe":        # norm_w true, softmax, per-head q/k norm
            return MoESpec(**common, norm_topk_prob=True, qk_norm="head")
        if a == "qwen2moe":        # norm_w false, a sigmoid-gated shared expert
            sh = self._ne(self.where[f"layers.{moe[0]}.shared.gate"])[1] if shexp else 0
            return MoESpec(**common, norm_topk_prob=False, shared_expert_size=sh,
                           shared_expert_gate=f"layers.{moe[0]}.shared_gate" in self.where)
        if a == "olmoe":           # norm_w false, q/k norm over all heads, optional clamp
            clip = m("{arch}.attention.clamp_kqv")
            return MoESpec(**common, norm_topk_prob=False, qk_norm="full", clip_qkv=float(clip) if clip else None)
        if a == "llama":           # Mixtral: norm_w true, softmax
            if shexp:
                raise WorkbenchError(f"{self.path}: llama with shared experts (llama4-style) is not supported")
            return MoESpec(**common, norm_topk_prob=True)
        # dots1: sigmoid scores, expert groups, selection bias, shared experts
        gating = int(m("{arch}.expert_gating_func", 2))
        if gating != 2:
            raise WorkbenchError(f"{self.path}: dots1 with expert_gating_func {gating} (not sigmoid) is not supported")
        n_shared = int(m("{arch}.expert_shared_count", 0))
        return MoESpec(**common, router="sigmoid_group", norm_topk_prob=bool(m("{arch}.expert_weights_norm", False)),
                       n_group=int(m("{arch}.expert_group_count", 1) or 1),
                       topk_group=int(m("{arch}.expert_group_used_count", 1) or 1),
                       routed_scaling_factor=float(m("{arch}.expert_weights_scale", 1.0) or 1.0), qk_norm="head",
                       shared_expert_size=n_shared * ff)

    def _yarn(self) -> dict | None:
        """YaRN as llama.cpp sets it up (llama_context's yarn_attn_factor; deepseek2 stores 0.1 * mscale_all_dim
        as yarn_log_multiplier and assumes mscale = mscale_all_dim)."""
        m = self.meta
        kind = m("{arch}.rope.scaling.type", "none")
        if kind in ("none", None):
            return None
        if kind != "yarn":
            raise WorkbenchError(f"{self.path}: rope scaling {kind!r} is not supported (none, yarn)")
        factor = _f32(m("{arch}.rope.scaling.factor", 1.0))
        log_mul = _f32(m("{arch}.rope.scaling.yarn_log_multiplier", 0.0))
        if self.arch == "deepseek2":
            log_mul = round(log_mul / 0.1, 6)
        if log_mul:
            mscale = log_mul if self.arch == "deepseek2" and log_mul != 1.0 else 1.0
            att = yarn_mscale(factor, mscale) / yarn_mscale(factor, log_mul)
        else:
            att = yarn_mscale(factor)
        orig = m("{arch}.rope.scaling.original_context_length")
        if orig is None:
            raise WorkbenchError(f"{self.path}: YaRN rope scaling without {self.arch}.rope.scaling.original_context_length")
        return dict(factor=factor, original_max_position_embeddings=int(orig),
                    beta_fast=_f32(m("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=_f32(m("{arch}.rope.scaling.yarn_beta_slow", 1.0)), truncate=True,
                    attention_factor=att * _f32(m("{arch}.rope.scaling.attn_factor", 1.0)), mscale_all_dim=log_mul)

    def _deepseek2_spec(self, common: dict, ff: int) -> MoESpec:
        """Latent attention sizes, and the router as llama.cpp runs it: softmax unless the file says sigmoid,
        groups (if any) ranked by their top-2 sum, weights optionally normalised and scaled."""
        m = self.meta
        rope = int(m("{arch}.rope.dimension_count", 0))
        kv_lora = int(m("{arch}.attention.kv_lora_rank", 0))
        if not rope or not kv_lora:
            raise WorkbenchError(f"{self.path}: deepseek2 GGUF lacks rope.dimension_count or attention.kv_lora_rank")
        k_len, v_len = m("{arch}.attention.key_length_mla"), m("{arch}.attention.value_length_mla")
        if k_len is None:      # legacy files (one attn_kv_b): key/value_length are the decompressed head sizes
            k_len, v_len = m("{arch}.attention.key_length"), m("{arch}.attention.value_length")
        gating = int(m("{arch}.expert_gating_func", SOFTMAX))
        if gating not in (SOFTMAX, SIGMOID):
            raise WorkbenchError(f"{self.path}: deepseek2 with expert_gating_func {gating} is not supported "
                                 f"(1 softmax, 2 sigmoid)")
        n_group = int(m("{arch}.expert_group_count", 1) or 1)
        family = "deepseek_v3" if gating == SIGMOID else "deepseek_v2"
        return MoESpec(
            **{**common, "family": family, "num_kv_heads": common["num_heads"], "head_dim": int(k_len)},
            attention="mla", q_lora_rank=int(m("{arch}.attention.q_lora_rank", 0) or 0), kv_lora_rank=kv_lora,
            qk_rope_head_dim=rope, v_head_dim=int(v_len),
            router="sigmoid_group" if gating == SIGMOID else "softmax_topk",
            norm_topk_prob=bool(m("{arch}.expert_weights_norm", False)),
            n_group=n_group, topk_group=int(m("{arch}.expert_group_used_count", 1) or 1) if n_group > 1 else 1,
            routed_scaling_factor=_f32(m("{arch}.expert_weights_scale", 1.0) or 1.0),
            shared_expert_size=int(m("{arch}.expert_shared_count", 0)) * ff)

    def _expert_ff(self, layer: int) -> int:
        if (layer, "gate") in self.stacked:
            return self._ne(self.stacked[(layer, "gate")])[1]
        if (layer, "gate_up") in self.stacked:
            return self._ne(self.stacked[(layer, "gate_up")])[1] // 2
        return self._ne(self.split[(layer, 0, "gate")])[1]

    def _attention_names(self, layer: int) -> list[str]:
        """The canonical tensors of one attention block as this file holds them (a qwen3next DeltaNet block
        holds llama.cpp's split q/k/v, z and b/a where a Hugging Face checkpoint fuses them)."""
        if not (self.spec.is_linear(layer) and self.arch in HYBRID_BLOCKS):
            return self.spec.attention_names(layer)
        return [f"layers.{layer}.{c}" for c in HYBRID_BLOCKS[self.arch].values() if c and c != "mlp_norm"]

    def _check_complete(self):
        s = self.spec
        need = ["embed", "norm"] + ([] if s.tie_word_embeddings else ["lm_head"])
        for i in range(s.num_layers):
            need += [f"layers.{i}.attn_norm", f"layers.{i}.mlp_norm"] + self._attention_names(i)
            need += [f"blk.{i}.attn_{h}" for h in ("k_b", "v_b") if i in self.kv_b_split and h not in self.kv_b_split[i]]
            need += [f"layers.{i}.router"] if i in s.moe_layers else [f"layers.{i}.dense.{p}" for p in PARTS]
        missing = [n for n in need if n not in self.where]
        for i in s.moe_layers:
            for p in PARTS:
                if (i, p) not in self.stacked and not ((i, "gate_up") in self.stacked and p != "down") \
                        and (i, 0, p) not in self.split:
                    missing.append(f"blk.{i}.ffn_{p}_exps")
        if missing:
            raise WorkbenchError(f"{self.path}: GGUF lacks {len(missing)} tensors, first: {missing[0]}")

    # ------------------------------------------------------------ tensors

    def names(self) -> list[str]:
        return list(self.where)

    def _type(self, gname: str) -> str:
        return self.raw[gname].tensor_type.name

    def _bytes(self, gname: str) -> np.ndarray:
        """The tensor's bytes as (rows, bytes per row) uint8, a view of the memory map."""
        t = self.raw[gname]
        ne = self._ne(gname)
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        return np.asarray(t.data).reshape(-1).view(np.uint8).reshape(rows, -1)

    def _rows(self, name: str, gname: str):
        """(first row, row count, row order) of a canonical tensor inside its GGUF tensor."""
        s = self.spec
        ne = self._ne(gname)
        rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
        start, n = 0, rows
        kind = name.rsplit(".", 1)[-1]
        if gname.endswith("attn_qkv.weight") and kind in ("q", "k", "v"):    # fused: q rows, then k, then v
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            start, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[kind]
        order = None
        if self.arch == "llama" and kind in ("q", "k"):
            order = _unpermute_rows(n, s.num_heads if kind == "q" else s.num_kv_heads)
        return start, n, order

    def _joined_kv_b(self, name: str) -> int | None:
        """The layer whose kv_b is stored split (attn_k_b + attn_v_b), or None."""
        if name.endswith(".kv_b") and (i := int(name.split(".")[1])) in self.kv_b_split:
            return i
        return None

    def tensor_shape(self, name: str) -> list[int]:
        s = self.spec
        if name in self.derived:
            if name not in self._derived_shapes:
                self._derived_shapes[name] = list(self.derived[name]().shape)
            return list(self._derived_shapes[name])
        if self._joined_kv_b(name) is not None:
            return [s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank]
        gname = self.where[name]
        ne = self._ne(gname)
        if name.endswith("shared_gate"):
            return [1, ne[0]]
        if len(ne) == 1:
            return [ne[0]]
        _, n, _ = self._rows(name, gname)
        return [n, ne[0]]

    def tensor_kind(self, name: str) -> str:
        if self._joined_kv_b(name) is not None or name in self.derived:
            return "f32"
        t = self._type(self.where[name])
        return "f32" if t == "F32" else f"gguf:{t}"

    def tensor_raw(self, name: str) -> np.ndarray:
        """The tensor's GGUF bytes (rows un-permuted / split out of a fused QKV where needed)."""
        gname = self.where[name]
        start, n, order = self._rows(name, gname)
        b = self._bytes(gname)[start:start + n]
        return np.ascontiguousarray(b if order is None else b[order]).reshape(-1)

    def tensor_location(self, name: str) -> tuple[int, int] | None:
        """(file offset, bytes) of tensor_raw(name) where it lies in the GGUF as one range, else None (made on
        read: derived, joined, rows permuted)."""
        if name in self.derived or self._joined_kv_b(name) is not None:
            return None
        gname = self.where[name]
        start, n, order = self._rows(name, gname)
        if order is not None:
            return None
        t, ne = self.raw[gname], self._ne(gname)
        row = int(t.n_bytes) // (int(np.prod(ne[1:])) if len(ne) > 1 else 1)
        return int(t.data_offset) + start * row, n * row

    def tensor(self, name: str) -> np.ndarray:
        try:
            return self._tensor(name)
        except ValueError as e:     # the bytes do not reshape into what the metadata says
            raise WorkbenchError(f"{self.path}: tensor {self.where.get(name, name)} does not hold the shape its "
                                 f"metadata gives ({e}; corrupt GGUF)") from None

    def _tensor(self, name: str) -> np.ndarray:
        if name in self.derived:
            return self.derived[name]()
        if (i := self._joined_kv_b(name)) is not None:
            # k_b: ne [nope, latent, heads] = numpy (heads, latent, nope), each head transposed; v_b: (heads, v, latent)
            k_b, v_b = (self._dequantized(self.kv_b_split[i][h]) for h in ("k_b", "v_b"))
            return np.concatenate([k_b.transpose(0, 2, 1), v_b], 1).reshape(self.tensor_shape(name))
        gname = self.where[name]
        return dequantize(self.tensor_raw(name), self._type(gname), tuple(self.tensor_shape(name)))

    def _dequantized(self, gname: str) -> np.ndarray:
        return dequantize(self._bytes(gname).reshape(-1), self._type(gname), tuple(reversed(self._ne(gname))))

    # ------------------------------------------------------------ experts

    def _expert_src(self, layer: int, part: str):
        """(GGUF name, expert-indexable?, row slice within one expert) for one projection."""
        if (layer, part) in self.stacked:
            return self.stacked[(layer, part)], None
        if part != "down" and (layer, "gate_up") in self.stacked:
            ff = self.spec.moe_intermediate_size
            return self.stacked[(layer, "gate_up")], (0 if part == "gate" else ff, ff)
        return None, None

    def expert_kinds(self, layer: int) -> dict[str, str]:
        out = {}
        for p in PARTS:
            gname, _ = self._expert_src(layer, p)
            t = self._type(gname if gname else self.split[(layer, 0, p)])
            out[p] = "f32" if t == "F32" else f"gguf:{t}"
        return out

    def expert_raw(self, layer: int, e: int) -> dict[str, np.ndarray]:
        """One expert's gate/up/down exactly as the GGUF stores them (flat uint8)."""
        s = self.spec
        out = {}
        for p in PARTS:
            gname, sl = self._expert_src(layer, p)
            if gname is None:
                out[p] = self._bytes(self.split[(layer, e, p)]).reshape(-1)
                continue
            b = self._bytes(gname)
            per = b.shape[0] // s.num_experts                 # rows of one expert
            rows = b[e * per:(e + 1) * per]
            if sl is not None:
                rows = rows[sl[0]:sl[0] + sl[1]]
            out[p] = np.ascontiguousarray(rows).reshape(-1)
        return out

    def expert_location(self, layer: int, e: int) -> dict[str, tuple[int, int]]:
        """{part: (file offset, bytes)} of expert_raw(layer, e): where each part lies in the GGUF."""
        s = self.spec
        out = {}
        for p in PARTS:
            gname, sl = self._expert_src(layer, p)
            if gname is None:
                t = self.raw[self.split[(layer, e, p)]]
                out[p] = (int(t.data_offset), int(t.n_bytes))
                continue
            t = self.raw[gname]
            rows = int(np.prod(self._ne(gname)[1:]))
            row = int(t.n_bytes) // rows
            per = rows // s.num_experts
            first, n = (e * per, per) if sl is None else (e * per + sl[0], sl[1])
            out[p] = (int(t.data_offset) + first * row, n * row)
        return out

    def expert_shapes(self) -> dict[str, tuple]:
        d, ff = self.spec.hidden_size, self.spec.moe_intermediate_size
        return {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        raw, kinds, shapes = self.expert_raw(layer, e), self.expert_kinds(layer), self.expert_shapes()
        try:
            return {p: (raw[p].view(np.float32).reshape(shapes[p]).copy() if kinds[p] == "f32"
                        else dequantize(raw[p], kinds[p][5:], shapes[p])) for p in PARTS}
        except ValueError as err:
            raise WorkbenchError(f"{self.path}: expert {e} of layer {layer} does not hold the shape its metadata gives "
                                 f"({err}; corrupt GGUF)") from None

    # ------------------------------------------------------------ source and tokenizer

    def source_info(self) -> dict:
        st = self.path.stat()
        h = hashlib.sha256()
        with open(self.path, "rb") as f:                  # the header region: metadata and tensor table
            h.update(f.read(min(st.st_size, int(self.reader.data_offset))))
        return {"path": str(self.path.resolve()), "format": "gguf", "architecture": self.arch,
                "file_size": st.st_size, "header_sha256": h.hexdigest(),
                **({"mtp_layers": self.mtp_layers} if self.mtp_layers else {})}

    def tokenizer_json(self) -> str | None:
        """A byte-level BPE tokenizer.json from tokenizer.ggml.* (gpt2 model only), or None."""
        pre = self.meta("tokenizer.ggml.pre", "default")
        if self.meta("tokenizer.ggml.model") != "gpt2" or pre not in _PRE:
            return None
        tokens = self.meta("tokenizer.ggml.tokens") or []
        types = self.meta("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = self.meta("tokenizer.ggml.merges") or []
        vocab, added = {}, []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (3, 4):      # CONTROL, USER_DEFINED
                added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": ty == 4, "special": ty == 3})
            if ty != 5 or not t.startswith("[PAD"):       # UNUSED padding rows are not tokens
                vocab[t] = i
        tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
              "pre_tokenizer": _PRE[pre],
              "post_processor": None,
              "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
              "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                        "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]}}
        return json.dumps(tj, ensure_ascii=False)
