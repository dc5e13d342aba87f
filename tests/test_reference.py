"""The numpy engine agrees element-wise with transformers' implementation of every supported family.

- bf16 packs of bf16-exact checkpoints: our logits equal transformers' fp32 logits within 1e-4.
- quantized packs (q4, q3, q2, q8): our logits equal transformers run on the *dequantized* weights.
- prefill-then-decode through our KV cache equals one full forward.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from conftest import FAMILIES, YARN, make_checkpoint
from workbench.models.hf import HFModel
from runtime.session import open_session
from workbench.store.pack import Pack

TOKENS = [3, 17, 42, 99, 7, 200, 31, 5, 128, 64, 250, 1, 77, 13]
ATOL = 1e-4


def hf_logits(path, ids) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def our_logits(path, preset, ids, decode_from=None) -> np.ndarray:
    with open_session(str(path), preset) as s:
        s.engine.reset()
        if decode_from is None:
            return s.step(ids, "prefill")
        rows = [s.step(ids[:decode_from], "prefill")]
        rows += [s.step([t], "decode") for t in ids[decode_from:]]
        return np.concatenate(rows)


def dequantized_checkpoint(src, pack_path, dst):
    """The pack's weights, dequantized, written back under the source's names (a reference for transformers)."""
    m, pack = HFModel(src), Pack(pack_path)
    tensors = {m.where[name][1]: np.ascontiguousarray(pack.tensor(name)) for name in pack.tensors}
    from workbench.io import Reader
    with Reader(pack_path, direct=False) as r:
        for L in pack.spec.moe_layers:
            for e in range(pack.spec.num_experts):
                w = pack.decode_expert(L, e, [r.read(o, n).copy() for o, n in pack.expert_reads(L, e)])
                for part, arr in w.items():
                    tensors[m.experts[(L, e, part)][1]] = np.ascontiguousarray(arr)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_pack_matches_transformers(tiny_models, family):
    ref = hf_logits(tiny_models[family], TOKENS)
    ours = our_logits(tiny_models[family], "teacher", TOKENS)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(YARN))
def test_yarn_rope_matches_transformers(tmp_path, family):
    """YaRN as configured by DeepSeek-V3 (mscale 1), V2-Lite (mscale 0.707) and a plain Qwen3 long-context setting,
    prefill then decode, past the original context."""
    src = make_checkpoint(family, tmp_path / family, rope_parameters=YARN[family])
    ref = hf_logits(src, TOKENS)
    np.testing.assert_allclose(our_logits(src, "teacher", TOKENS, decode_from=9), ref, atol=ATOL, rtol=0)
    plain = hf_logits(make_checkpoint(family, tmp_path / "plain"), TOKENS)
    assert np.abs(plain - ref).max() > 100 * ATOL          # the scaling matters at these positions


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_with_kv_cache_matches_full_forward(tiny_models, family):
    ref = hf_logits(tiny_models[family], TOKENS)
    ours = our_logits(tiny_models[family], "teacher", TOKENS, decode_from=9)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family,experts,rest", [(f, "q4", "q4") for f in FAMILIES] +
                         [("qwen3_moe", q, "q8") for q in ("q2", "q3", "q8")])
def test_quantized_pack_matches_dequantized_reference(tiny_models, tmp_path, family, experts, rest):
    src = tiny_models[family]
    with open_session(str(src), "resident", experts=experts, rest=rest) as s:
        s.engine.reset()
        ours = s.step(TOKENS, "prefill")
        pack_path = s.pack_path
    ref = hf_logits(dequantized_checkpoint(src, pack_path, tmp_path / "deq"), TOKENS)
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
    # and quantization did change the model: this test compares the right thing
    assert np.abs(ours - hf_logits(src, TOKENS)).max() > 10 * ATOL


def test_sigmoid_group_config_is_read(tiny_models):
    spec = HFModel(tiny_models["dots1"]).spec
    cfg = json.loads((tiny_models["dots1"] / "config.json").read_text())
    assert spec.router == "sigmoid_group"
    assert (spec.n_group, spec.topk_group, spec.routed_scaling_factor) == (4, 2, 2.5)
    assert spec.dense_layers == [0] and spec.shared_expert_size == cfg["moe_intermediate_size"]
