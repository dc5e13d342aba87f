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
    """mlx-lm's convert drops a checkpoint's mtp.* (its sanitize): asked for MTP drafts, the directory says so, and
    where a block given back to it is looked for."""
    from test_bad_input import assert_one_line_error, cli
    res = cli("bench", "--model", str(converted), "--preset", "les", "--tokens", "4", "--no-record",
              "--set", "speculative=2", "--set", "draft=mtp")
    assert_one_line_error(res, str(converted), "mlx-lm's convert drops a checkpoint's mtp.* tensors",
                          "mtp/weights.safetensors")


# vllm-mlx's add_mtp_weights scripts: the 1-D norms given their 1; fc, the norms and the shared expert's gate in float
MTP_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
             "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight")
MTP_FLOAT = (*MTP_NORMS, "mtp.fc.weight", ".shared_expert_gate.weight")


def companion(key: str, what: str) -> str:
    """A quantized tensor's scales or biases beside it (vllm-mlx's quantization_companion_key: a bare fused tensor's
    too)."""
    return key.removesuffix("weight") + what if key.endswith(".weight") else f"{key}.{what}"


def add_mtp_as_vllm_mlx(block: Path, converted: Path, out: Path, bits: int | None, file: str = "mtp/weights.safetensors",
                        router_bits: int | None = None, stack: bool = True) -> dict:
    """What vllm-mlx's add_mtp_weights scripts do, with mlx itself, into a copy of the conversion at `out`: the Hugging
    Face block's `mtp.*` in bf16 (the real checkpoints' dtype), its experts stacked into switch_mlp (E, rows, cols)
    (stack=False: left fused, as the Qwen3.5 script leaves a fused source's), 1 added to its norms, every other matrix
    whose rows are at least 64 wide mx.quantize'd at `bits` and group 64 (the router at `router_bits` where given;
    None: all kept bf16, --no-quantize), saved with mx.save_safetensors at `file`. Returns what was written."""
    import shutil
    shutil.copytree(converted, out)
    w = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(block)).items()}
    ex = "mtp.layers.0.mlp.experts."
    if stack:
        if (fused := w.pop(ex + "gate_up_proj", None)) is not None:         # transformers 5 writes them fused
            ff = fused.shape[1] // 2
            parts = {"gate": fused[:, :ff], "up": fused[:, ff:], "down": w.pop(ex + "down_proj")}
        else:
            E = sum(k.startswith(ex) and k.endswith(".gate_proj.weight") for k in w)
            parts = {p: mx.stack([w.pop(f"{ex}{e}.{p}_proj.weight") for e in range(E)]) for p in ("gate", "up", "down")}
        w.update({f"mtp.layers.0.mlp.switch_mlp.{p}_proj.weight": a for p, a in parts.items()})
    written = {}
    for k, a in w.items():
        if k.endswith(MTP_NORMS) and a.ndim == 1:
            a = a + 1.0
        b = router_bits if k == "mtp.layers.0.mlp.gate.weight" and router_bits else bits
        if b is None or k.endswith(MTP_FLOAT) or a.ndim < 2 or a.shape[-1] < 64:
            written[k] = a
        else:
            q, s, z = mx.quantize(a, group_size=64, bits=b)
            written.update({k: q, companion(k, "scales"): s, companion(k, "biases"): z})
    (out / file).parent.mkdir(exist_ok=True)
    mx.save_safetensors(str(out / file), written, metadata={"format": "mlx"})
    return written


def mtp_as_written(written: dict, bits: dict) -> dict:
    """What was written, by load_mtp's names: {name: (float32 array, its bits or None)}, mx.dequantize'd in float32
    (at bits[key], else bits[None]) where quantized, float as it is, the stacked or fused experts one tensor each."""
    out = {}
    for k, a in written.items():
        if k.endswith((".scales", ".biases")):
            continue
        b = None
        if (s := written.get(companion(k, "scales"))) is not None:
            b, z = bits.get(k, bits[None]), written[companion(k, "biases")]
            a = mx.dequantize(a, s.astype(mx.float32), z.astype(mx.float32), group_size=64, bits=b)
        a, name = np.array(a.astype(mx.float32)), k.removeprefix("mtp.")
        ex = "layers.0.mlp.experts."
        if ".switch_mlp." in name:
            out.update({name.replace("switch_mlp.", f"experts.{e}."): (a[e], b) for e in range(a.shape[0])})
        elif name == ex + "gate_up_proj":
            ff = a.shape[1] // 2
            out.update({f"{ex}{e}.{p}_proj.weight": (a[e, i * ff:(i + 1) * ff], b)
                        for e in range(a.shape[0]) for i, p in enumerate(("gate", "up"))})
        elif name == ex + "down_proj":
            out.update({f"{ex}{e}.down_proj.weight": (a[e], b) for e in range(a.shape[0])})
        else:
            out[name] = (a, b)
    return out


def test_an_mtp_block_given_back_as_vllm_mlx_does_is_read_and_drafts_plain_greedy_output(converted, hf, tmp_path,
                                                                                          monkeypatch):
    """A random MTP block (transformers' own modules, test_mtp.with_mtp_block) given back to mlx-lm's conversion as
    vllm-mlx's add_mtp_weights scripts do (add_mtp_as_vllm_mlx): read back as mx.dequantize of what was written
    element for element (float32), the Hugging Face reader's block within 1.5 steps of each matrix's affine grid
    (the norms within bf16 rounding: 1 + w as the zero-centred reader gives them), its memory from the headers alone
    what it decodes to, and its drafts on the packed, MLX and numpy engines give plain greedy decoding's tokens. Kept
    in bf16 (--no-quantize) in Qwen3-Next's model-mtp.safetensors, named in the index as that script does: read as
    written, the model as before. Its experts left fused (as the Qwen3.5 script leaves a fused source's: bare
    `experts.gate_up_proj` codes with `.gate_up_proj.scales`) and its router quantized at other bits than config.json's
    without an override for it (mlx-lm's 8 for routers): refused in one line naming the file and the module; with the
    override, read."""
    from runtime.session import open_session
    from test_mtp import with_mtp_block
    from workbench.models.mtp import has_mtp, load_mtp, mtp_bytes
    bits = json.loads((converted / "config.json").read_text())["quantization"]["bits"]
    src, _, _ = with_mtp_block(hf, tmp_path / "hf", hf.name)
    ref = load_mtp(src, zero_centred=True)

    def check(out: Path, written: dict, at: dict):
        got = load_mtp(out, zero_centred=True)          # as MTPDraft asks for a hybrid: not added to MLX's norms
        want = mtp_as_written(written, at)
        assert got.keys() == want.keys() == ref.keys() and has_mtp(out)
        for name, a in got.items():
            (w, b), r = want[name], ref[name]
            assert a.dtype == np.float32 and np.array_equal(a, w), name
            if b:               # within 1.5 steps of the affine grid over the matrix's range (bf16 scales, biases)
                assert np.abs(a - r).max() <= 1.5 * (r.max() - r.min()) / (2 ** b - 1), name
            else:               # bf16 rounding of the Hugging Face w (then of 1 + w, for the norms)
                assert (np.abs(a - r) <= 2 ** -8 * (np.abs(r) + np.abs(r - 1) * ("norm" in name))).all(), name
        assert mtp_bytes(out) == sum(a.nbytes for a in got.values()) == mtp_bytes(src)

    out = tmp_path / "mlx"
    check(out, add_mtp_as_vllm_mlx(src / "model-mtp.safetensors", converted, out, bits), {None: bits})

    plain = tmp_path / "bf16"
    written = add_mtp_as_vllm_mlx(src / "model-mtp.safetensors", converted, plain, None, "model-mtp.safetensors")
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(written, "model-mtp.safetensors"))
    (plain / "model.safetensors.index.json").write_text(json.dumps(index))
    check(plain, written, {None: None})
    assert MLXModel(plain).names() == MLXModel(converted).names()

    other = tmp_path / "router"
    written = add_mtp_as_vllm_mlx(src / "model-mtp.safetensors", converted, other, bits, router_bits=12 - bits,
                                  stack=False)
    assert "mtp.layers.0.mlp.experts.gate_up_proj.scales" in written
    with pytest.raises(WorkbenchError) as e:
        mtp_bytes(other)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{other / 'mtp/weights.safetensors'}: mtp.layers.0.mlp.gate: ") and \
        f"not {bits}-bit codes" in msg, msg
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization"]["mtp.layers.0.mlp.gate"] = {"group_size": 64, "bits": 12 - bits}
    (other / "config.json").write_text(json.dumps(cfg))
    check(other, written, {None: bits, "mtp.layers.0.mlp.gate.weight": 12 - bits})

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for engine in ("packed", "mlx", "numpy"):
        runs = []
        for knobs in ({}, {"speculative": 3, "draft": "mtp"}):
            with open_session(str(out), "les", "0.5", engine=engine, tokens=24, **knobs) as s:
                runs.append((s.generate(PROMPT, 24)["tokens"], s.summary()))
        (plain_tokens, _), (drafted, summary) = runs
        assert drafted == plain_tokens, engine
        assert summary["draft"] == "mtp" and summary["spec_proposed"] > 0, (engine, summary)
