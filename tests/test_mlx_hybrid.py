"""`--model DIR` on a hybrid linear-attention checkpoint (Qwen3-Next, Qwen3.5-MoE) in MLX's layout, as mlx-lm's own
`convert` writes it (mlx-community's Qwen3-Next-80B-A3B-Instruct-4bit and the like), streamed where it lies.

The Hugging Face checkpoint is tests/hybrid_fixtures.make_hybrid's, sized so that every matrix quantizes at group
64 (each input 64 wide) and written as the real models' are for mlx-lm to read it: Qwen3-Next's rope_theta and
partial_rotary_factor at the config's top level; Qwen3.5-MoE as its multimodal wrapper (model_type qwen3_5_moe,
the text model's config under text_config, its tensors under model.language_model, its experts fused,
gate_up_proj and down_proj), torch_dtype bfloat16. mlx-lm converts it at 4 and 8 bits, group 64 (routers and
shared-expert gates at 8), its tensors in bf16.

mlx-lm's sanitize changes three things on the way, each read as it lies: the zero-centred norms are stored with
their 1 added (the workbench's canonical norm, no 1 added on read); each conv1d kernel is moved to (channels, K, 1)
(the same bytes as Hugging Face's (channels, 1, K)); Qwen3.5's text model is named language_model.model.*. The
reference is mlx-lm's own model on its own conversion, its parameters upcast to float32 (as tests/test_mlx_layout.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("WORKBENCH_REQUIRE_MLX"):
    import mlx.core as mx
    import mlx_lm  # noqa: F401
else:
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[test]')")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[test]')")
pytest.importorskip("transformers")

from hybrid_fixtures import make_hybrid                      # noqa: E402
from test_mlx_layout import cli, mlx_lm_reference            # noqa: E402
from workbench.errors import WorkbenchError                  # noqa: E402
from workbench.models.mlx_layout import MLXModel             # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen3_next", "qwen3_5_moe"]
# every matrix's input 64 wide (hidden, value heads x dim, expert and shared-expert widths): all quantize at group 64
SIZES = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, linear_value_head_dim=16)
PROMPT = "Once upon a time"


def hf_for_mlx_lm(family: str, path: Path) -> Path:
    """make_hybrid's checkpoint as the real ones lie, for mlx-lm to convert (see the module's docstring)."""
    from safetensors.numpy import load_file, save_file
    make_hybrid(family, path, **SIZES)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg["torch_dtype"] = "bfloat16"         # the real ones' dtype, which mlx-lm's convert keeps (the tensors are bf16's)
    if family == "qwen3_next":
        cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"])
    else:
        text, w, out = cfg, load_file(path / "model.safetensors"), {}
        cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "torch_dtype": "bfloat16", "tie_word_embeddings": text.get("tie_word_embeddings", False), "text_config": text}
        for k, v in w.items():
            if ".experts." not in k:
                out[k.replace("model.", "model.language_model.", 1)] = v
        for L in range(text["num_hidden_layers"]):
            p, q = f"model.layers.{L}.mlp.experts", f"model.language_model.layers.{L}.mlp.experts"
            E = range(text["num_experts"])
            out[f"{q}.gate_up_proj"] = np.stack([np.concatenate([w[f"{p}.{e}.gate_proj.weight"],
                                                                 w[f"{p}.{e}.up_proj.weight"]]) for e in E])
            out[f"{q}.down_proj"] = np.stack([w[f"{p}.{e}.down_proj.weight"] for e in E])
        save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request, tmp_path_factory) -> Path:
    return hf_for_mlx_lm(request.param, tmp_path_factory.mktemp("hf") / request.param)


@pytest.fixture(scope="module", params=[4, 8])
def converted(request, hf, tmp_path_factory) -> Path:
    from mlx_lm import convert
    out = tmp_path_factory.mktemp("mlx") / f"{hf.name}-{request.param}bit"
    convert(str(hf), mlx_path=str(out), quantize=True, q_bits=request.param, q_group_size=64)
    return out


def test_every_tensor_and_expert_is_mlx_lms_own_array(converted):
    """Each canonical tensor and every expert, decoded from its bytes where they lie, is mlx-lm's loaded (sanitized)
    parameter, mx.dequantize'd where quantized, element for element: norms with their 1 added as mlx-lm holds them,
    the conv kernel (channels, 1, K) from mlx-lm's (channels, K, 1), A_log and dt_bias as they are."""
    from mlx.utils import tree_flatten
    m = MLXModel(converted)
    q = json.loads((converted / "config.json").read_text())["quantization"]
    bits = q["bits"]
    from mlx_lm import load
    model, _ = load(str(converted))             # as loaded, in bf16: the file's own arrays after sanitize
    params = dict(tree_flatten(model.parameters()))

    def want(module: str, shape, index=None) -> np.ndarray:
        if module not in params and f"{module}.weight" not in params:
            raise KeyError(module)
        if module in params:                    # a bare parameter (A_log, dt_bias)
            return np.array(params[module].astype(mx.float32)).reshape(shape)
        w = params[f"{module}.weight"]
        if f"{module}.scales" not in params:
            a = w if index is None else w[index]
            return np.array(a.astype(mx.float32)).reshape(shape)
        s, z = params[f"{module}.scales"], params[f"{module}.biases"]
        if index is not None:
            w, s, z = w[index], s[index], z[index]
        b = q.get(module, q)["bits"]
        return np.array(mx.dequantize(w, s.astype(mx.float32), z.astype(mx.float32), group_size=64, bits=b)).reshape(shape)

    names = m.names()
    s = m.spec
    assert len(names) == len(set(names)) and "layers.0.lin_conv" in names and "layers.0.shared_gate" in names
    for name in names:
        module = m.where[name][1]
        assert np.array_equal(m.tensor(name), want(module, m.tensor_shape(name))), name
    assert m.tensor_kind("layers.0.router") == m.tensor_kind("layers.0.shared_gate") == "mlx:q8g64:bf16"
    assert m.tensor_kind("layers.3.q") == m.tensor_kind("layers.0.lin_out") == f"mlx:q{bits}g64:bf16"
    assert m.tensor_shape("layers.0.lin_conv") == [2 * 2 * 8 + 4 * 16, 1, 4]
    assert set(m.expert_kinds(0).values()) == {f"mlx:q{bits}g64:bf16"}
    for L in s.moe_layers:
        for e in range(s.num_experts):
            got = m.expert(L, e)
            for p in ("gate", "up", "down"):
                module = m.experts[(L, e, p)][1]
                assert np.array_equal(got[p], want(module, got[p].shape, e)), (L, e, p)


def test_norms_are_the_hugging_face_readers_within_bf16(converted, hf):
    """The canonical names mean the same in both layouts: the MLX file's norm is the Hugging Face reader's 1 + w
    rounded to bf16; every other tensor the reader's within 1.5 steps of its affine grid."""
    from workbench.models.hf import HFModel
    m, h = MLXModel(converted), HFModel(hf)
    assert set(m.names()) == set(h.names())
    for name in m.names():
        a, b = m.tensor(name), h.tensor(name).reshape(m.tensor_shape(name))
        if m.tensor_kind(name) in ("bf16", "f32"):
            assert np.allclose(a, b, rtol=2 ** -8, atol=0), name
        else:                   # within 1.5 steps of the affine grid over its range (bf16 scales and biases)
            bits = int(m.tensor_kind(name).split(":")[1][1:].split("g")[0])
            assert np.abs(a - b).max() <= 1.5 * (b.max() - b.min()) / (2 ** bits - 1), name


RUNS = [("numpy", "on_demand", "1.0"), ("numpy", "les", "0.25"), ("packed", "les", "0.25"),
        ("packed", "on_demand", "0.25"), ("mlx", "on_demand", "0.25"), ("mlx", "les", "0.25")]


def test_logits_and_greedy_tokens_are_mlx_lms(converted, tmp_path, monkeypatch):
    """Prompt logits within 1e-4 of mlx-lm's own model (float32) and its first 8 greedy tokens, on the numpy
    reference resident and streaming, and on the packed and MLX engines streaming a quarter of the experts."""
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ids, logits, want = mlx_lm_reference(converted, PROMPT)
    for engine, preset, budget in RUNS:
        with open_session(str(converted), preset, budget=budget, engine=engine) as s:
            assert s.tokenizer.encode(PROMPT).ids == ids
            assert s.preset.storage.experts == "raw"
            got = np.asarray(s.step(ids, "prefill"))
            assert np.abs(got - logits).max() < 1e-4, (engine, preset, np.abs(got - logits).max())
            assert s.generate(ids, 8)["tokens"] == want, (engine, preset)


def test_a_quarter_of_the_experts_streamed_gives_resident_logits_bit_for_bit(converted, tmp_path, monkeypatch):
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ids = list(range(3, 40, 3))
    for engine in ("numpy", "packed"):
        with open_session(str(converted), "on_demand", budget="all", engine=engine) as s:
            resident = np.asarray(s.step(ids, "prefill"))
        for preset in ("on_demand", "les"):
            with open_session(str(converted), preset, budget="0.25", engine=engine) as s:
                assert s.pack.path.suffix == ".index"
                assert np.array_equal(np.asarray(s.step(ids, "prefill")), resident), (engine, preset)


def test_bench_writes_nothing_but_the_index(converted, tmp_path):
    """`bench --preset les --budget 0.25`: the cache holds the index of the file and nothing else (no pack, no
    tensor changed on read: the norms lie as the model uses them)."""
    cache = tmp_path / "cache"
    res = cli("bench", "--model", str(converted), "--preset", "les", "--budget", "0.25", "--tokens", "4", "--json",
              env={"WORKBENCH_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["bytes_read"] > 0
    files = [p for p in cache.rglob("*") if p.is_file()]
    packs = [p for p in files if "packs" in p.parts]
    assert packs and all(p.suffix == ".index" for p in packs), files
    assert sum(p.stat().st_size for p in files) < 2 * 2**20


def test_an_unsanitized_conv_kernel_is_refused(converted, tmp_path):
    """A file whose conv1d kernel is still (channels, 1, K) was not sanitized by mlx-lm (its norms not shifted
    either): refused in one line rather than read the one way or the other."""
    import shutil
    out = Path(shutil.copytree(converted, tmp_path / "unsanitized"))
    w = mx.load(str(out / "model.safetensors"))
    k = next(k for k in w if k.endswith("layers.0.linear_attn.conv1d.weight"))
    w[k] = mx.contiguous(w[k].swapaxes(1, 2))
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "mlx"})
    with pytest.raises(WorkbenchError, match=r"conv1d.* not mlx-lm's \(channels, 4, 1\)"):
        MLXModel(out)


def test_info_on_its_config_alone_sizes_it_as_it_runs_in_place(converted, tmp_path):
    """mlx-lm's config.json alone (Qwen3.5's overrides named under language_model.) is sized as the directory is: the
    resident bytes within 5%; an expert's slot at most one page a run (nine) over the directory's, never under it
    (the plan gives each run the pages it may straddle; this tiny model's runs are under a page, so where they
    actually start decides), and what the slot sizes at most that much over."""
    import shutil
    alone = tmp_path / "config-only"
    alone.mkdir()
    shutil.copy(converted / "config.json", alone / "config.json")
    env = {"WORKBENCH_CACHE": str(tmp_path / "cache")}
    whole, config = (json.loads(cli("info", "--model", str(m), "--preset", "les", "--json", env=env).stdout)
                     for m in (converted, alone))
    assert config["kind"] == "config" and config["engine"] == whole["engine"] == "packed"
    c, w = config["memory"], whole["memory"]
    assert abs(c["resident_bytes"] - w["resident_bytes"]) <= 0.05 * w["resident_bytes"]
    assert w["cache_slot_bytes"] <= c["cache_slot_bytes"] <= w["cache_slot_bytes"] + 9 * 4096
    r = c["cache_slot_bytes"] / w["cache_slot_bytes"]
    for k in ("needed_bytes", "expected_read_bytes_per_token", "smallest_budget_bytes"):
        assert 0.95 * w[k] <= c[k] <= 1.05 * r * w[k], k


def test_mlx_lms_shards_give_the_one_files_logits_bit_for_bit(converted, hf, tmp_path, monkeypatch):
    """mlx-lm's own sharded save (its make_shards at 64 KiB a shard instead of 5 GB: an expert's gate, up and down in
    different files): streamed from its shards where they lie, the one-file conversion's logits bit for bit."""
    import mlx_lm.utils
    from mlx_lm import convert
    from runtime.session import open_session
    bits = json.loads((converted / "config.json").read_text())["quantization"]["bits"]
    make_shards = mlx_lm.utils.make_shards

    class KiB(int):                             # make_shards sizes a shard as max_file_size_gb << 30
        def __lshift__(self, _):
            return int(self) << 10
    monkeypatch.setattr(mlx_lm.utils, "make_shards", lambda weights, *_: make_shards(weights, KiB(64)))
    out = tmp_path / "sharded"
    convert(str(hf), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
    m = MLXModel(out)
    assert len(m.shards) > 2 and any(len({sh.path for rs in m.expert_runs(L, 0).values() for sh, _, _ in rs}) > 1
                                     for L in m.spec.moe_layers)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ids = list(range(3, 40, 3))
    for engine, preset, budget in [("packed", "les", "0.25"), ("numpy", "on_demand", "all")]:
        got = []
        for model in (converted, out):
            with open_session(str(model), preset, budget=budget, engine=engine) as s:
                assert s.pack.path.suffix == ".index"
                got.append(np.asarray(s.step(ids, "prefill")))
        assert np.array_equal(*got), (engine, preset)


def test_mtp_drafts_on_a_conversion_are_refused_in_one_line(converted):
    """mlx-lm's convert drops a checkpoint's mtp.* (its sanitize): asked for MTP drafts, the directory says so."""
    from test_bad_input import assert_one_line_error, cli
    res = cli("bench", "--model", str(converted), "--preset", "les", "--tokens", "4", "--no-record",
              "--set", "speculative=2", "--set", "draft=mtp")
    assert_one_line_error(res, str(converted), "mlx-lm's convert drops a checkpoint's mtp.* tensors")
