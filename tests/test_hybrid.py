"""The hybrid linear-attention MoE family (Qwen3-Next, Qwen3.5-MoE, MiniCPM-V 4.7's language model) on the
numpy engine (the reference) and the packed engine (the default), against transformers' own implementation of
each, on tiny random checkpoints (hybrid_fixtures.py): three Gated DeltaNet layers then one gated
full-attention layer, 16 experts top-4 and a shared expert.

- a bf16 pack matches transformers' fp32 logits within 1e-4 on both engines, for a prefill and for decoding
  token by token through the recurrent state, the convolution state and the KV cache;
- the packed engine matches the numpy engine within the packed tolerance (test_packed_engine.ATOL), resident
  and streaming;
- truncate restores the linear-attention state exactly (re-decoding equals a fresh run) to where a rollback
  returns (inside the last decode step, its start, a prompt's end, position 0); anywhere else is refused, and
  what is held is what `info` counts;
- streaming the experts under every exact design and budget gives the logits of every expert resident, bit for
  bit, on each engine.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_fixtures import HYBRID
from test_packed_engine import ATOL as PACKED_ATOL
from engines.hybrid import CHECKPOINT_WINDOW
from workbench.errors import WorkbenchError
from workbench.models.hf import HFModel
from runtime.session import open_session, usage as session_usage
from workbench.registry import experts_for
from workbench.store.pack import Pack

TOKENS = [3, 17, 42, 99, 7, 200, 31, 5, 128, 64, 250, 1, 77, 13]
SPLIT = 9
ATOL = 1e-4
ENGINES = ["numpy", "packed"]


def hf_logits(path, family, ids):
    import transformers as tf
    cls = tf.MiniCPMV4_7ForConditionalGeneration if family == "minicpmv4_7" else tf.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def ours(path, ids, decode_from=None, preset="teacher", engine="numpy", **kw):
    with open_session(str(path), preset, engine=engine, **kw) as s:
        s.engine.reset()
        if decode_from is None:
            return s.step(ids, "prefill")
        rows = [s.step(ids[:decode_from], "prefill")] + [s.step([t], "decode") for t in ids[decode_from:]]
        return np.concatenate(rows)


@pytest.mark.parametrize("family", HYBRID)
def test_prefill_and_decode_match_transformers(hybrid_models, family):
    ref = hf_logits(hybrid_models[family], family, TOKENS)
    for engine in ENGINES:
        np.testing.assert_allclose(ours(hybrid_models[family], TOKENS, engine=engine), ref, atol=ATOL, rtol=0,
                                   err_msg=engine)
        np.testing.assert_allclose(ours(hybrid_models[family], TOKENS, decode_from=SPLIT, engine=engine), ref,
                                   atol=ATOL, rtol=0, err_msg=engine)


@pytest.mark.parametrize("family", HYBRID)
def test_packed_engine_matches_numpy(hybrid_models, family):
    """q4 experts, every expert resident and streaming a quarter of them (waves at prefill); the affine formats
    named (the packed engine's default, ggml's blocks, is held to the numpy engine in tests/test_llamacpp.py)."""
    for preset, kw in [("resident", dict(experts="q4")), ("on_demand", dict(budget="0.25", experts="q4")),
                       ("les", dict(experts="q3"))]:
        ref = ours(hybrid_models[family], TOKENS, SPLIT, preset, "numpy", **kw)
        np.testing.assert_allclose(ours(hybrid_models[family], TOKENS, SPLIT, preset, "packed", **kw), ref,
                                   atol=PACKED_ATOL, rtol=0, err_msg=preset)


def test_spec_reads_the_hybrid_config(hybrid_models):
    spec = HFModel(hybrid_models["qwen3_next"]).spec
    assert spec.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert spec.rope_dim == 4 and spec.head_dim == 16            # partial_rotary_factor 0.25
    assert spec.shared_expert_size == 48 and spec.shared_expert_gate and spec.attn_output_gate
    assert spec.moe_layers == [0, 1, 2, 3]                      # every layer has a MoE block: lookahead crosses all
    mini = HFModel(hybrid_models["minicpmv4_7"])
    assert not any("vision" in hf or "merger" in hf for _, hf in mini.where.values())


def test_zero_centred_norms_are_loaded_as_one_plus_weight(hybrid_models):
    from safetensors.numpy import load_file
    path = hybrid_models["qwen3_5_moe"]
    raw = load_file(str(path / "model.safetensors"))
    m = HFModel(path)
    np.testing.assert_array_equal(m.tensor("layers.0.attn_norm"), raw["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(m.tensor("layers.3.q_norm"), raw["model.layers.3.self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(m.tensor("layers.0.lin_norm"), raw["model.layers.0.linear_attn.norm.weight"])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", HYBRID)
def test_truncate_then_redecode_equals_a_fresh_run(hybrid_models, family, engine):
    path = hybrid_models[family]
    fresh = ours(path, TOKENS, decode_from=SPLIT, engine=engine)
    with open_session(str(path), "teacher", engine=engine) as s:
        s.engine.reset()
        s.step(TOKENS[:SPLIT], "prefill")
        s.step([250, 251, 252], "decode")                         # a rejected speculative draft
        s.engine.truncate(SPLIT)
        rows = [s.step([t], "decode") for t in TOKENS[SPLIT:]]
        np.testing.assert_array_equal(np.concatenate(rows), fresh[SPLIT:])
        s.engine.truncate(len(TOKENS) - 1)                        # the last step's start
        np.testing.assert_array_equal(s.step([TOKENS[-1]], "decode"), fresh[-1:])
        s.engine.truncate(SPLIT)
        s.step(TOKENS[SPLIT:SPLIT + 1], "decode")
        s.step(TOKENS[SPLIT + 1:], "decode")                      # a batch all accepted, then cut back inside it
        s.engine.truncate(SPLIT + 2)                              # (a batch's rows round as one matmul's)
        np.testing.assert_allclose(np.concatenate([s.step([t], "decode") for t in TOKENS[SPLIT + 2:]]),
                                   fresh[SPLIT + 2:], rtol=1e-5, atol=1e-5)
        s.engine.truncate(0)                                      # a fresh state
        s.step(TOKENS[:SPLIT], "prefill")
        np.testing.assert_array_equal(np.concatenate([s.step([t], "decode") for t in TOKENS[SPLIT:]]),
                                      fresh[SPLIT:])


def test_truncate_keeps_each_prompts_end_and_refuses_older_positions(hybrid_models):
    path = hybrid_models["qwen3_5_moe"]
    with open_session(str(path), "teacher", engine="numpy") as s:
        s.engine.reset()
        s.step(TOKENS[:SPLIT], "prefill")
        for t in range(CHECKPOINT_WINDOW + 3):
            s.step([t % 300], "decode")
        with pytest.raises(WorkbenchError, match="cannot truncate the linear-attention state to position 3"):
            s.engine.truncate(3)
        s.engine.truncate(SPLIT)                                  # the prompt's end is kept
        np.testing.assert_array_equal(np.concatenate([s.step([t], "decode") for t in TOKENS[SPLIT:]]),
                                      ours(path, TOKENS, decode_from=SPLIT)[SPLIT:])


def decode(path, preset, n=10, engine="numpy", **kw):
    with open_session(str(path), preset, engine=engine, **kw) as s:
        s.engine.reset()
        logits = [s.step(TOKENS[:6], "prefill")[-1]]
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(logits[-1])))
            logits.append(s.step([toks[-1]], "decode")[-1])
        return toks, np.stack(logits), s.summary()


PATHS = [dict(budget="0.25"), dict(budget="0.5", execution="ready_first"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:1:2k"),
         dict(budget="0.25", execution="ready_first", predictor="lookahead:2:k", cache_scope="per_layer"),
         dict(budget="0.25", execution="ready_first", predictor="history", cache_policy="lfu")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", HYBRID)
def test_every_exact_path_equals_resident(hybrid_models, family, engine):
    model = hybrid_models[family]
    ref_toks, ref_logits, _ = decode(model, "resident", engine=engine)
    for path in PATHS:
        toks, logits, summary = decode(model, "on_demand", engine=engine, **path)
        assert toks == ref_toks, path
        np.testing.assert_array_equal(logits, ref_logits, err_msg=str(path))
        assert summary["misses"] > 0, "the path streamed nothing: the comparison would be empty"
    for preset, experts in [("les", "q3"), ("smol", "q2")]:         # each stores its own expert precision
        toks, logits, _ = decode(model, "resident", engine=engine, experts=experts_for(experts, engine))
        for budget in ("0.25", "0.5", "0.75"):
            got_toks, got, summary = decode(model, preset, engine=engine, budget=budget)
            assert got_toks == toks, (preset, budget)
            np.testing.assert_array_equal(got, logits, err_msg=f"{preset} {budget}")
            assert summary["misses"] > 0, (preset, budget)


def test_convert_streams_the_routed_experts_and_keeps_the_shared_one_resident(hybrid_models, tmp_path):
    from workbench.store.pack import convert
    path = convert(hybrid_models["qwen3_next"], tmp_path / "next.pack")
    pack = Pack(path)
    assert pack.num_expert_total == 4 * 16
    assert {f"layers.{i}.shared.{p}" for i in range(4) for p in ("gate", "up", "down")} <= set(pack.tensors)
    assert "layers.0.lin_qkvz" in pack.tensors and "layers.3.q" in pack.tensors


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Qwen3-Next's routing shape: 512 experts, top-10 and the shared expert (one DeltaNet and one full layer)."""
    from hybrid_fixtures import make_hybrid
    return make_hybrid("qwen3_next", tmp_path_factory.mktemp("wide") / "qwen3_next", num_hidden_layers=2,
                       full_attention_interval=2, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=16)


def test_warm_sets_and_cache_bias_with_512_experts_top10_and_the_shared_expert_outside_the_budget(wide):
    runs = {}
    for preset in ("smol", "smol_bias"):
        with open_session(str(wide), preset, budget="0.1") as s:
            usage = session_usage(s.pack)
            assert sorted(usage) == [0, 1] and all(len(c) == 512 for c in usage.values())
            assert len({sum(c) for c in usage.values()}) == 1 and sum(usage[0]) % 10 == 0   # 10 experts a token
            s.engine.reset()
            s.step(TOKENS[:6], "prefill")
            for t in TOKENS[6:]:
                s.step([t], "decode")
            assert s.budget_bytes <= 0.1 * s.pack.num_expert_total * s.slot_bytes + s.slot_bytes
            assert all(0 <= e < 512 for _, e in s.cache.keys())      # the cache holds routed experts only
            assert "layers.0.shared.gate" in s.engine.w                  # the shared expert is resident, always
            runs[preset] = s.summary()
    # with 512 experts a 0.05 bias outweighs most softmax scores: routing leans on what is in memory
    assert runs["smol_bias"]["hits"] > runs["smol"]["hits"]


def test_info_prints_what_the_model_needs_in_memory(hybrid_models, capsys):
    import json

    from safetensors import safe_open
    from cli import main
    path = hybrid_models["qwen3_next"]
    assert main(["info", "--model", str(path), "--budget", "0.25", "--engine", "numpy", "--json"]) in (0, None)
    mem = json.loads(capsys.readouterr().out)["memory"]
    with safe_open(str(path / "model.safetensors"), "np") as f:
        dense = sum(f.get_tensor(k).size for k in f.keys() if ".experts." not in k)
    assert mem["resident_f32_bytes"] == 4 * dense
    assert mem["experts"] == 64 and mem["experts_bytes_by_precision"]["bf16"] == 64 * 3 * 64 * 32 * 2
    assert mem["cache_bytes"] == 16 * 3 * 64 * 32 * 4                 # a quarter of the experts, in numpy's f32
    with open_session(str(path), "teacher") as s:
        s.engine.reset()
        s.step(TOKENS, "prefill")
        state = sum(a.nbytes for conv_s in s.engine.lin.values() for a in conv_s)
        kv = sum(K[:, :s.engine.pos].nbytes + V[:, :s.engine.pos].nbytes for i, (K, V) in enumerate(s.engine.kv)
                 if not s.spec.is_linear(i))
    assert mem["linear_state_bytes"] == state
    assert mem["kv_bytes_per_token"] * len(TOKENS) == kv


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_completions_use_the_models_own_template(hybrid_models, tmp_path):
    import http.client
    import json
    import shutil
    import threading

    from evals.server import make_server
    model = shutil.copytree(hybrid_models["qwen3_5_moe"], tmp_path / "chat")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    with open_session(str(model), "resident", direct=False) as s:
        srv = make_server(s, "127.0.0.1", 0, model_id="tiny", quiet=True)
        th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        th.start()
        try:
            c = http.client.HTTPConnection(*srv.server_address, timeout=60)
            c.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 3,
                                                                  "temperature": 0}), {"Content-Type": "application/json"})
            body = json.loads(c.getresponse().read())
        finally:
            srv.shutdown()
            srv.server_close()
        want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
        assert s.pack.header["chat_template"] == CHATML
        assert body["usage"]["prompt_tokens"] == len(s.encode(want))
        assert len(s.encode(want)) != len(s.encode("System: Be brief.\nUser: Tell me a story.\nAssistant:"))


@pytest.mark.parametrize("family", ["qwen3_next", "minicpmv4_7"])
def test_the_trainers_torch_decoder_matches_transformers(hybrid_models, family, tmp_path):
    """training/model.py gains the family's layers: from a bf16 pack, a full forward and token-by-token decoding
    with its cache (conv and delta-rule state, keys and values) give transformers' logits."""
    from training.model import MoEDecoder
    from workbench.edge0.artifacts import pack_weights
    from workbench.store.pack import convert
    pack = Pack(convert(hybrid_models[family], tmp_path / "p.pack", experts="bf16", rest="bf16"))
    model = MoEDecoder.from_pack(pack, *pack_weights(pack))
    ref = hf_logits(hybrid_models[family], family, TOKENS)
    with torch.no_grad():
        full = model(torch.tensor([TOKENS]))[0][0].numpy()
        cache = {}
        steps = np.concatenate([model(torch.tensor([[t]]), cache=cache)[0][0].numpy() for t in TOKENS])
    np.testing.assert_allclose(full, ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(steps, ref, atol=ATOL, rtol=0)


def test_edge0_torch_student_equals_numpy_serving(hybrid_models, tmp_path):
    """Edge0 on the hybrid: the trainers' torch path (int4 + prerouter heads + a LoRA on the full-attention layer's
    q, k, v, o) is what `--preset edge0` serves, whole sequence and token by token."""
    import shutil

    from test_edge0 import pack_of, student_logits, teacher_forced, write_heads, write_lora
    m = shutil.copytree(hybrid_models["qwen3_next"], tmp_path / "edge0-next")
    pack = pack_of(m)
    lp = write_lora(m, pack=pack)                                    # on layer 3, the one with attention projections
    hp = write_heads(m, pack=pack)
    ids = TOKENS[:8] * 2
    with open_session(str(m), "edge0", budget="all", experts="q4") as s:      # the trainers' int4: the affine q4 pack
        served = teacher_forced(s, ids)
    with open_session(str(m), "edge0", budget="all", routing="prerouter:nolora") as s:
        assert np.abs(teacher_forced(s, ids) - served).max() > 1e-3        # the adapter on layer 3 is served
    full, inc = student_logits(pack, ids, hp, lp)
    np.testing.assert_allclose(full, served, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(inc, served, rtol=1e-4, atol=1e-4)


def test_edge0s_trainer_streams_a_gguf_and_trains_as_if_it_held_it(hybrid_models, tmp_path):
    """A model bigger than memory trains its recovery LoRA: with nothing held (each layer's tensors and experts read
    from the GGUF and dequantized by ggml at every use, each layer recomputed for the backward pass) the student's
    logits and the LoRA's gradients are those of the whole model held in torch (plain autograd, the gguf package's
    dequantization), the prerouter's routing weights included."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable (pip install -e '.[llamacpp]')")
    import torch.nn.functional as F

    from engines.gguf_export import export_gguf
    from training.edge0_common import HeadSet, LoRASet, TorchMoE, head_features, open_pack
    from training.model import MoEDecoder
    from workbench.edge0.artifacts import pack_weights
    pack = open_pack(str(export_gguf(HFModel(hybrid_models["qwen3_next"]), tmp_path / "m.gguf", "f16")), "q4")
    s, moe = pack.spec, pack.spec.moe_layers
    torch.manual_seed(0)
    heads = HeadSet(moe[:-1], s.hidden_size, s.num_experts, hidden=8)
    for p in heads.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    ids = torch.tensor([TOKENS[:12], TOKENS[2:]])

    def held_in_torch(lora):                # the whole model in memory, the prerouter routing written out again
        model, feats = MoEDecoder.from_pack(pack, *pack_weights(pack)), {}

        def router(i, xn, logits):
            used = logits
            if i != moe[0]:
                used = torch.cat([logits[:, :1], heads(moe[moe.index(i) - 1], feats.pop(moe[moe.index(i) - 1]))[:, :-1]], 1)
            idx, w = model.route(i, used)
            feats[i] = head_features(xn, idx, s.num_experts)
            return idx, w
        return model(ids, router, lora.delta)[0]

    def trained(run):
        lora = LoRASet(shapes, rank=4, seed=1)
        torch.manual_seed(1)
        for b in lora.B.values():
            torch.nn.init.normal_(b, 0, 0.3)
        logits = run(lora)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        return logits.detach(), {n: p.grad for n, p in lora.named_parameters()}

    streamed = TorchMoE(pack, hold=0)
    shapes = streamed.proj_shapes()
    got, want = trained(lambda lora: streamed(ids, heads=heads, lora=lora)), trained(held_in_torch)
    assert streamed.weights.streams and not streamed.weights.held
    assert set(got[1]) == set(want[1]) and len(want[1]) == 8                # A and B of q, k, v, o on layer 3
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    for n, g in want[1].items():
        assert g.abs().max() > 0
        np.testing.assert_allclose(got[1][n], g, rtol=1e-3, atol=1e-5 * float(g.abs().max()), err_msg=n)


def test_edge0s_lora_trains_on_a_gguf_and_is_served(hybrid_models, tmp_path):
    """`python -m training.edge0_lora --model X.gguf`: the GGUF is its own teacher (exact routing) and student
    (its prerouter heads), both phases run, and `--preset edge0` serves the adapter it wrote beside the file (in
    <file>.edge0/: one folder per file)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable (pip install -e '.[llamacpp]')")
    from engines.gguf_export import export_gguf
    from test_edge0 import teacher_forced, write_heads
    from training import edge0_lora
    from training.edge0_common import open_pack
    from workbench.edge0.artifacts import artifact_path, edge0_dir_of, load_safetensors
    path = export_gguf(HFModel(hybrid_models["qwen3_next"]), tmp_path / "m.gguf", "f16")
    pack = open_pack(str(path), "q4")
    write_heads(None, pack=pack)
    edge0_lora.main(["--model", str(path), "--text-seqs", "2", "--text-len", "6", "--ce-steps", "2", "--batch", "2",
                     "--rkl-rounds", "1", "--rkl-batch", "1", "--rkl-len", "4", "--val-windows", "1", "--val-ctx", "12"])
    t, meta = load_safetensors(artifact_path(pack, "lora"), "lora")
    assert artifact_path(pack, "lora") == tmp_path / "m.gguf.edge0" / "lora.safetensors"
    (tmp_path / "other.gguf").touch()       # another file in the folder keeps its own (none yet)
    assert edge0_dir_of(tmp_path / "other.gguf") == tmp_path / "other.gguf.edge0"
    assert set(t) == {f"lora.3.{p}.{m}" for p in "qkvo" for m in "AB"} and np.abs(t["lora.3.q.B"]).max() > 0
    assert meta["teacher"] == "the same weights, exact routing" and meta["val_kl_train_corpora"]["int4_exact"] == 0
    ids = TOKENS[:8]
    with open_session(str(path), "edge0", budget="all") as s:
        assert s.lora is not None
        served = teacher_forced(s, ids)
    with open_session(str(path), "edge0", budget="all", routing="prerouter:nolora") as s:
        assert np.abs(teacher_forced(s, ids) - served).max() > 0


def test_bench_runs_les_and_edge0_on_the_tiny_qwen3_next_on_the_packed_engine(hybrid_models, tmp_path):
    """The issue's commands: `bench --model <tiny qwen3_next dir> --preset les --budget 0.25 --json`, and
    `--preset edge0` once the model has Edge0's heads and LoRA (random ones here, written as test_edge0 writes
    them; training them on this model is a recorded command in the README), both on the default engine."""
    import shutil

    from test_cli import run_json
    from test_edge0 import write_heads, write_lora
    from workbench.runs import read_run
    m = shutil.copytree(hybrid_models["qwen3_next"], tmp_path / "bench-next")
    runs = {}
    for preset in ("les", "edge0"):
        if preset == "edge0":
            write_heads(m)
            write_lora(m)
        out = run_json("bench", "--model", str(m), "--preset", preset, "--budget", "0.25", "--tokens", "8")
        assert out["tokens"] == 8 and out["cache_bytes"] <= out["budget_bytes"], preset
        assert out["prefetch_recall"] is not None, preset
        runs[preset] = read_run(out["run"])["config"]
    assert {c["engine"] for c in runs.values()} == {"packed"}
    assert runs["edge0"]["preset"]["routing"] == "prerouter"


@pytest.mark.parametrize("family", HYBRID)
def test_llamacpp_runs_the_exported_gguf_with_our_greedy_tokens(hybrid_models, family, tmp_path):
    """export-gguf writes the tiny Qwen3-Next as llama.cpp's qwen3next and the tiny Qwen3.5-MoE (and MiniCPM-V
    4.7's language model) as its qwen35moe (f16): stock llama.cpp generates our greedy tokens, its logits over the
    prompt and everything generated agree with ours to f16 precision, and the GGUF imports back as the same model.
    (f16 can flip a router choice where two experts nearly tie, and a flip lives on in the recurrent state: on
    this random model some prompts hit one, so the prompt is fixed and the agreement is checked over the whole
    run.)"""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable (pip install -e '.[llamacpp]')")
    from dataclasses import replace

    from child import in_child
    from engines.gguf_export import export_gguf
    from hybrid_fixtures import llama_greedy_and_logits
    from workbench.models.gguf_model import GGUFModel
    path, prompt = hybrid_models[family], TOKENS[:8]
    gguf_path = export_gguf(HFModel(path), tmp_path / "m.gguf", "f16")
    with open_session(str(path), "teacher") as s:
        mine = s.generate(prompt, tokens=16)["tokens"]
    theirs, logits = in_child(llama_greedy_and_logits, gguf_path, prompt, 16, prompt + mine[:-1])
    assert theirs == mine
    np.testing.assert_allclose(logits, ours(path, prompt + mine[:-1]), atol=3e-2, rtol=0)
    # and back: the same model (f16 holds the bf16 weights exactly). A qwen35moe GGUF is family qwen3_5_moe, keeps
    # its value heads in llama.cpp's tiled order (the decoder broadcasts q and k to match), and no layer is dense,
    # so the dense width it records is unused.
    want, got = HFModel(path).spec, GGUFModel(gguf_path).spec
    assert got.family == {"qwen3_next": "qwen3_next"}.get(family, "qwen3_5_moe")
    tiled = got.linear.pop("value_heads", None)
    assert tiled == (None if family == "qwen3_next" else "tiled")
    assert replace(got, family=want.family, dense_intermediate_size=want.dense_intermediate_size) == want
    np.testing.assert_allclose(ours(gguf_path, prompt + mine[:-1]), ours(path, prompt + mine[:-1]), atol=ATOL, rtol=0)


def test_qwen35moe_gguf_tiles_the_value_heads_over_the_key_heads(hybrid_models, tmp_path):
    """llama.cpp's qwen35moe holds DeltaNet's value heads tiled over the key heads (v0 of every key head, then
    v1 ...), Hugging Face's Qwen3.5 grouped by key head: the export reorders them; the import keeps the GGUF's
    order (every value-head axis tiled alike, so nothing is regrouped and the blocks stay as they lie), and
    exported again gives the same file's tensors."""
    import gguf

    from engines.gguf_export import export_gguf
    from workbench.models.gguf_model import GGUFModel
    path = hybrid_models["qwen3_5_moe"]
    gguf_path = export_gguf(HFModel(path), tmp_path / "q35.gguf", "f16")
    z = HFModel(path).tensor("layers.0.lin_z").reshape(2, 2, 8, -1)        # (key head, value head in it, dv, d)
    written = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}["blk.0.attn_gate.weight"]
    np.testing.assert_array_equal(np.asarray(written.data, np.float32).reshape(2, 2, 8, -1), z.swapaxes(0, 1))
    from workbench.spec_hybrid import tile_value_heads
    g, hf = GGUFModel(gguf_path), HFModel(path)
    assert g.spec.linear["value_heads"] == "tiled"
    qk = 2 * 2 * g.spec.linear["key_head_dim"]
    for name, axis, dim in (("lin_z", 0, 8), ("lin_b", 0, 1), ("lin_a", 0, 1), ("lin_dt_bias", 0, 1), ("lin_out", 1, 8)):
        np.testing.assert_array_equal(g.tensor(f"layers.0.{name}"),
                                      tile_value_heads(hf.spec, hf.tensor(f"layers.0.{name}"), axis, dim), name)
    qkv = hf.tensor("layers.0.lin_qkv")
    np.testing.assert_array_equal(g.tensor("layers.0.lin_qkv"),
                                  np.concatenate([qkv[:qk], tile_value_heads(hf.spec, qkv[qk:], 0, 8)]))
    assert not {"layers.0.lin_qkv", "layers.0.lin_z", "layers.0.lin_out"} & set(g.derived)    # read as they lie


def test_a_gguf_of_an_architecture_without_experts_is_refused_in_one_line(tmp_path):
    """llama.cpp's qwen35 (the dense Qwen3.5) has no experts to stream: a clear refusal."""
    import gguf

    from workbench.models.gguf_model import GGUFModel
    w = gguf.GGUFWriter(str(tmp_path / "q35.gguf"), "qwen35")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(WorkbenchError, match="GGUF architecture 'qwen35' is not a supported MoE family"):
        GGUFModel(tmp_path / "q35.gguf")


def test_mtp_heads_are_not_read_and_bad_configs_fail_in_one_line(hybrid_models, tmp_path, capsys):
    import json
    import shutil

    from safetensors.numpy import save_file
    from cli import main
    m = shutil.copytree(hybrid_models["qwen3_next"], tmp_path / "with-mtp")
    save_file({"mtp.fc.weight": np.ones((64, 128), np.float32),
               "mtp.layers.0.mlp.experts.0.gate_proj.weight": np.ones((32, 64), np.float32)}, str(m / "mtp.safetensors"))
    assert not [hf for _, hf in HFModel(m).where.values() if hf.startswith("mtp")]
    assert all(not hf.startswith("mtp") for _, hf, _ in HFModel(m).experts.values())
    cfg = json.loads((m / "config.json").read_text())
    del cfg["linear_conv_kernel_dim"]
    (m / "config.json").write_text(json.dumps(cfg))
    assert main(["info", "--model", str(m)]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json: missing field 'linear_conv_kernel_dim'" in err and len(err.splitlines()) == 1


def test_the_states_held_are_the_ones_a_rollback_needs_and_info_counts_them(hybrid_models):
    """At full size one position's linear-attention state is tens of MiB: a decoder holds a step's start and
    positions and the prompt's end, however long it decodes (memory_needs counts them), and a rejected draft and the
    prompt's end still roll back exactly; the step before the last is refused."""
    from workbench.memory import memory_needs
    from workbench.presets import Budget
    path = hybrid_models["qwen3_5_moe"]
    with open_session(str(path), "teacher", engine="numpy") as s:
        s.engine.reset()

        def held():
            arrays = {id(a): a for layer in [*s.engine.lin.values(), *(st for c in s.engine.lin_ckpt.values()
                                                                           for st in c.values())] for a in layer}
            return sum(a.base.nbytes if a.base is not None else a.nbytes for a in arrays.values())

        def counted(drafts):
            return memory_needs(s.spec, {n: t["shape"] for n, t in s.pack.tensors.items()}, Budget("all"),
                                1, speculative=drafts)["linear_checkpoint_bytes"]
        s.step(TOKENS[:SPLIT], "prefill")
        for t in TOKENS[SPLIT:SPLIT + 8]:
            s.step([t], "decode")
        assert max(len(c) for c in s.engine.lin_ckpt.values()) == 3    # the prompt's end, the step's start and end
        assert held() <= counted(0)
        end = s.engine.pos
        s.step([250, 251, 252, 253], "decode")               # a draft of 3 rejected after its first token
        assert held() <= counted(3)
        s.engine.truncate(end + 1)
        for gone in (end - 1, end - 3):
            with pytest.raises(WorkbenchError, match=f"position {gone}:"):
                s.engine.truncate(gone)
        s.engine.truncate(SPLIT)                             # the prompt's end is kept
        np.testing.assert_array_equal(np.concatenate([s.step([t], "decode") for t in TOKENS[SPLIT:]]),
                                      ours(path, TOKENS, decode_from=SPLIT, engine="numpy")[SPLIT:])
