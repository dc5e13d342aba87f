"""Multi-token-prediction drafts: the numpy MTP block (engines/mtp.py) computes what the torch block it is trained as
computes (training/mtp.py), and drafting with the demo's MTP head gives plain greedy decoding's output."""
from __future__ import annotations

import numpy as np
import pytest

from test_bad_input import assert_one_line_error, cli
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


@pytest.mark.parametrize("engine", ["packed", "numpy"])
def test_mtp_drafts_give_plain_greedy_output(engine):
    plain, _ = greedy(engine)
    drafted, s = greedy(engine, speculative=2, draft="mtp")
    assert drafted == plain
    assert s["draft"] == "mtp" and s["spec_accepted"] > 0 and s["draft_s"] > 0


def test_a_checkpoint_without_mtp_layers_is_refused_in_one_line(tiny_models):
    res = cli("bench", "--model", str(tiny_models["qwen3_moe"]), "--preset", "les", "--tokens", "4", "--no-record",
              "--set", "speculative=2", "--set", "draft=mtp")
    assert_one_line_error(res, str(tiny_models["qwen3_moe"]), "no MTP layers")


def qwen3_next_mtp_block(config):
    """Qwen3-Next's MTP block put together from transformers' own modules, as the checkpoint's `mtp.*` names lay it
    out (vLLM's Qwen3NextMultiTokenPredictor): the pre-fc norms of the embedding and of the hidden state, `fc`, one
    full-attention decoder layer, the final norm. Returns (modules by mtp name, forward(embeds, hidden, positions))."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    d = config.hidden_size
    config._attn_implementation = "eager"
    full = config.layer_types.index("full_attention")
    mods = torch.nn.ModuleDict({"pre_fc_norm_embedding": m.Qwen3NextRMSNorm(d, config.rms_norm_eps),
                                "pre_fc_norm_hidden": m.Qwen3NextRMSNorm(d, config.rms_norm_eps),
                                "fc": torch.nn.Linear(2 * d, d, bias=False),
                                "layers": torch.nn.ModuleList([m.Qwen3NextDecoderLayer(config, full)]),
                                "norm": m.Qwen3NextRMSNorm(d, config.rms_norm_eps)})
    rotary = m.Qwen3NextRotaryEmbedding(config)

    def forward(embeds, hidden, positions):
        x = mods["fc"](torch.cat([mods["pre_fc_norm_embedding"](embeds), mods["pre_fc_norm_hidden"](hidden)], -1))
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = mods["layers"][0](x, position_embeddings=rotary(x, positions[None]), attention_mask=mask)
        return x, mods["norm"](x)
    return mods, forward


def with_mtp_block(checkpoint, out, seed: int = 0):
    """A copy of the tiny Qwen3-Next at `out` with a random MTP block in a shard of its own (model-mtp.safetensors,
    transformers' names after `mtp.`): (out, its config, the block's reference forward)."""
    import shutil
    from safetensors.torch import save_file
    from transformers import AutoConfig
    shutil.copytree(checkpoint, out)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    mods, block = qwen3_next_mtp_block(config)
    with torch.no_grad():
        for name, p in mods.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08))
    save_file({f"mtp.{k}": v.contiguous() for k, v in mods.state_dict().items()}, out / "model-mtp.safetensors")
    return out, config, block


def test_a_qwen3_next_checkpoints_mtp_block_computes_what_transformers_layers_compute(hybrid_models, tmp_path):
    """The tiny Qwen3-Next's MTP block (its norms stored as w and used as 1 + w, its experts fused as transformers 5
    writes them, beside the checkpoint in its own shard) read by load_mtp and computed by the numpy block: rows at
    positions 1..6, then one row chained from the block's own last state, against transformers' modules."""
    from engines.mtp import MTPHead
    from workbench.models.mtp import load_mtp
    src, config, block = with_mtp_block(hybrid_models["qwen3_next"], tmp_path / "qwen3_next")
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
