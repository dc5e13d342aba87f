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
