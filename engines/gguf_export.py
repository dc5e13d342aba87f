"""Write a workbench Qwen3-MoE model as a GGUF file that stock llama.cpp runs (architecture `qwen3moe`).

    export_gguf(HFModel("data/models/demo-moe"), "demo.gguf", "f16")     # or "q8_0"

Tensor names and layout follow llama.cpp's convert_hf_to_gguf.py for Qwen3MoeForCausalLM:
token_embd, blk.N.attn_norm / attn_q / attn_k / attn_v / attn_output / attn_q_norm / attn_k_norm /
ffn_norm / ffn_gate_inp / ffn_{gate,up,down}_exps (experts stacked: numpy (E, ff, d), GGUF ne
[d, ff, E]), output_norm, output. Norms and the router stay F32 (the converter keeps FFN_GATE_INP in
F32); the other matrices are F16, or Q8_0 where a row splits into 32-value blocks. Q and K are written
as they are: qwen3 uses NEOX RoPE (rotate-half, as in Hugging Face), so there is no llama-style permute.

The tokenizer goes in as llama.cpp's gpt2 BPE: tokens, token types, merges, `tokenizer.ggml.pre = gpt-2`
(the GPT-2 split regex; llama.cpp rejects the spelling `gpt2`). Weights are read one tensor at a time
and streamed to a temporary file that is renamed into place.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from engines.gguf_export_hybrid import ARCH as HYBRID_ARCH, hybrid_metadata, hybrid_plan
from workbench.atomic import atomic_path
from workbench.errors import WorkbenchError

TYPES = ("f16", "q8_0")
PARTS = ("gate", "up", "down")
F16_MAX = 65504.0


def _gguf():
    try:
        import gguf
    except ImportError:
        raise WorkbenchError("GGUF export needs the gguf package: pip install -e '.[llamacpp]'") from None
    return gguf


class PackModel:
    """A workbench pack seen through the HFModel interface (names, tensor, expert), for export."""

    def __init__(self, pack):
        self.pack, self.spec, self.path = pack, pack.spec, pack.path

    def names(self):
        return list(self.pack.tensors)

    def tensor(self, name):
        return self.pack.tensor(name)

    def expert(self, layer, e):
        return self.pack.decode_expert(layer, e, self.pack.expert_bytes(layer, e))


def tokenizer_text(model) -> str | None:
    if hasattr(model, "pack"):
        return model.pack.header.get("tokenizer")
    p = Path(model.path) / "tokenizer.json"
    return p.read_text(encoding="utf-8") if p.exists() else None


def gguf_vocab(tokenizer_json: str, vocab_size: int, where: str = "tokenizer.json"):
    """(tokens, token types, merges) as llama.cpp's gpt2 vocab wants them; refuses other tokenizers."""
    gguf = _gguf()
    tj = json.loads(tokenizer_json)
    model, pre = tj.get("model", {}), tj.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
            or pre.get("add_prefix_space") or tj.get("normalizer"):
        raise WorkbenchError(f"{where}: only a byte-level BPE tokenizer with the GPT-2 split regex (no normalizer, "
                             f"no prefix space) exports as llama.cpp's gpt2/gpt-2 vocabulary")
    rev = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        rev[i] = a["content"]
    if rev and max(rev) >= vocab_size:
        raise WorkbenchError(f"{where}: token id {max(rev)} does not fit the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(rev[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def _check(spec, where):
    why = None
    if spec.family != "qwen3_moe" and spec.family not in HYBRID_ARCH:
        why = (f"family {spec.family!r}: only qwen3_moe, qwen3_next, qwen3_5_moe and minicpmv4_7's language model "
               f"export (as llama.cpp's qwen3moe, qwen3next, qwen35moe)")
    elif spec.dense_layers:
        why = "dense MLP layers (mlp_only_layers / decoder_sparse_step): llama.cpp's qwen3moe has experts in every layer"
    elif not spec.norm_topk_prob:
        why = "norm_topk_prob is false: llama.cpp's qwen3moe always renormalizes the top-k weights"
    elif spec.attention_bias:
        why = "attention biases: llama.cpp's qwen3moe has none"
    elif spec.rope_yarn:
        why = "YaRN rope scaling is not written by this exporter"
    if why:
        raise WorkbenchError(f"{where}: cannot export to GGUF: {why}")


def _plan(model, qtype: str):
    """[(gguf name, numpy shape, GGML type name, producer)] in file order."""
    s = model.spec
    names = set(model.names())
    plan = []

    def mat_type(shape):
        if qtype == "q8_0" and shape[-1] % 32 == 0:
            return "Q8_0"
        return "F16"

    def add(gname, canon, f32=False):
        shape = tuple(model.tensor_shape(canon)) if hasattr(model, "tensor_shape") else tuple(model.tensor(canon).shape)
        t = "F32" if f32 or len(shape) == 1 else mat_type(shape)
        plan.append((gname, shape, t, lambda: model.tensor(canon)))

    if s.layer_types:
        hybrid_plan(model, add, lambda *row: plan.append(row), mat_type)
        if "lm_head" in names and not s.tie_word_embeddings:
            add("output.weight", "lm_head")
        return plan
    add("token_embd.weight", "embed")
    for i in range(s.num_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "attn_norm")
        for c, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            add(b + g + ".weight", p + c)
        add(b + "attn_q_norm.weight", p + "q_norm", f32=True)
        add(b + "attn_k_norm.weight", p + "k_norm", f32=True)
        add(b + "ffn_norm.weight", p + "mlp_norm", f32=True)
        add(b + "ffn_gate_inp.weight", p + "router", f32=True)
        d, ff, E = s.hidden_size, s.moe_intermediate_size, s.num_experts
        for part, shape in (("gate", (E, ff, d)), ("up", (E, ff, d)), ("down", (E, d, ff))):
            plan.append((b + f"ffn_{part}_exps.weight", shape, mat_type(shape),
                         lambda i=i, part=part: np.stack([model.expert(i, e)[part] for e in range(E)])))
    add("output_norm.weight", "norm", f32=True)
    if "lm_head" in names and not s.tie_word_embeddings:
        add("output.weight", "lm_head")
    return plan


def _nbytes(shape, t: str) -> int:
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
    return int(np.prod(shape)) // block * size


def _encode(a: np.ndarray, t: str, gname: str) -> np.ndarray:
    gguf = _gguf()
    a = np.ascontiguousarray(a, dtype=np.float32)
    if t == "F32":
        return a
    if t == "F16":
        if np.abs(a).max(initial=0.0) > F16_MAX:
            raise WorkbenchError(f"{gname}: values beyond float16's range; export with --type q8_0")
        return a.astype(np.float16)
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[t])


def write_metadata(w, s, tokens, types, merges, name: str, file_type: int, mtp_layers: int = 0):
    """The architecture's hyperparameters and the gpt2 vocabulary, as llama.cpp reads them for `s` (and its MTP
    blocks after the main ones)."""
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_block_count(s.num_layers + mtp_layers)
    if mtp_layers:
        w.add_nextn_predict_layers(mtp_layers)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.dense_intermediate_size or s.moe_intermediate_size * s.top_k)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_expert_count(s.num_experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.moe_intermediate_size)
    if s.layer_types:
        hybrid_metadata(w, s)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if s.bos_token_id is not None:
        w.add_bos_token_id(s.bos_token_id)
    if s.eos_token_id is not None:
        w.add_eos_token_id(s.eos_token_id)
    w.add_add_bos_token(False)               # the workbench's tokenizer adds no BOS either


def export_gguf(model, out, qtype: str = "f16", tokenizer_json: str | None = None, progress: bool = False,
                name: str | None = None) -> Path:
    """Write `model` (HFModel-like, or a Pack) to `out` as a GGUF, atomically: qwen3moe, or qwen3next / qwen35moe
    for the hybrid family."""
    gguf = _gguf()
    if qtype not in TYPES:
        raise WorkbenchError(f"--type {qtype!r}: choose one of {', '.join(TYPES)} (k-quants: quantize with llama.cpp)")
    if hasattr(model, "expert_reads"):           # a Pack
        model = PackModel(model)
    s = model.spec
    where = str(model.path)
    _check(s, where)
    tok = tokenizer_json if tokenizer_json is not None else tokenizer_text(model)
    if not tok:
        raise WorkbenchError(f"{where}: no tokenizer.json; llama.cpp needs the vocabulary in the GGUF")
    tokens, types, merges = gguf_vocab(tok, s.vocab_size, where)
    plan = _plan(model, qtype)

    out = Path(out)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), HYBRID_ARCH.get(s.family, "qwen3moe"))
        try:
            write_metadata(w, s, tokens, types, merges, name or Path(model.path).stem,
                           gguf.LlamaFileType.MOSTLY_F16 if qtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0,
                           mtp_layers=int(any(g.startswith(f"blk.{s.num_layers}.") for g, *_ in plan)))
            for gname, shape, t, _ in plan:
                raw = None if t in ("F32", "F16") else gguf.GGMLQuantizationType[t]
                dt = np.float32 if t == "F32" else np.float16
                w.add_tensor_info(gname, shape, np.dtype(dt), _nbytes(shape, t), raw_dtype=raw)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            items = plan
            if progress:
                from tqdm.auto import tqdm
                items = tqdm(plan, desc="writing GGUF", unit="tensor")
            for gname, shape, t, make in items:
                buf = _encode(make(), t, gname)
                w.write_tensor_data(buf)
        finally:
            w.close()
    return out

