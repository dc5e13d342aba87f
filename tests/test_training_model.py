"""The trainers' torch decoder (training/model.py) is the model the engine runs: the demo trainer's model,
exported as the trainer exports it, gives the numpy engine's logits (Edge0's use of it: tests/test_edge0.py)."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from conftest import tiny_tokenizer
from runtime.session import open_session

torch = pytest.importorskip("torch")


def test_demo_model_exported_is_what_the_engine_runs(tmp_path):
    from training.demo import DemoConfig, DemoMoE, export
    c = DemoConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = DemoMoE(c)
    with torch.no_grad():                       # bf16-exact weights: the export (bf16) holds them as they are
        for p in model.parameters():
            p.copy_((p * 4 + (1.0 if p.dim() == 1 else 0.0)).to(torch.bfloat16).float())
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"model": model.state_dict(), "config": asdict(c), "args": {}, "step": 0, "log": []}, out / "ckpt.pt")
    tiny_tokenizer(out / "tokenizer.json")
    export(out, tmp_path / "demo-tiny")
    ids = [5, 9, 33, 71, 2, 18, 7, 7, 40]
    with torch.no_grad():
        ours, aux = model(torch.tensor([ids]))
    with open_session(str(tmp_path / "demo-tiny"), "teacher") as s:
        s.engine.reset()
        engine = s.step(ids, "prefill")
    assert float(aux) > 0
    np.testing.assert_allclose(ours[0].numpy(), engine, rtol=1e-4, atol=1e-4)


def test_the_trainers_import_and_sample_their_windows():
    """The Edge0 trainers' command lines load (sample_windows had gone missing from their common module)."""
    import training.edge0_lora  # noqa: F401
    import training.edge0_prerouter  # noqa: F401
    from training.edge0_common import sample_windows
    data = {"a": np.arange(1000), "b": np.arange(5000, 5100)}
    w = sample_windows(data, 6, 16, np.random.default_rng(0))
    assert w.shape == (6, 16) and all((np.diff(r) == 1).all() for r in w)      # contiguous windows of one corpus
