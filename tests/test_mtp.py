"""Multi-token-prediction drafts: the numpy MTP block (engines/mtp.py) computes what the torch block it is trained as
computes (training/mtp.py), and drafting with the demo's MTP head gives plain greedy decoding's output."""
from __future__ import annotations

import numpy as np
import pytest

from test_bad_input import assert_one_line_error, cli
from test_budget_agree import engine_or_skip
from runtime.session import open_session
from workbench.registry import model_dir
from workbench.store.pack import open_model

torch = pytest.importorskip("torch")


def test_the_numpy_block_computes_what_the_torch_block_computes_row_by_row_and_chained():
    """A randomly initialised block of the demo's shape: 6 rows at positions 1..6 in one forward, then one chained
    row at position 7 from the block's own last state, against torch's block with its KV cache."""
    from engines.mtp import MTPHead
    from training.model import MoEConfig
    from training.mtp import MTP
    spec = open_model(model_dir("demo")).spec
    c = MoEConfig.of_spec(spec)
    torch.manual_seed(0)
    block = MTP(c)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    embed, lm = torch.randn(c.vocab_size, c.hidden_size), torch.randn(c.vocab_size, c.hidden_size) * 0.05
    w = {k: v.detach().numpy().astype(np.float32) for k, v in block.state_dict().items()}
    head = MTPHead(spec, w, lambda ids: embed.numpy()[ids], lambda x: x @ lm.numpy().T)

    hidden, ids = torch.randn(6, c.hidden_size), torch.tensor([5, 9, 33, 71, 2, 18])
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))

    def rope(pos, T):
        f = torch.outer(torch.arange(pos, pos + T, dtype=torch.float32), inv)
        e = torch.cat((f, f), -1)
        return e.cos()[None, None], e.sin()[None, None]

    kv = {}
    with torch.no_grad():
        ref, _ = block(embed[ids][None], hidden[None], *rope(1, 6), kv=kv)
        ref_next, _ = block(embed[torch.tensor([7])][None], ref[:, -1:], *rope(7, 1), kv=kv)
    x, logits = head.forward(hidden.numpy(), ids.numpy(), 1)
    np.testing.assert_allclose(x, ref[0].numpy(), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(logits, (block.norm(ref[0]) @ lm.T).detach().numpy(), rtol=2e-4, atol=2e-4)
    x2, _ = head.forward(x[-1:], [7], 7)
    np.testing.assert_allclose(x2, ref_next[0].numpy(), rtol=2e-4, atol=2e-4)
    head.truncate(4)                                # positions 1..3 kept: rows 4.. again give the same states
    x3, _ = head.forward(hidden.numpy()[3:], ids.numpy()[3:], 4)
    np.testing.assert_allclose(x3, x[3:], rtol=1e-5, atol=1e-5)


def greedy(engine: str, tokens: int = 32, **knobs):
    with open_session("demo", "les", "0.25", engine=engine, tokens=tokens, **knobs) as s:
        out = s.generate("Once upon a time, there was a little girl named Lily.", tokens)
        return out["tokens"], s.summary()


@pytest.mark.parametrize("engine", ["packed", "numpy", "mlx"])
def test_mtp_drafts_give_plain_greedy_output(engine):
    plain, _ = greedy(engine_or_skip(engine))
    drafted, s = greedy(engine, speculative=2, draft="mtp")
    assert drafted == plain
    assert s["draft"] == "mtp" and s["spec_accepted"] > 0 and s["draft_s"] > 0


def test_a_checkpoint_without_mtp_layers_is_refused_in_one_line(tiny_models):
    res = cli("bench", "--model", str(tiny_models["qwen3_moe"]), "--preset", "les", "--tokens", "4", "--no-record",
              "--set", "speculative=2", "--set", "draft=mtp")
    assert_one_line_error(res, str(tiny_models["qwen3_moe"]), "no MTP layers")


# family -> (transformers' modeling module, its classes' prefix, its rotary embedding)
MTP_FAMILIES = {"qwen3_next": ("qwen3_next", "Qwen3Next", "Qwen3NextRotaryEmbedding"),
                "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeTextRotaryEmbedding")}


def hybrid_mtp_block(family: str, config):
    """The family's MTP block put together from transformers' own modules, as the checkpoint's `mtp.*` names lay it
    out (vLLM's Qwen3NextMultiTokenPredictor): the pre-fc norms of the embedding and of the hidden state, `fc`, one
    full-attention decoder layer, the final norm. Returns (modules by mtp name, forward(embeds, hidden, positions))."""
    import importlib
    module, prefix, rope = MTP_FAMILIES[family]
    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    norm = getattr(m, prefix + "RMSNorm")
    d = config.hidden_size
    config._attn_implementation = "eager"
    full = config.layer_types.index("full_attention")
    mods = torch.nn.ModuleDict({"pre_fc_norm_embedding": norm(d, config.rms_norm_eps),
                                "pre_fc_norm_hidden": norm(d, config.rms_norm_eps),
                                "fc": torch.nn.Linear(2 * d, d, bias=False),
                                "layers": torch.nn.ModuleList([getattr(m, prefix + "DecoderLayer")(config, full)]),
                                "norm": norm(d, config.rms_norm_eps)})
    rotary = getattr(m, rope)(config)

    def forward(embeds, hidden, positions):
        x = mods["fc"](torch.cat([mods["pre_fc_norm_embedding"](embeds), mods["pre_fc_norm_hidden"](hidden)], -1))
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = mods["layers"][0](x, position_embeddings=rotary(x, positions[None]), attention_mask=mask)
        return x, mods["norm"](x)
    return mods, forward


def with_mtp_block(checkpoint, out, family: str = "qwen3_next", seed: int = 0):
    """A copy of the tiny hybrid checkpoint at `out` with a random MTP block in a shard of its own
    (model-mtp.safetensors, transformers' names after `mtp.`): (out, its config, the block's reference forward)."""
    import shutil
    from safetensors.torch import save_file
    from transformers import AutoConfig
    shutil.copytree(checkpoint, out)
    config = AutoConfig.from_pretrained(out).get_text_config()     # a multimodal wrapper's (Qwen3.5's) text model's
    torch.manual_seed(seed)
    mods, block = hybrid_mtp_block(family, config)
    with torch.no_grad():
        for name, p in mods.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08))
    save_file({f"mtp.{k}": v.contiguous() for k, v in mods.state_dict().items()}, out / "model-mtp.safetensors")
    return out, config, block


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_hybrid_checkpoints_mtp_block_computes_what_transformers_layers_compute(hybrid_models, tmp_path, family):
    """A tiny Qwen3-Next's or Qwen3.5-MoE's MTP block (its norms stored as w and used as 1 + w, its experts fused as
    transformers 5 writes them, in the checkpoint's own shards) read by load_mtp and computed by the numpy block:
    rows at positions 1..6, then one row chained from the block's own last state, against transformers' modules."""
    from engines.mtp import MTPHead
    from workbench.models.mtp import load_mtp
    src, config, block = with_mtp_block(hybrid_models[family], tmp_path / family, family)
    spec = open_model(src).spec
    w = load_mtp(src, zero_centred=True)
    assert "layers.0.mlp.experts.15.down_proj.weight" in w and "layers.0.mlp.experts.gate_up_proj" not in w
    embed = torch.randn(config.vocab_size, config.hidden_size)
    lm = torch.randn(config.vocab_size, config.hidden_size) * 0.05
    head = MTPHead(spec, w, lambda ids: embed.numpy()[ids], lambda x: x @ lm.numpy().T)

    hidden, ids = torch.randn(6, config.hidden_size), torch.tensor([5, 9, 33, 71, 2, 18])
    with torch.no_grad():
        ref, ref_normed = block(embed[ids][None], hidden[None], torch.arange(1, 7))
    x, logits = head.forward(hidden.numpy(), ids.numpy(), 1)
    np.testing.assert_allclose(x, ref[0].numpy(), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(logits, (ref_normed[0] @ lm.T).numpy(), rtol=2e-4, atol=2e-4)
    with torch.no_grad():           # the chained row: the block's own state at position 6 as the hidden state at 7
        ref7, _ = block(embed[torch.tensor([5, 9, 33, 71, 2, 18, 7])][None],
                        torch.cat([hidden, ref[0, -1:]])[None], torch.arange(1, 8))
    x2, _ = head.forward(x[-1:], [7], 7)
    np.testing.assert_allclose(x2, ref7[0, -1:].numpy(), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("engine", ["packed", "numpy"])
def test_mtp_drafts_on_qwen3_next_give_plain_greedy_output(hybrid_models, tmp_path, engine):
    """Its own MTP block drafts for the tiny Qwen3-Next, 3 a step, verified in one batch with its experts streamed
    at half their bytes: the linear-attention state rolls back to each step's last accepted token, and the text is
    plain greedy decoding's."""
    src, _, _ = with_mtp_block(hybrid_models["qwen3_next"], tmp_path / "qwen3_next")
    runs = []
    for knobs in ({}, {"speculative": 3, "draft": "mtp"}):
        with open_session(str(src), "les", "0.5", engine=engine, tokens=24, **knobs) as s:
            runs.append((s.generate("Once upon a time", 24)["tokens"], s.summary()))
    (plain, _), (drafted, summary) = runs
    assert drafted == plain
    assert summary["draft"] == "mtp" and summary["spec_proposed"] > 0 and summary["draft_s"] > 0


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_gguf_nextn_block_is_the_checkpoints_mtp_block_and_drafts_plain_greedy_output(hybrid_models, tmp_path,
                                                                                        family):
    """A tiny Qwen3-Next or Qwen3.5-MoE with its MTP block, exported to GGUF (f16; qwen3next or qwen35moe): the block
    is one more block with llama.cpp's
    nextn tensors (which stock llama.cpp loads as its MTP), read back as the checkpoint's to f16 rounding, its memory
    in the plan is what it holds, and its drafts on the GGUF (streamed in place) give plain greedy output."""
    from engines.gguf_export import export_gguf
    from workbench.models.gguf_model import GGUFModel
    from workbench.models.hf import HFModel
    from workbench.models.mtp import load_mtp, mtp_bytes
    src, _, _ = with_mtp_block(hybrid_models[family], tmp_path / family, family)
    gguf = export_gguf(HFModel(src), tmp_path / f"{family}.gguf", "f16")
    g = GGUFModel(gguf)
    assert (g.mtp_layers, g.spec.num_layers) == (1, 4) and "blk.4.nextn.eh_proj.weight" in g.mtp_tensors
    ref, got = load_mtp(src, zero_centred=True), load_mtp(gguf)
    assert got.keys() == ref.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-3, atol=1e-4, err_msg=name)
    assert mtp_bytes(gguf) == sum(a.nbytes for a in got.values()) == mtp_bytes(src)
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from child import in_child
    from test_make_gguf import _llama_mtp
    assert in_child(_llama_mtp, gguf) == (4, 1, True)          # stock llama.cpp loads the block as its MTP draft
    runs = []
    for knobs in ({}, {"speculative": 3, "draft": "mtp"}):
        with open_session(str(gguf), "les", "0.5", tokens=24, **knobs) as s:
            runs.append(s.generate("Once upon a time", 24)["tokens"])
    assert runs[0] == runs[1]


def test_a_gguf_without_an_mtp_block_is_refused_in_one_line(hybrid_models, tmp_path):
    from engines.gguf_export import export_gguf
    from workbench.models.hf import HFModel
    gguf = export_gguf(HFModel(hybrid_models["qwen3_next"]), tmp_path / "plain.gguf", "f16")
    res = cli("bench", "--model", str(gguf), "--preset", "les", "--tokens", "4", "--no-record",
              "--set", "speculative=2", "--set", "draft=mtp")
    assert_one_line_error(res, str(gguf), "no MTP layers (qwen3next.nextn_predict_layers is 0)")
