"""Edge0: prediction-as-routing drops nothing, the unmerged LoRA is the merged math, mismatched files fail clearly.

A tiny 4-layer Qwen3-MoE (transformers' own classes) with random heads and adapters written beside it.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from conftest import make_checkpoint
from workbench.edge0.artifacts import artifact_path, load_safetensors, model_identity, save_safetensors
from workbench.edge0.serve import LoRA, edge0_counters
from workbench.registry import resolve_pack
from runtime.session import open_session
from workbench.errors import WorkbenchError
from workbench.store.pack import Pack

PROMPT = [5, 9, 33, 71, 2, 18, 5, 9]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("edge0") / "qwen3-4l", num_hidden_layers=4)


def fresh(tiny4, tmp_path, name="m"):
    """A copy of the model of its own name: packs are cached per directory name and content, and Edge0 files are
    looked up beside the checkpoint a pack was converted from."""
    dst = tmp_path / f"{tmp_path.name}-{name}"
    shutil.copytree(tiny4, dst)
    return dst


def pack_of(model_dir, precision="q4") -> Pack:
    return Pack(resolve_pack(str(model_dir), "contiguous", precision, precision))


def write_heads(model_dir, hidden=16, seed=0, skip=1, pack=None, meta=None):
    pack = pack or pack_of(model_dir)
    s = pack.spec
    rng = np.random.default_rng(seed)
    d, E = s.hidden_size, s.num_experts
    f = d + 2 * E
    owners = s.moe_layers[:-1]
    t = {}
    for o in owners:
        t |= {f"heads.{o}.fc1.weight": rng.normal(0, 0.2, (hidden, f)), f"heads.{o}.fc1.bias": rng.normal(0, 0.1, hidden),
              f"heads.{o}.fc2.weight": rng.normal(0, 0.3, (E, hidden)), f"heads.{o}.fc2.bias": rng.normal(0, 0.1, E),
              f"heads.{o}.res.weight": rng.normal(0, 0.3, (E, f))}
    meta = {**model_identity(pack), "owners": owners, "hidden": hidden, "hidden_size": d, "num_experts": E,
            "top_k": s.top_k, "num_layers": s.num_layers, "skip_layers": skip, **(meta or {})}
    return save_safetensors(artifact_path(pack, "prerouter"), t, "prerouter", meta)


def write_lora(model_dir, rank=4, seed=1, pack=None, meta=None):
    pack = pack or pack_of(model_dir)
    s = pack.spec
    rng = np.random.default_rng(seed)
    t = {}
    for L in [L for L in range(s.num_layers) if f"layers.{L}.q" in pack.tensors]:   # a hybrid's DeltaNet layers: none
        for proj in ("q", "k", "v", "o"):
            out, inp = pack.tensors[f"layers.{L}.{proj}"]["shape"]
            t[f"lora.{L}.{proj}.A"] = rng.normal(0, 0.2, (rank, inp))
            t[f"lora.{L}.{proj}.B"] = rng.normal(0, 0.2, (out, rank))
    meta = {**model_identity(pack), "rank": rank, "alpha": 2.0 * rank, "scale": 2.0, "targets": ["q", "k", "v", "o"],
            "num_layers": s.num_layers, **(meta or {})}
    return save_safetensors(artifact_path(pack, "lora"), t, "lora", meta)


def teacher_forced(session, ids):
    session.engine.reset()
    out = [session.step(ids[:1], "prefill")[-1]]
    for i in range(1, len(ids)):
        out.append(session.step([ids[i]], "decode")[-1])
    return np.stack(out)


# ---------------------------------------------------------------- prediction is routing: nothing dropped

@pytest.mark.parametrize("routing", ["prerouter", "prerouter:nolora"])
def test_long_decode_consumes_every_staged_expert(tiny4, tmp_path, routing):
    m = fresh(tiny4, tmp_path)
    write_heads(m)
    write_lora(m)
    with open_session(str(m), "edge0", budget="0.5", routing=routing) as s:
        s.generate(PROMPT, tokens=160)
        c = edge0_counters(s)
        assert c["streamed_layers"] == [1, 2, 3]
        assert c["edge0_routed"] == 159 * 3 * 2            # every decode step, every streamed layer, top-2
        assert c["consumed"] == c["edge0_routed"] and c["dropped"] == 0
        assert c["staged_in_memory"] > 0.9 * c["consumed"]  # staged a token ahead: they have landed
        assert s.tel.prefetch_wasted == 0
        for ev in s.tel.events:
            if ev.phase == "decode" and ev.layer in (1, 2, 3):
                assert sorted(set(ev.predicted)) == ev.routed
        assert (c["lora"] is not None) == (routing == "prerouter")


def test_skip_layers_and_exact_layers(tiny4, tmp_path):
    m = fresh(tiny4, tmp_path)
    write_heads(m, skip=1)
    with open_session(str(m), "edge0", budget="all", predictor="prerouter:2", routing="prerouter:nolora") as s:
        s.generate(PROMPT, tokens=20)
        c = edge0_counters(s)
        assert c["streamed_layers"] == [2, 3] and c["consumed"] == c["edge0_routed"] == 19 * 2 * 2
        # a layer that routes exactly gets no prediction
        assert all(ev.predicted == [] for ev in s.tel.events if ev.layer in (0, 1))


def test_prerouter_routing_differs_from_exact_and_needs_the_predictor(tiny4, tmp_path):
    m = fresh(tiny4, tmp_path)
    write_heads(m)
    with open_session(str(m), "edge0", budget="all", predictor=None, routing="exact") as s:
        exact = teacher_forced(s, PROMPT * 3)
    with open_session(str(m), "edge0", budget="all", routing="prerouter:nolora") as s:
        pre = teacher_forced(s, PROMPT * 3)
    np.testing.assert_array_equal(exact[0], pre[0])        # the prefill token routes exactly
    assert np.abs(exact - pre).max() > 1e-3
    with pytest.raises(WorkbenchError, match="needs predictor prerouter"):
        open_session(str(m), "edge0", budget="all", predictor="history")


# ---------------------------------------------------------------- the LoRA, unmerged

def test_unmerged_lora_equals_merged_dequantized_reference(tiny4, tmp_path):
    m = fresh(tiny4, tmp_path)
    path = write_lora(m)
    ids = PROMPT * 4
    exact = dict(budget="all", predictor=None, routing="exact")
    with open_session(str(m), "edge0", **exact) as s:
        base = teacher_forced(s, ids)
        lora = LoRA.load(s.spec, s.engine.w, s.pack)
        merged_w = lora.merged(s.engine.w)                  # W_int4 dequantized + scale * B A, fp32
    with open_session(str(m), "edge0", deltas=lora.deltas(), **exact) as s:
        unmerged = teacher_forced(s, ids)
    with open_session(str(m), "edge0", weights=merged_w, **exact) as s:
        merged = teacher_forced(s, ids)
    assert lora.path == path and len(merged_w) == 16
    assert np.abs(unmerged - base).max() > 1e-2             # the adapter does something
    np.testing.assert_allclose(unmerged, merged, rtol=1e-4, atol=1e-4)


def test_torch_student_equals_numpy_serving(tiny4, tmp_path):
    """The trainers' torch path (int4 + prerouter + LoRA, whole sequence at once) is what the engine serves."""
    pytest.importorskip("torch")
    m = fresh(tiny4, tmp_path)
    hp, lp = write_heads(m), write_lora(m)
    ids = PROMPT * 3
    with open_session(str(m), "edge0", budget="all", experts="q4") as s:      # the trainers' int4: the affine q4 pack
        served = teacher_forced(s, ids)
    full, inc = student_logits(pack_of(m), ids, hp, lp)
    np.testing.assert_allclose(full, served, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(inc, served, rtol=1e-4, atol=1e-4)


def test_heads_train_on_what_the_torch_teacher_computes(tiny4, tmp_path):
    """The prerouter's training data come from the engine streaming the teacher's experts (any size of model); per
    layer they are the torch teacher's (training/model.py): router input, executed top-k, router logits."""
    torch = pytest.importorskip("torch")
    from training.edge0_common import TorchMoE
    from training.edge0_prerouter import collect
    pack = pack_of(fresh(tiny4, tmp_path), "bf16")
    windows = np.array([PROMPT * 2, PROMPT[::-1] * 2])
    got = collect(pack, windows, log=None)
    with torch.no_grad():
        _, want = TorchMoE(pack)(torch.from_numpy(windows), collect=True)
    assert set(got) == set(want) == set(pack.spec.moe_layers)
    for L, (x, idx, logits) in want.items():
        np.testing.assert_allclose(got[L][0], x.numpy(), rtol=2e-3, atol=2e-3)          # stored in fp16
        assert (np.sort(got[L][1], -1) == np.sort(idx.numpy(), -1)).all()
        np.testing.assert_allclose(got[L][2], logits.numpy(), rtol=1e-4, atol=1e-4)


def student_logits(pack, ids, heads_path, lora_path):
    """The trainers' torch student on `ids`: (whole sequence at once, token by token with its cache)."""
    import torch
    from training.edge0_common import HeadSet, LoRASet, TorchMoE
    heads = HeadSet.from_numpy(*load_safetensors(heads_path, "prerouter"))
    lora = LoRASet.from_numpy(*load_safetensors(lora_path, "lora"))
    student = TorchMoE(pack)
    with torch.no_grad():
        full = student(torch.tensor([ids]), heads=heads, skip_layers=1, lora=lora)[0].numpy()
        cache = {}
        inc = np.stack([student.step(torch.tensor([t]), cache, heads=heads, skip_layers=1, lora=lora)[0].numpy()
                        for t in ids])
    return full, inc


# ---------------------------------------------------------------- files that don't match the model

def test_info_counts_the_edge0_files_a_run_serves(tiny4, tmp_path):
    from test_cli import run_json
    from workbench.edge0.artifacts import edge0_dir, served_bytes
    from workbench.presets import get_preset
    m = fresh(tiny4, tmp_path)
    heads, lora = write_heads(m).stat().st_size, write_lora(m).stat().st_size
    where, edge0 = edge0_dir(pack_of(m)), get_preset("edge0")
    assert served_bytes(where, edge0) == heads + lora
    assert served_bytes(where, edge0.with_(routing="prerouter:nolora")) == heads
    assert served_bytes(where, get_preset("les")) == 0
    info = lambda preset: run_json("info", "--model", str(m), "--preset", preset, "--budget", "0.25")["memory"]
    assert info("edge0")["adapter_bytes"] == heads + lora
    assert info("edge0")["resident_bytes"] - info("les")["resident_bytes"] == heads + lora      # held with the weights


def test_missing_heads_name_the_file(tiny4, tmp_path):
    m = fresh(tiny4, tmp_path)
    with pytest.raises(WorkbenchError, match="prerouter.safetensors: missing"):
        open_session(str(m), "edge0")


@pytest.mark.parametrize("bad,match", [
    (dict(num_layers=6), "num_layers=6"),
    (dict(hidden_size=32), "hidden_size=32"),
    (dict(model_weights_id="0" * 16), "trained for another model"),
])
def test_mismatched_heads_fail_clearly(tiny4, tmp_path, bad, match):
    m = fresh(tiny4, tmp_path)
    path = write_heads(m, meta=bad)
    with pytest.raises(WorkbenchError, match=match) as e:
        open_session(str(m), "edge0", routing="prerouter:nolora")
    assert str(path) in str(e.value)


def test_heads_of_another_checkpoint_fail_clearly(tiny4, tmp_path):
    a, b = fresh(tiny4, tmp_path, "a"), fresh(tiny4, tmp_path, "b")
    other = tmp_path / "other"
    import torch
    import transformers as tf
    cfg = tf.AutoConfig.from_pretrained(a)
    torch.manual_seed(7)
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(other, safe_serialization=True)
    shutil.copy(a / "tokenizer.json", other / "tokenizer.json")
    path = write_heads(b, pack=pack_of(other))              # same architecture, other weights
    (b / "edge0").mkdir()
    shutil.move(str(artifact_path(pack_of(other), "prerouter")), str(b / "edge0" / "prerouter.safetensors"))
    with pytest.raises(WorkbenchError, match="trained for another model") as e:
        open_session(str(b), "edge0", routing="prerouter:nolora")
    assert "prerouter.safetensors" in str(e.value)
    write_heads(a)
    with open_session(str(a), "edge0", routing="prerouter:nolora") as s:   # the right ones load
        assert s.engine.predictor.streamed == {1, 2, 3}
    del path


def test_heads_with_wrong_dims_or_layers_fail_clearly(tiny4, tmp_path):
    m = fresh(tiny4, tmp_path)
    pack = pack_of(m)
    path = write_heads(m, pack=pack)
    t, meta = load_safetensors(path, "prerouter")
    t["heads.0.fc1.weight"] = t["heads.0.fc1.weight"][:, :-8]           # features of a wrong width
    save_safetensors(path, t, "prerouter", meta)
    with pytest.raises(WorkbenchError, match=r"heads\.0\.fc1\.weight has shape") as e:
        open_session(str(m), "edge0", routing="prerouter:nolora")
    assert str(path) in str(e.value)
    t, meta = load_safetensors(write_heads(m, pack=pack), "prerouter")
    meta["owners"] = [0, 1, 2, 3]                                         # a head for a layer with no next layer
    save_safetensors(path, t, "prerouter", meta)
    with pytest.raises(WorkbenchError, match="owner layers"):
        open_session(str(m), "edge0", routing="prerouter:nolora")


@pytest.mark.parametrize("bad,match", [
    (dict(num_layers=2), "num_layers=2"),
    (dict(rank=8), r"lora\.0\.[kqvo]\.A has shape"),
    (dict(model_config_sha256="f" * 64), "trained for another model"),
])
def test_mismatched_lora_fails_clearly(tiny4, tmp_path, bad, match):
    m = fresh(tiny4, tmp_path)
    write_heads(m)
    path = write_lora(m, meta=bad)
    with pytest.raises(WorkbenchError, match=match) as e:
        open_session(str(m), "edge0")
    assert str(path) in str(e.value)


# ---------------------------------------------------------------- the ladder verb

def test_ladder_edge0_cli(tiny4, tmp_path, capsys, fast_probe):
    import json

    from cli import main
    m = fresh(tiny4, tmp_path)
    write_heads(m)
    write_lora(m)
    assert main(["ladder", "edge0", "--model", str(m), "--chunks", "1", "--chunk-tokens", "24", "--tokens", "6",
                 "--rounds", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["rung"] for r in res["rungs"]] == ["int4 exact", "+prerouter routing", "+LoRA"]
    for r in res["rungs"][1:]:
        assert r["consumed"] == r["edge0_routed"] > 0 and r["dropped"] == 0
    assert res["ab"]["arms"]["edge0"]["dropped"] == 0
    assert [r["layer"] for r in res["recall"]] == [1, 2, 3]
    assert set(res["retention"]) >= {"retention", "gain_unmerged", "gain_merged"}
    assert all(r["run"] for r in res["rungs"])


def test_ladder_edge0_a_read_that_keeps_failing(tiny4, tmp_path, capsys, monkeypatch):
    """Its quality rungs load every expert: a failing disk ends it at the first read, one line naming the file,
    the offset and the expert, exit 2, nothing on stdout and no run record."""
    from faults import faults
    from test_faults import assert_names_the_read
    from cli import main
    m = fresh(tiny4, tmp_path)
    write_heads(m)
    write_lora(m)
    from workbench.registry import block_experts
    pack = Pack(resolve_pack(str(m), "contiguous", block_experts("q4"), "q4"))     # the pack its rungs serve
    first = min(off for L in pack.spec.moe_layers for e in range(pack.spec.num_experts)
                for off, _ in pack.expert_reads(L, e))
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with faults(monkeypatch, lambda call, pos, n, r: "eio" if pos >= first else None):
        rc = main(["ladder", "edge0", "--model", str(m), "--chunks", "1", "--chunk-tokens", "24", "--tokens", "6",
                   "--rounds", "1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "Input/output error" in assert_names_the_read(err, pack.path)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
