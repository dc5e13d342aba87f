"""The llama.cpp adapter: GGUF export and import, stock llama.cpp against our teacher, routing traces, replay.

GGUF export/import needs the `gguf` package; the tests that run llama.cpp need llama-cpp-python
(both in the `llamacpp` and `test` extras) and skip, with the reason, where it is not importable.
Every call into llama.cpp runs in a child process (tests/child.py): a native crash fails that test with
its signal, and the rest of the run goes on.

Tolerances (f16 export of bf16-rounded tiny weights, llama.cpp CPU):
  our engine on the imported f16 pack vs on the original (teacher): 1e-4 (the f16 copy of a bf16 value is
  exact except for f16 subnormals); q8_0: 0.15 absolute on logits of scale ~2-3.
  llama.cpp f16 vs our teacher: 3e-2 absolute on logits (llama.cpp rounds activations to f16 for its
  f16 matmuls); greedy tokens and text identical.
  routing: llama.cpp's top-k sets equal ours except where our own k-th and (k+1)-th router logits are
  within 2e-2 (a near-tie at f16 activation precision); near-ties are counted, not failed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

REQUIRED = bool(os.environ.get("WORKBENCH_REQUIRE_LLAMACPP"))   # CI: missing packages fail instead of skipping
if REQUIRED:
    import gguf
else:
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[llamacpp]')")
try:
    import llama_cpp  # noqa: F401
    NO_LLAMA = None
except Exception as e:  # ImportError, or a shared library that does not load
    if REQUIRED:
        raise
    NO_LLAMA = f"llama-cpp-python is not importable ({type(e).__name__}: {e}); pip install -e '.[llamacpp]'"
needs_llama = pytest.mark.skipif(NO_LLAMA is not None, reason=NO_LLAMA or "")

from child import in_child                                    # noqa: E402
from engines.gguf_export import export_gguf                   # noqa: E402
from workbench.models.gguf_model import GGUFModel, _BLOCK, _GLOBAL  # noqa: E402
from workbench.models.hf import HFModel                       # noqa: E402
from workbench.errors import WorkbenchError                   # noqa: E402
from workbench.store.pack import Pack, convert                # noqa: E402

IDS = [5, 17, 200, 31, 64, 99, 150, 3, 250, 12, 77, 42]
LOGIT_TOL_F16 = 3e-2
TIE_GAP = 2e-2
GGUF_TOL = 6e-2    # ggml kernels (8-bit activations) vs the blocks dequantized in f32, of max |logit| (1.9-2.7% seen)
KQ_BATCH_TOL = 0.15   # llama.cpp's batched k-quant matmul vs its one-token path (0.05 seen on an AMD EPYC, logits ~3)
PROMPT = "Tom and his mom went to the park."   # our greedy path has no near-tie (min top-2 gap 0.05)


def teacher_logits(model, ids=IDS):
    from runtime.session import open_session
    with open_session(str(model), "teacher", budget="all") as s:
        s.engine.reset()
        return s.step(list(ids), "prefill")


@pytest.fixture(scope="session")
def q3(tiny_models):
    return tiny_models["qwen3_moe"]


@pytest.fixture(scope="session")
def deepseek_v2_lite(tmp_path_factory):
    """DeepSeek-V2-Lite's shape in small: softmax routing over all experts (greedy), no query down-projection."""
    from conftest import make_checkpoint
    return make_checkpoint("deepseek_v2", tmp_path_factory.mktemp("dsv2") / "lite", topk_method="greedy")


@pytest.fixture(scope="session")
def exported(q3, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    m = HFModel(q3)
    return {t: export_gguf(m, root / f"q3-{t}.gguf", t) for t in ("f16", "q8_0")}


# ---------------------------------------------------------------- export / import (gguf package only)

def test_export_writes_llamacpp_qwen3moe(q3, exported):
    g = GGUFModel(exported["f16"])
    assert g.arch == "qwen3moe"
    assert g.spec == HFModel(q3).spec
    assert g.meta("tokenizer.ggml.model") == "gpt2" and g.meta("tokenizer.ggml.pre") == "gpt-2"
    # every tensor name is one llama.cpp's converter writes for qwen3moe
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE]}
    for name in g.raw:
        base = name.rsplit(".", 1)[0]
        assert any(base == a.format(bid=i) for a in allowed for i in range(g.spec.num_layers)), name
    assert g._ne("blk.0.ffn_gate_exps.weight") == [g.spec.hidden_size, g.spec.moe_intermediate_size, g.spec.num_experts]
    assert g._ne("blk.0.ffn_down_exps.weight") == [g.spec.moe_intermediate_size, g.spec.hidden_size, g.spec.num_experts]
    types = {t.name: t.tensor_type.name for t in g.reader.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["blk.0.attn_q.weight"] == "F16"
    assert GGUFModel(exported["q8_0"]).raw["blk.1.ffn_up_exps.weight"].tensor_type.name == "Q8_0"
    # the vocabulary round-trips into a Hugging Face tokenizer that splits text the same way
    from tokenizers import Tokenizer
    mine, theirs = Tokenizer.from_str(g.tokenizer_json()), Tokenizer.from_file(str(q3 / "tokenizer.json"))
    text = PROMPT + "\n\n  She said: \"Let's go!\" 123 4567."
    assert mine.encode(text).ids == theirs.encode(text).ids
    assert mine.decode(mine.encode(text).ids) == text


@pytest.mark.parametrize("qtype,tol", [("f16", 1e-4), ("q8_0", 0.15)])
def test_import_round_trip(q3, exported, tmp_path, qtype, tol):
    g = GGUFModel(exported[qtype])
    raw_path = convert(exported[qtype], tmp_path / "raw.pack", experts="raw", rest="raw")
    pack = Pack(raw_path)
    kind = "gguf:F16" if qtype == "f16" else "gguf:Q8_0"
    assert pack.expert_kinds == {"gate": kind, "up": kind, "down": kind}
    assert pack.header.get("tokenizer") and pack.header["source"]["format"] == "gguf"
    with open(raw_path, "rb") as f:                 # experts on disk are the GGUF's bytes, unchanged
        for L, e in [(0, 0), (1, 5), (1, 7)]:
            (off, n), = pack.expert_reads(L, e)
            f.seek(off)
            span = f.read(n)
            want = g.expert_raw(L, e)
            for p, (o, m) in pack.expert_layers[L][e]["parts"].items():
                assert span[o - off:o - off + m] == want[p].tobytes()
    ref = teacher_logits(q3)
    z = teacher_logits(raw_path)
    assert np.abs(z - ref).max() < tol
    if qtype == "f16":
        assert (z.argmax(-1) == ref.argmax(-1)).all()
        # decoded and re-encoded into the workbench's own kinds works too (bf16 holds these weights exactly)
        z2 = teacher_logits(convert(exported[qtype], tmp_path / "bf16.pack", experts="bf16", rest="bf16"))
        assert np.abs(z2 - ref).max() < tol


def _permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (Q and K of llama-architecture GGUFs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family_gguf(src: Path, arch: str, out: Path, legacy_kv_b: bool = False, tokenizer: bool = False) -> Path:
    """A GGUF of a tiny Hugging Face checkpoint as llama.cpp's converter lays it out for `arch` (all F32).
    deepseek2: latent attention as an MQA of one head, kv_b split for absorbed attention (k_b transposed per
    head) unless `legacy_kv_b` (one attn_kv_b and no *_mla lengths, as older converters wrote it)."""
    m = HFModel(src)
    s = m.spec
    inv = {v: k for k, v in _GLOBAL.items()}
    inv_block = {v: k for k, v in _BLOCK.items()}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(s.num_layers)
    w.add_context_length(s.max_position_embeddings)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(s.dense_intermediate_size or s.moe_intermediate_size)
    w.add_head_count(s.num_heads)
    w.add_rope_freq_base(s.rope_theta)
    if s.rope_yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.rope_yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(s.rope_yarn["original_max_position_embeddings"])
        if arch == "deepseek2":   # convert_hf_to_gguf's [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]
            w.add_rope_scaling_yarn_log_mul(0.1 * s.rope_yarn["mscale_all_dim"])
    w.add_layer_norm_rms_eps(s.rms_norm_eps)
    w.add_expert_count(s.num_experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.moe_intermediate_size)
    if s.attention == "mla":
        w.add_head_count_kv(1)
        w.add_q_lora_rank(s.q_lora_rank)
        w.add_kv_lora_rank(s.kv_lora_rank)
        w.add_rope_dimension_count(s.qk_rope_head_dim)
        w.add_vocab_size(s.vocab_size)
        if legacy_kv_b:
            w.add_key_length(s.head_dim)
            w.add_value_length(s.v_head_dim)
        else:
            w.add_key_length(s.kv_lora_rank + s.qk_rope_head_dim)
            w.add_value_length(s.kv_lora_rank)
            w.add_key_length_mla(s.head_dim)
            w.add_value_length_mla(s.v_head_dim)
    else:
        w.add_head_count_kv(s.num_kv_heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.bos_token_id is not None:
        w.add_bos_token_id(s.bos_token_id)
    if s.eos_token_id is not None:
        w.add_eos_token_id(s.eos_token_id)
    if tokenizer:
        from engines.gguf_export import gguf_vocab
        tokens, types, merges = gguf_vocab((src / "tokenizer.json").read_text(), s.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(s.shared_expert_size)
    if arch in ("dots1", "deepseek2"):
        w.add_leading_dense_block_count(len(s.dense_layers))
        w.add_expert_shared_count(s.shared_expert_size // s.moe_intermediate_size)
        if s.n_group > 1:
            w.add_expert_group_count(s.n_group)
            w.add_expert_group_used_count(s.topk_group)
        w.add_expert_weights_scale(s.routed_scaling_factor)
        w.add_expert_weights_norm(s.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if s.router == "sigmoid_group"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    for name in m.names():
        a = m.tensor(name)
        if name in inv:
            gname = inv[name]
        else:
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{inv_block[rest]}"
            if arch == "llama" and rest in ("q", "k"):
                a = _permute(a, s.num_heads if rest == "q" else s.num_kv_heads)
            if rest == "kv_b" and not legacy_kv_b:     # convert_hf_to_gguf's DeepseekV2Model split
                kv_b = a.reshape(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
                w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(
                    kv_b[:, :s.qk_nope_head_dim].transpose(0, 2, 1), np.float32))
                w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, s.qk_nope_head_dim:], np.float32))
                continue
        w.add_tensor(gname, np.ascontiguousarray(a, np.float32))
    for i in s.moe_layers:
        for p in ("gate", "up", "down"):
            w.add_tensor(f"blk.{i}.ffn_{p}_exps.weight",
                         np.stack([m.expert(i, e)[p] for e in range(s.num_experts)]).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("family,arch,legacy", [("qwen2_moe", "qwen2moe", False), ("olmoe", "olmoe", False),
                                                ("mixtral", "llama", False), ("dots1", "dots1", False),
                                                ("deepseek_v3", "deepseek2", False), ("deepseek_v3", "deepseek2", True),
                                                ("deepseek_v2_lite", "deepseek2", False)])
def test_import_other_families(tiny_models, deepseek_v2_lite, tmp_path, family, arch, legacy):
    src = deepseek_v2_lite if family == "deepseek_v2_lite" else tiny_models[family]
    family = family.removesuffix("_lite")
    path = write_family_gguf(src, arch, tmp_path / f"{family}.gguf", legacy_kv_b=legacy)
    g = GGUFModel(path)
    want = HFModel(src).spec
    assert g.spec.family == family
    assert {k: v for k, v in g.spec.to_dict().items() if k != "dense_intermediate_size"} == \
           {k: v for k, v in want.to_dict().items() if k != "dense_intermediate_size"}
    pack = convert(path, tmp_path / f"{family}.pack", experts="raw", rest="raw")
    z = teacher_logits(pack)
    assert np.abs(z - teacher_logits(src)).max() < 1e-4
    # streamed in place: the index keeps what is made on read (llama's un-permuted Q/K, deepseek2's joined kv_b)
    from workbench.registry import resolve_pack
    index, raw = Pack(resolve_pack(str(path), "native", "raw", "raw")), Pack(pack)
    assert all(np.array_equal(index.tensor_bytes(n), raw.tensor_bytes(n)) for n in raw.tensors)
    np.testing.assert_array_equal(teacher_logits(path), z)


def test_refuses_what_moespec_cannot_express(tmp_path):
    def write(arch, tensors):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        w.add_block_count(1)
        for n, shape in tensors:
            w.add_tensor(n, np.zeros(shape, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return p
    with pytest.raises(WorkbenchError, match="not a supported MoE family"):
        GGUFModel(write("gpt2", [("token_embd.weight", (8, 4))]))
    with pytest.raises(WorkbenchError, match="no place in a workbench MoE model"):
        GGUFModel(write("deepseek2", [("blk.0.nextn.eh_proj.weight", (8, 4))]))   # a multi-token-prediction block
    with pytest.raises(WorkbenchError, match="not an MoE|expert_count"):
        GGUFModel(write("llama", [("token_embd.weight", (8, 4))]))
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(WorkbenchError, match="not a readable GGUF"):
        GGUFModel(bad)


def test_replay_of_a_numpy_trace(q3, tmp_path):
    from experiments.simulate import replay
    from experiments.traces import capture_numpy, read_trace, write_trace
    ids = np.random.default_rng(0).integers(0, 320, 96).tolist()
    tr, meta = capture_numpy(str(q3), ids)
    from experiments.routing_trace import named_predictions
    from experiments.traces import _weights_for
    from workbench.spec import MoESpec
    spec = MoESpec.from_dict(meta["spec"])
    out = write_trace(tmp_path / "t.parquet", tr, ids, meta,
                      predictions=named_predictions(tr, spec, _weights_for(meta, None, spec)))
    back = read_trace(out)
    assert back["ids"] == ids and np.array_equal(back["topk"], tr["topk"])
    res = replay(out, ["on_demand", "les", "oracle"], "0.5")
    d = {r["preset"]: r for r in res["presets"]}
    assert d["oracle"]["prefetch_recall"] == 1.0 and d["on_demand"]["prefetch_recall"] is None and 0 < d["les"]["prefetch_recall"] <= 1
    assert d["oracle"]["hit_rate"] >= d["on_demand"]["hit_rate"]
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in res["presets"])
    assert replay(out, ["on_demand"], "all")["presets"][0]["hit_rate"] > d["on_demand"]["hit_rate"]


# ---------------------------------------------------------------- stock llama.cpp

def llama_run(path, prompt, tokens):
    """In llama.cpp: the prompt's token ids, their logits as one batch, greedy tokens and their text."""
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=256) as llm:
        ids = llm.tokenize(prompt)
        llm.reset()
        z = llm.forward(ids)
        gen = llm.generate(ids, tokens)["tokens"]
        return {"ids": ids, "logits": z, "tokens": gen, "text": llm.detokenize(gen)}


def llama_logits(path, ids, one_by_one: bool = False):
    """In llama.cpp: logits of `ids` decoded as one batch, or one token at a time."""
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=256) as llm:
        llm.reset()
        return np.concatenate([llm.forward([i]) for i in ids]) if one_by_one else llm.forward(ids)


def quantized_batch_and_steps(f16, dst, qtype, ids):
    """In llama.cpp: quantize, then the logits of `ids` as one batch and one token at a time."""
    from engines.llamacpp_engine import quantize_gguf
    q = quantize_gguf(f16, dst, qtype)
    return llama_logits(q, ids), llama_logits(q, ids, one_by_one=True)


def cli_json(*argv) -> dict:
    """`python -m workbench ARGV --json` in this process: its JSON object."""
    import contextlib
    import io
    from cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv) + ["--json"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


@needs_llama
def test_llamacpp_runs_the_export_like_our_teacher(q3, exported):
    from runtime.session import open_session
    theirs = in_child(llama_run, exported["f16"], PROMPT, 16)
    with open_session(str(q3), "teacher", budget="all") as s:
        ids = s.encode(PROMPT)
        assert theirs["ids"] == ids
        ref = teacher_logits(q3, ids)
        z = theirs["logits"]
        assert z.shape == ref.shape
        assert np.abs(z - ref).max() < LOGIT_TOL_F16, np.abs(z - ref).max()
        ours = s.generate(ids, tokens=16)
    assert theirs["tokens"] == ours["tokens"]
    assert theirs["text"] == ours["text"]


@needs_llama
def test_llamacpp_trace_matches_our_routing(q3, exported, tmp_path):
    from engines.llamacpp_engine import capture_trace
    from experiments.traces import capture_numpy
    ids = np.random.default_rng(1).integers(0, 320, 64).tolist()
    theirs = in_child(capture_trace, exported["f16"], ids)
    ours, _ = capture_numpy(str(q3), ids)
    assert theirs["moe_layers"] == ours["moe_layers"]
    assert theirs["topk"].shape == ours["topk"].shape
    assert np.abs(theirs["router_input"] - ours["router_input"]).max() < LOGIT_TOL_F16
    assert np.abs(theirs["logits"] - ours["logits"]).max() < LOGIT_TOL_F16
    k = ours["topk"].shape[-1]
    same = (np.sort(theirs["topk"], -1) == np.sort(ours["topk"], -1)).all(-1)
    s = np.sort(ours["logits"], -1)
    gap = s[..., -k] - s[..., -k - 1]
    assert (same | (gap < TIE_GAP)).all(), f"top-k differs beyond near-ties at {np.argwhere(~same & (gap >= TIE_GAP))}"
    assert same.mean() > 0.9


@pytest.fixture(scope="session")
def kquant_model(tmp_path_factory):
    """A tiny Qwen3-MoE whose rows split into 256-value k-quant blocks (d = ff = 256)."""
    import torch
    import transformers as tf
    from conftest import tiny_tokenizer
    path = tmp_path_factory.mktemp("kq") / "q3-256"
    torch.manual_seed(3)
    cfg = tf.Qwen3MoeConfig(vocab_size=320, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
                            norm_topk_prob=True, tie_word_embeddings=False)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * (0.3 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0))
                    .to(torch.bfloat16).float())
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(path / "tokenizer.json")
    return path


@needs_llama
@pytest.mark.parametrize("qtype,block", [("q4_k_m", "Q4_K"), ("q3_k_m", "Q3_K"), ("q2_k", "Q2_K")])
def test_kquant_import_keeps_blocks(kquant_model, tmp_path, qtype, block):
    from engines.llamacpp_engine import quantize_gguf
    f16 = export_gguf(HFModel(kquant_model), tmp_path / "f16.gguf", "f16")
    q = in_child(quantize_gguf, f16, tmp_path / f"{qtype}.gguf", qtype)
    g = GGUFModel(q)
    kinds = {p: k for L in g.spec.moe_layers for p, k in g.expert_kinds(L).items()}
    assert f"gguf:{block}" in kinds.values(), kinds
    pack = Pack(convert(q, tmp_path / "kq.pack", experts="raw", rest="raw"))
    assert pack.expert_layer_kinds == {L: g.expert_kinds(L) for L in g.spec.moe_layers}
    with open(pack.path, "rb") as f:
        for L in g.spec.moe_layers:
            for e in range(g.spec.num_experts):
                (off, n), = pack.expert_reads(L, e)
                f.seek(off)
                chunk = np.frombuffer(f.read(n), np.uint8)
                want = g.expert_raw(L, e)
                for p, (o, m) in pack.expert_layers[L][e]["parts"].items():
                    assert chunk[o - off:o - off + m].tobytes() == want[p].tobytes()
                w = pack.decode_expert(L, e, [chunk])
                ref = g.expert(L, e)
                assert all(np.array_equal(w[p], ref[p]) for p in w)
    # The same quantized weights in our engine and in llama.cpp give the same logits: llama.cpp rounds
    # activations to 8 bits for its k-quant dot products, so they differ by ~0.1 where quantization itself
    # moves logits by 1-2.5. A routing flip at a near-tie changes a token's output (and, through attention,
    # the later tokens'): compare the tokens before the first token whose routing differs.
    from engines.llamacpp_engine import capture_trace
    from experiments.traces import capture_numpy
    theirs = in_child(capture_trace, q, IDS)
    ours, _ = capture_numpy(str(pack.path), IDS)
    same = (np.sort(theirs["topk"], -1) == np.sort(ours["topk"], -1)).all(-1).all(-1)
    t0 = len(IDS) if same.all() else int(np.argmin(same))
    assert t0 >= len(IDS) // 2, f"routing differs from token {t0}"
    z = teacher_logits(pack.path, IDS)
    assert np.abs(z[:t0] - theirs["final_logits"][:t0]).max() < 0.15
    assert np.abs(z - teacher_logits(kquant_model, IDS)).mean() > 0.05      # quantization did change the model


@needs_llama
@pytest.mark.parametrize("kind,shape", [("Q4_K", (48, 512)), ("Q5_K", (16, 256)), ("Q6_K", (40, 256)),
                                        ("Q3_K", (16, 512)), ("Q2_K", (16, 256)), ("Q8_0", (48, 96)),
                                        ("Q4_0", (16, 128)), ("Q5_0", (24, 64)), ("F16", (16, 72)), ("BF16", (8, 64))])
def test_ggml_dot_is_the_dequantized_matrix_times_x(kind, shape):
    """ggml's CPU dot products, called on GGUF blocks (engines/ggml_kernels.py), against the blocks dequantized by
    the gguf package times x in float64: within 2e-2 of max |Wx| (ggml rounds x to 8 bits for the quantized
    types; F16 and BF16 round x to their own type)."""
    import ctypes
    from engines import ggml_kernels as G
    from workbench.models.gguf_model import dequantize
    base = ctypes.CDLL(G.library("ggml-base"))
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
        ctypes.c_void_p]
    rng = np.random.default_rng(len(kind) + shape[0])
    w, x = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
    row_bytes = G.part(f"gguf:{kind}", shape[1])[0]
    blocks = np.zeros(shape[0] * row_bytes, np.uint8)
    assert base.ggml_quantize_chunk(G.type_id(f"gguf:{kind}"), w.ctypes.data, blocks.ctypes.data, 0, *shape,
                                    None) == blocks.nbytes
    ref = dequantize(blocks, kind, shape).astype(np.float64) @ x
    np.testing.assert_allclose(G.matvec(blocks, shape, f"gguf:{kind}", x), ref, atol=2e-2 * np.abs(ref).max(), rtol=0)
    if kind not in ("F16", "BF16"):
        with pytest.raises(WorkbenchError, match=kind):
            G.part(f"gguf:{kind}", 3 * 1024 + 16)       # a row that does not split into the type's blocks


def prompt_logits(path, engine):
    """The logits of IDS as one prompt, all experts resident, and the top-k each MoE layer routed each position to
    (sorted): (layers, positions, k)."""
    from runtime.capture import RoutingCapture
    from runtime.session import open_session
    with open_session(str(path), "resident", engine=engine) as s, RoutingCapture(s) as cap:
        s.engine.reset()
        z = s.step(IDS, "prefill")
        return z, np.stack([np.sort(r["idx"], -1) for r in cap.records])


def packed_logits(path, preset, engine="packed", **kw):
    """Prefill IDS[:8], then decode the rest one token at a time: the logits of every position."""
    from runtime.session import open_session
    with open_session(str(path), preset, engine=engine, **kw) as s:
        s.engine.reset()
        return np.concatenate([s.step(IDS[:8], "prefill")] + [s.step([t], "decode") for t in IDS[8:]]), s.engine.name


@needs_llama
@pytest.mark.parametrize("qtype", ["q4_k_m", "q3_k_m", "q2_k", "q6_k", "q4_0"])
def test_packed_engine_computes_gguf_blocks_with_ggml(kquant_model, tmp_path, qtype):
    """A raw GGUF pack's experts are computed by ggml's own CPU kernels from the slot bytes as read
    (engines/ggml_kernels.py): logits within GGUF_TOL of the numpy engine on the same blocks dequantized by the gguf
    package (ggml rounds the activations to 8 bits, as llama.cpp does), and every exact design at every budget
    gives the logits of the packed engine all-resident, bit for bit."""
    from engines.llamacpp_engine import quantize_gguf
    f16 = export_gguf(HFModel(kquant_model), tmp_path / "f16.gguf", "f16")
    q = in_child(quantize_gguf, f16, tmp_path / f"{qtype}.gguf", qtype)
    pack = convert(q, tmp_path / "raw.pack", experts="raw", rest="raw")
    if qtype == "q4_k_m":       # its layers keep different types (Q4_K, Q6_K downs): slots laid out per layer
        assert len({tuple(k.values()) for k in Pack(pack).expert_layer_kinds.values()}) > 1
    (ref, ref_topk), (out, topk) = prompt_logits(pack, "numpy"), prompt_logits(pack, "packed")
    # 8-bit activations move the router's scores a little: compare the positions before the first that routes
    # differently (a flip at a near-tie changes that token's output, and through attention the later ones')
    same = (ref_topk == topk).all(-1).all(0)
    t0 = len(IDS) if same.all() else int(np.argmin(same))
    assert t0 >= len(IDS) // 2, f"routing differs from position {t0}"
    err = np.abs(out[:t0] - ref[:t0]).max() / np.abs(ref[:t0]).max()
    assert err < GGUF_TOL, err
    assert (out[:t0].argmax(-1) == ref[:t0].argmax(-1)).mean() >= 0.9
    out, eng = packed_logits(pack, "resident")
    assert eng == "packed"
    for preset, budget in [("on_demand", "0.25"), ("les", "0.5"), ("smol", "0.5"), ("history", "0.5")]:
        got, _ = packed_logits(pack, preset, budget=budget)
        np.testing.assert_array_equal(got, out, err_msg=f"{preset} at {budget}")
    got, eng = packed_logits(q, "les", budget="0.25")       # the GGUF itself, streamed where its blocks lie
    assert eng == "packed"
    np.testing.assert_array_equal(got, out, err_msg="the GGUF streamed in place")


@needs_llama
@pytest.mark.parametrize("experts,block", [("g4", "Q4_K"), ("g3", "Q3_K"), ("g2", "Q2_K"), ("g8", "Q8_0")])
def test_checkpoint_experts_in_ggml_blocks(kquant_model, tmp_path, experts, block):
    """--experts g2..g8 on a checkpoint: each expert matrix is ggml's own quantizer's blocks of the checkpoint's
    weights (rows of 256: the k-quant), the numpy engine's copy is ggml's own dequantization of them element for
    element, the packed engine's logits are within GGUF_TOL of the numpy engine's on the same pack (ggml's kernels,
    8-bit activations), and every exact design at a budget gives the packed engine's all-resident logits bit for
    bit."""
    from engines import ggml_kernels as G
    from workbench.store.ggml_blocks import quantize
    pack = Pack(convert(kquant_model, tmp_path / f"{experts}.pack", experts=experts))
    assert pack.quant["experts"] == experts
    assert pack.expert_kinds == {p: f"gguf:{block}" for p in ("gate", "up", "down")}
    hf, L = HFModel(kquant_model), pack.spec.moe_layers[-1]
    for e in (0, pack.spec.num_experts - 1):
        chunks = [np.frombuffer(open(pack.path, "rb").read()[o:o + n], np.uint8) for o, n in pack.expert_reads(L, e)]
        raw, f32, w = pack.decode_expert(L, e, chunks, raw=True), pack.decode_expert(L, e, chunks), hf.expert(L, e)
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(raw[p], quantize(w[p], f"gguf:{block}").reshape(-1), err_msg=p)
            np.testing.assert_array_equal(f32[p], G.dequantize(raw[p], pack.expert_shapes[p], f"gguf:{block}"))
    ref, out = packed_logits(pack.path, "resident", "numpy"), packed_logits(pack.path, "resident")
    assert (ref[1], out[1]) == ("numpy", "packed")
    err = np.abs(out[0] - ref[0]).max() / np.abs(ref[0]).max()
    assert err < GGUF_TOL, err
    for preset, budget in [("on_demand", "0.25"), ("les", "0.5")]:
        got, _ = packed_logits(pack.path, preset, budget=budget)
        np.testing.assert_array_equal(got, out[0], err_msg=f"{preset} at {budget}")


@needs_llama
def test_the_packed_engine_takes_every_core_where_it_computes_a_long_token_faster(tiny_models):
    import numba
    from engines.packed_engine import ThreadChoice
    from runtime.session import open_session
    cores = numba.config.NUMBA_NUM_THREADS
    with open_session(str(tiny_models["qwen3_moe"]), "les", budget="0.5") as s:
        assert s.engine.choice is not None
        s.generate([1, 2, 3], tokens=4)
        assert s.engine.threads == 1            # a tiny model's token is far too short for threads to pay
    with open_session(str(tiny_models["qwen3_moe"]), "les", budget="0.5", threads=cores) as s:
        assert s.engine.threads == cores and s.engine.choice is None
    c = ThreadChoice(4)
    picked = []
    for _ in range(2 + 16 + 32 + 64):   # one thread computes a token in 1 s, four in 2 s: one, but for a look
        n = c.pick()                    # at four after 16 tokens, then 32, then 64
        picked.append(n)
        c.took(n, 1.0 if n == 1 else 2.0)
    assert picked[:2] == [1, 4] and [i for i, n in enumerate(picked) if n == 4] == [1, 17, 49, 113]
    for _ in range(128 + 20):           # four become the faster: the next look moves there, and stays
        n = c.pick()
        c.took(n, 0.5 if n == 4 else 1.0)
    assert c.best == 4 and c.pick() == 4
    short = ThreadChoice(4)             # a token of 10 ms on one thread: every core is never tried
    for _ in range(300):
        n = short.pick()
        assert n == 1
        short.took(n, 0.010)
    assert ThreadChoice(1).counts == [1] and [ThreadChoice(1).pick() for _ in range(20)] == [1] * 20


def test_packed_engine_defaults_to_ggml_blocks_and_the_others_to_affine(tiny_models, tmp_path):
    """A preset's q2..q8 is ggml's blocks at those bits for the packed engine (the default), the affine group-64
    format for the numpy, MLX and llama.cpp engines and where a run names experts= itself; rows that are not a
    multiple of 256 take the 32-blocks (Q4_0; Q8_0 for g8)."""
    from workbench.presets import get_preset
    from workbench.registry import storage_for
    from runtime.session import open_session
    les, teacher = get_preset("les").storage, get_preset("teacher").storage
    for engine in (None, "packed"):
        assert storage_for("demo", les, engine=engine) == ("contiguous", "g3", "q4")
        assert storage_for("demo", les, {"experts"}, engine) == ("contiguous", "q3", "q4")
        assert storage_for("demo", teacher, engine=engine) == ("native", "raw", "raw")   # bf16: in place
    for engine in ("numpy", "mlx", "llamacpp"):
        assert storage_for("demo", les, engine=engine) == ("contiguous", "q3", "q4")
    assert storage_for("x.gguf", les) == ("native", "raw", "raw")
    with open_session(str(tiny_models["qwen3_moe"]), "on_demand", budget="0.5") as s:     # rows of 64
        assert (s.engine.name, s.preset.storage.experts, s.pack.quant["experts"]) == ("packed", "g4", "g4")
        assert s.pack.expert_kinds == {p: "gguf:Q4_0" for p in ("gate", "up", "down")}
        assert storage_for(str(s.pack_path), les) == ("contiguous", "q3", "q4")    # a pack: no conversion to name
    assert Pack(convert(tiny_models["qwen3_moe"], tmp_path / "g8.pack", experts="g8")).expert_kinds["down"] == \
        "gguf:Q8_0"
    with pytest.raises(WorkbenchError, match="rows of 48 values do not split into ggml's blocks of 32"):
        from workbench.store.ggml_blocks import block_kind
        block_kind("g4", 48)
    from workbench.store.pack import expert_kinds       # ggml computes an expert whole: else all of it stays affine
    assert expert_kinds({"gate": (16, 64), "up": (16, 64), "down": (64, 16)}, "g2") == \
        {"gate": "q2", "up": "q2", "down": "bf16"}


@needs_llama
@pytest.mark.parametrize("qtype", ["q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k", "q4_0"])
def test_kquant_batches_decode_like_single_tokens(kquant_model, tmp_path, qtype):
    """Batches of 2+ tokens go through llama.cpp's batched k-quant matmuls (the path ggml's AMX kernel takes on
    Intel CPUs with AMX); one token at a time goes through the vector path. Both give the same logits."""
    f16 = export_gguf(HFModel(kquant_model), tmp_path / "f16.gguf", "f16")
    batch, steps = in_child(quantized_batch_and_steps, f16, tmp_path / f"{qtype}.gguf", qtype, IDS)
    assert batch.shape == (len(IDS), 320) and np.isfinite(batch).all()
    assert np.abs(batch - steps).max() < KQ_BATCH_TOL, np.abs(batch - steps).max()


def model_buffers(path) -> list[str]:
    """The buffers llama.cpp puts a model's weights in, from its load log."""
    import ctypes
    from engines.llamacpp_engine import LlamaCpp, _init
    lines = []
    lc = _init()["lc"]
    cb = lc.llama_log_callback(lambda level, text, user: lines.append(text.decode()))
    lc.llama_log_set(cb, ctypes.c_void_p(0))
    LlamaCpp(path, n_ctx=64).close()
    return [line.split("load_tensors:")[1].split(" model buffer")[0].strip() for line in lines
            if "model buffer size" in line]


@needs_llama
def test_weights_stay_in_plain_cpu_buffers(kquant_model, tmp_path):
    """No extra CPU buffer type (AMX, KleidiAI, repacked q4_0/q4_K): on this CPU or any other, llama.cpp runs its
    plain kernels. (Without the setting, an AVX2 CPU repacks q4_0 into CPU_REPACK and an AMX one into AMX.)"""
    from engines.llamacpp_engine import quantize_gguf
    f16 = export_gguf(HFModel(kquant_model), tmp_path / "f16.gguf", "f16")
    q = in_child(quantize_gguf, f16, tmp_path / "q4_0.gguf", "q4_0")
    assert in_child(model_buffers, q) == ["CPU_Mapped"]


@needs_llama
def test_cli_verbs(q3, exported, tmp_path, capsys):
    from cli import main

    def run(*argv):
        assert main(list(argv) + ["--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    out = run("export-gguf", "--model", str(q3), str(tmp_path / "e.gguf"), "--type", "q8_0")
    assert out["architecture"] == "qwen3moe" and "Q8_0" in out["tensor_types"]
    info = run("info", "--model", str(tmp_path / "e.gguf"))
    assert info["kind"] == "gguf" and info["spec"]["num_experts"] == 8
    conv = run("convert", str(tmp_path / "e.gguf"), str(tmp_path / "e.pack"))
    assert conv["quant"] == {"experts": "raw", "rest": "raw"}
    t = in_child(cli_json, "trace", "--engine", "llamacpp", "--model", str(exported["f16"]), "--data", "tinystories",
                 "--tokens", "48", "--out", str(tmp_path / "t.parquet"))
    assert t["tokens"] == 48 and t["rows"] == 96
    rep = run("replay", str(tmp_path / "t.parquet"), "--preset", "les", "--budget", "0.5")
    assert [r["preset"] for r in rep["presets"]] == ["les"] and rep["presets"][0]["prefetch_recall"] > 0
    b = run("bench", "--engine", "llamacpp", "--model", str(exported["f16"]), "--tokens", "4", "--no-record")
    assert b["engine"] == "llamacpp" and b["tok_s"] > 0 and b["peak_rss_bytes"] > 0 and b["mode"] == "cold"
    assert b["n_gpu_layers"] == 0 and b["page_cache_dropped"] == "posix_fadvise(DONTNEED)"      # Linux: the CPU
    assert b["file_resident_before_bytes"] <= b["file_size"]
    assert main(["convert", str(q3), str(tmp_path / "x.pack"), "--experts", "raw"]) == 2
    assert "raw" in capsys.readouterr().err


@needs_llama
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2_lite", "deepseek_v3_yarn"])
def test_llamacpp_runs_deepseek2_like_transformers(tiny_models, deepseek_v2_lite, tmp_path, family):
    """Stock llama.cpp runs the deepseek2 layout the importer reads (absorbed latent attention, split kv_b, YaRN
    as DeepSeek configures it) and agrees with transformers; its routing trace agrees with ours on the import."""
    import torch
    from transformers import AutoModelForCausalLM
    from conftest import YARN, make_checkpoint
    from engines.llamacpp_engine import capture_trace
    from experiments.traces import capture_numpy
    src = {"deepseek_v3": tiny_models["deepseek_v3"], "deepseek_v2_lite": deepseek_v2_lite}.get(family) or \
        make_checkpoint("deepseek_v3", tmp_path / "yarn", rope_parameters=YARN["deepseek_v3"])
    path = write_family_gguf(src, "deepseek2", tmp_path / "ds.gguf", tokenizer=True)
    assert GGUFModel(path).spec == HFModel(src).spec
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(torch.tensor([IDS])).logits[0].numpy()
    z = in_child(llama_logits, path, IDS)
    assert np.abs(z - ref).max() < LOGIT_TOL_F16, np.abs(z - ref).max()
    pack = convert(path, tmp_path / "ds.pack", experts="raw", rest="raw")
    assert np.abs(teacher_logits(pack) - ref).max() < 1e-4
    theirs, (ours, _) = in_child(capture_trace, path, IDS), capture_numpy(str(pack), IDS)
    assert (np.sort(theirs["topk"], -1) == np.sort(ours["topk"], -1)).all()


@needs_llama
def test_a_routers_choice_in_one_call_is_the_norm_the_dot_products_and_the_top_k_apart():
    """G.top (the lookahead on a router kept in Q8_0: norm, ggml's dot products, selection bias, top-k in one call)
    names the experts that packed_kernels.rms_norm, G.dense, the bias and a stable sort's first k name, one row or a
    speculative batch's, at any thread count; and nearly those the float32 router names on the exact norm."""
    import numba
    from engines import ggml_kernels as G
    from engines import packed_kernels as K
    E, d, k, eps = 256, 512, 16, np.float32(1e-6)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((E, d)).astype(np.float32) * 0.05
    norm, bias = rng.random(d).astype(np.float32) + 0.5, rng.standard_normal(E).astype(np.float32) * 0.1
    blocks, p = G.quantize(w, "gguf:Q8_0").reshape(-1), G.part_row("gguf:Q8_0", d)
    before, shared = numba.get_num_threads(), []
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            for T in (1, 16):
                H = rng.standard_normal((T, d)).astype(np.float32) * 3
                X, Y = np.empty_like(H), np.empty((T, E), np.float32)
                K.rms_norm(H, norm, eps, X)
                G.dense(blocks, E, d, p, X, Y)
                if T == 1:                  # a router's one row runs on the calling thread: the same bits
                    Yp = np.empty_like(Y)
                    G._dense(blocks.ctypes.data, E, d, p, X, Yp)
                    assert blocks.nbytes <= G.ONE_THREAD_BYTES and (Yp == Y).all()
                top = G.top(blocks, E, d, p, H, norm, eps, bias, k)
                assert (top == np.argsort(-(Y + bias), axis=-1, kind="stable")[:, :k]).all()
                x64 = norm * H / np.sqrt((H.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
                exact = np.argsort(-(x64 @ w.T.astype(np.float64) + bias), axis=-1)[:, :k]
                shared += [len(set(a) & set(b)) / k for a, b in zip(top.tolist(), exact.tolist())]
    finally:
        numba.set_num_threads(before)
    assert np.mean(shared) >= 0.9, np.mean(shared)


@needs_llama
def test_a_layers_router_and_the_lookaheads_side_by_side_are_dense_and_top_apart():
    """G.routers (a MoE layer's own router on its normed input and the later layers' on its residual, one product
    a thread) gives G.dense's logits and G.top's choices, bit for bit, one or two later routers, at any thread
    count."""
    import numba
    from engines import ggml_kernels as G
    E, d, k, eps = 256, 512, 16, np.float32(1e-6)
    rng = np.random.default_rng(5)
    mats = [G.quantize(rng.standard_normal((E, d)).astype(np.float32) * 0.05, "gguf:Q8_0").reshape(-1)
            for _ in range(3)]
    p = G.part_row("gguf:Q8_0", d)
    norms = rng.random((2, d)).astype(np.float32) + 0.5
    biases = rng.standard_normal((2, E)).astype(np.float32) * 0.1
    x, h = (rng.standard_normal((1, d)).astype(np.float32) * s for s in (1, 3))
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            for later in (1, 2):
                logits, tops = G.routers(mats[:1 + later], E, d, p, x, h, norms[:later], eps, biases[:later], k)
                y = np.empty((1, E), np.float32)
                G.dense(mats[0], E, d, p, x, y)
                assert (logits == y).all()
                for j in range(later):
                    assert (tops[j] == G.top(mats[1 + j], E, d, p, h, norms[j], eps, biases[j], k)[0]).all()
    finally:
        numba.set_num_threads(before)


@needs_llama
@pytest.mark.parametrize("kinds", [("Q4_K", "Q4_K", "Q6_K"), ("Q2_K", "Q2_K", "Q4_K"), ("Q8_0", "Q8_0", "Q8_0")])
def test_ggml_experts_and_projections_share_the_cores_without_changing_a_bit(kinds):
    """moe_ready and dense cut their output rows into runs that numba's threads share: the result is each row's
    own vec_dot (G.matvec, one thread) whatever the thread count, bit for bit."""
    import numba
    from engines import ggml_kernels as G
    d, ff, E, k = 512, 768, 6, 4
    rng = np.random.default_rng(7)
    kinds = dict(zip(("gate", "up", "down"), (f"gguf:{t}" for t in kinds)))
    shapes = {"gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    size = {p: shapes[p][0] * G.part(kinds[p], shapes[p][1])[0] for p in shapes}
    offsets = {"gate": 0, "up": size["gate"], "down": size["gate"] + size["up"]}
    slot = sum(size.values())
    parts = G.expert_parts(shapes, kinds, offsets)
    block = rng.integers(0, 256, E * slot, dtype=np.uint8)
    for e in range(E):              # sane scales: random bytes with their fp16 fields set small
        for p, (o, n) in ((p, (offsets[p], size[p])) for p in shapes):
            rows = block[e * slot + o:e * slot + o + n]
            rows[:] = G.quantize(rng.standard_normal(shapes[p]).astype(np.float32) * 0.05, kinds[p]).reshape(-1)
    X = rng.standard_normal((3, d)).astype(np.float32)
    flat = rng.integers(0, E, 3 * k).astype(np.int64)
    weight = rng.random(3 * k).astype(np.float32)
    es = np.arange(E - 1, dtype=np.int64)                       # expert E-1 is not in this batch: its pairs skipped
    want = np.zeros((3 * k, d), np.float32)
    for q in range(3 * k):
        if flat[q] == E - 1:
            continue
        at = block[flat[q] * slot:(flat[q] + 1) * slot]
        g = G.matvec(at[:size["gate"]], shapes["gate"], kinds["gate"], X[q // k])
        u = G.matvec(at[offsets["up"]:offsets["down"]], shapes["up"], kinds["up"], X[q // k])
        h = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
        want[q] = weight[q] * G.matvec(at[offsets["down"]:], shapes["down"], kinds["down"], h)
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            Y = np.zeros((3 * k, d), np.float32)
            G.moe_ready(block, es, es * slot, flat, k, weight, X, Y, parts, np.zeros((E, 3), np.int64), d, ff)
            np.testing.assert_array_equal(Y, want, err_msg=f"{threads} threads")
            W = block[:size["gate"]]
            Yd = np.zeros((3, ff), np.float32)
            G.dense(W, ff, d, G.part_row(kinds["gate"], d), X, Yd)
            np.testing.assert_array_equal(Yd, np.stack([G.matvec(W, (ff, d), kinds["gate"], x) for x in X]))
    finally:
        numba.set_num_threads(before)
