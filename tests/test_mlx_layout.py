"""`--model DIR` on a checkpoint in MLX's layout, as mlx-lm's own `convert` writes it (every mlx-community model):
stacked switch_mlp experts with .scales/.biases in bf16, routers kept at 8 bits, config.json's quantization.

The demo is converted by mlx-lm itself at 4 and 8 bits. It runs where it lies: the cache holds a small index
(workbench/store/mlx_index.py); the packed engine's kernels and `--engine mlx` compute from the file's own bytes,
the numpy engine decodes them. mlx-lm's model runs in the checkpoint's bf16 by default; the workbench computes in
float32, so the reference is mlx-lm's own model with its parameters upcast (exactly) to float32
(`model.set_dtype(mx.float32)`). In bf16, mlx-lm's greedy tokens part from float32's on some prompts (one of the
three here, at its sixth token): rounding, not the layout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("WORKBENCH_REQUIRE_MLX"):     # CI (.ci/run) installs the test extra: there a failed import is an error
    import mlx.core as mx
    import mlx_lm  # noqa: F401
else:
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[test]')")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install -e '.[test]')")

from workbench.errors import WorkbenchError               # noqa: E402
from workbench.models.mlx_layout import MLXModel           # noqa: E402
from workbench.registry import MODELS                      # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park"]
RUNS = [("numpy", "on_demand", "1.0"), ("packed", "les", "0.25"), ("packed", "on_demand", "0.25"),
        ("mlx", "on_demand", "0.25"), ("mlx", "les", "0.25")]


@pytest.fixture(scope="module", params=[4, 8])
def converted(request, tmp_path_factory) -> Path:
    from mlx_lm import convert
    out = tmp_path_factory.mktemp("mlx") / f"demo-{request.param}bit"
    convert(str(MODELS["demo"]), mlx_path=str(out), quantize=True, q_bits=request.param, q_group_size=64)
    return out


def mlx_lm_reference(path: Path, prompt: str, tokens: int = 8):
    """mlx-lm's own model on its conversion, in float32: (prompt logits, greedy tokens)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(str(path))
    model.set_dtype(mx.float32)
    ids = tok.encode(prompt)
    logits = np.array(model(mx.array(ids)[None])[0])
    out = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=tokens,
                                                      sampler=lambda x: mx.argmax(x, -1)), range(tokens))]
    return ids, logits, out


def test_reads_mlx_lms_layout_as_mlx_decodes_it(converted):
    """Every tensor and expert, decoded from its bytes where they lie, is mx.dequantize of the same arrays, element
    for element; the routers are 8-bit (mlx-lm's override), the rest at the conversion's bits."""
    m = MLXModel(converted)
    bits = json.loads((converted / "config.json").read_text())["quantization"]["bits"]
    assert m.tensor_kind("layers.0.router") == "mlx:q8g64:bf16" and m.tensor_kind("norm") == "bf16"
    assert m.tensor_kind("layers.0.q") == m.expert_kinds(0)["gate"] == f"mlx:q{bits}g64:bf16"
    arrays = mx.load(str(converted / "model.safetensors"))

    def deq(prefix, b, index=None):
        w, s, z = (arrays[f"{prefix}.{k}"] for k in ("weight", "scales", "biases"))
        if index is not None:
            w, s, z = w[index], s[index], z[index]
        return np.array(mx.dequantize(w, s.astype(mx.float32), z.astype(mx.float32), group_size=64, bits=b))
    assert np.array_equal(m.tensor("layers.3.q"), deq("model.layers.3.self_attn.q_proj", bits))
    assert np.array_equal(m.tensor("layers.3.router"), deq("model.layers.3.mlp.gate", 8))
    assert np.array_equal(m.tensor("embed"), deq("model.embed_tokens", bits))
    assert np.array_equal(m.tensor("norm"), np.array(arrays["model.norm.weight"].astype(mx.float32)))
    for L, e in [(0, 0), (5, 17), (7, 31)]:
        got = m.expert(L, e)
        for p in ("gate", "up", "down"):
            assert np.array_equal(got[p], deq(f"model.layers.{L}.mlp.switch_mlp.{p}_proj", bits, e)), (L, e, p)


def test_greedy_tokens_equal_mlx_lms_on_every_engine(converted, tmp_path, monkeypatch):
    """Streaming (a quarter of the experts, LES and on_demand) on the packed and MLX engines and resident on the
    numpy reference: mlx-lm's first 8 greedy tokens on each prompt, logits within 1e-4 of its own."""
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for prompt in PROMPTS:
        ids, logits, want = mlx_lm_reference(converted, prompt)
        for engine, preset, budget in RUNS:
            with open_session(str(converted), preset, budget=budget, engine=engine) as s:
                assert s.tokenizer.encode(prompt).ids == ids
                assert s.preset.storage.experts == "raw"            # the file's own bits, whatever the preset's
                got = np.asarray(s.step(ids, "prefill"))
                assert np.abs(got - logits).max() < 1e-4, (engine, preset, prompt)
                assert s.generate(ids, 8)["tokens"] == want, (engine, preset, prompt)


def test_every_exact_streaming_path_gives_resident_logits_bit_for_bit(converted):
    """On the packed engine, in-place reads (each run from the 4 KiB boundary before it, scales and biases apart
    from their codes) give the all-resident logits exactly, and the numpy reference's within 2e-5."""
    from runtime.session import open_session
    ids = list(range(3, 40, 3))
    with open_session(str(converted), "on_demand", budget="all", engine="packed") as s:
        resident = np.asarray(s.step(ids, "prefill"))
    with open_session(str(converted), "on_demand", budget="all", engine="numpy") as s:
        assert np.abs(np.asarray(s.step(ids, "prefill")) - resident).max() < 2e-5
    for preset, budget in [("on_demand", "0.25"), ("les", "0.25"), ("smol", "0.5")]:
        with open_session(str(converted), preset, budget=budget, engine="packed") as s:
            assert s.reader.mode == "o_direct"
            assert np.array_equal(np.asarray(s.step(ids, "prefill")), resident), (preset, budget)


def test_mlx_lms_shards_give_the_one_files_logits_bit_for_bit(converted, tmp_path, monkeypatch):
    """mlx-lm's own save_model writes its shards (model-0000i-of-0000n.safetensors and an index; here its
    make_shards at 2 MiB a shard instead of 5 GB): streamed from the nine files where they lie (an expert's gate, up
    and down each from its own), the one-file conversion's logits bit for bit, the cache an index."""
    import mlx_lm.utils
    from mlx_lm import convert
    from runtime.session import open_session
    bits = json.loads((converted / "config.json").read_text())["quantization"]["bits"]
    make_shards = mlx_lm.utils.make_shards

    class MiB(int):                             # make_shards sizes a shard as max_file_size_gb << 30
        def __lshift__(self, _):
            return int(self) << 20
    monkeypatch.setattr(mlx_lm.utils, "make_shards", lambda weights, *_: make_shards(weights, MiB(2)))
    out = tmp_path / "sharded"
    convert(str(MODELS["demo"]), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
    m = MLXModel(out)
    assert len(m.shards) > 2 and any(len({sh.path for rs in m.expert_runs(L, 0).values() for sh, _, _ in rs}) > 1
                                     for L in m.spec.moe_layers)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ids = list(range(3, 40, 3))
    for engine, preset, budget in [("packed", "les", "0.25"), ("packed", "on_demand", "0.25"),
                                   ("numpy", "on_demand", "all")]:
        got = []
        for model in (converted, out):
            with open_session(str(model), preset, budget=budget, engine=engine) as s:
                assert s.pack.path.suffix == ".index" and s.reader.mode == "o_direct"
                got.append(np.asarray(s.step(ids, "prefill")))
                assert len(s.pack.data_paths) == (1 if model == converted else len(m.shards))
        assert np.array_equal(*got), (engine, preset)
    assert all(p.suffix == ".index" for p in (tmp_path / "cache" / "packs").iterdir())


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
                              [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}, timeout=600)


def cache_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_bench_les_writes_nothing_but_a_small_index(converted, tmp_path):
    """`bench --preset les --budget 0.25` grows the workbench cache by under 2 MiB: an index of the file, no pack."""
    cache = tmp_path / "cache"
    res = cli("bench", "--model", str(converted), "--preset", "les", "--budget", "0.25", "--tokens", "8", "--json",
              env={"WORKBENCH_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["reader_mode"] == "o_direct" and rec["bytes_read"] > 0
    files = cache_bytes(cache)
    assert sum(files.values()) < 2 * 2**20, files
    assert [f for f in files if f.startswith("packs")] == [f for f in files if f.endswith(".index")], files


def test_a_precision_the_file_lacks_says_its_pack_first(converted, tmp_path, monkeypatch, capsys):
    """Another storage than the file's is a converted pack: --no-convert refuses it in one line that says its size
    and place, and a pack of ANNOUNCE_BYTES or more is said before it is written (here every one)."""
    import workbench.registry as registry
    from runtime.session import open_session
    cache = tmp_path / "cache"
    res = cli("bench", "--model", str(converted), "--preset", "les", "--budget", "0.25", "--tokens", "2", "--set",
              "experts=q3", "--no-convert", "--json", env={"WORKBENCH_CACHE": str(cache)})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--no-convert" in res.stderr and "GiB" in res.stderr and str(cache / "packs") in res.stderr
    assert not list(cache.rglob("*.pack"))
    monkeypatch.setenv("WORKBENCH_CACHE", str(cache))
    monkeypatch.setattr(registry, "ANNOUNCE_BYTES", 0)
    with open_session(str(converted), "les", budget="0.25", experts="q3") as s:
        assert s.pack.quant == {"experts": "q3", "rest": "raw"}     # the rest kept as the file holds it
        assert s.generate("Once upon a time", 2)["tokens"]
    said = capsys.readouterr().err
    assert "writing a pack of" in said and str(s.pack_path.parent) in said and list(cache.rglob("*.pack"))


@pytest.mark.parametrize("bits,group", [(6, 64), (4, 32), (3, 128)])
def test_other_widths_and_groups_run_on_numpy_and_mlx(bits, group, tmp_path, monkeypatch):
    """mlx-lm's conversions at 6 bits, group 32 and group 128: mlx-lm's greedy tokens on the numpy reference and the
    MLX engine (any width, any group); the packed engine's kernels take group 64 at 2/3/4/8 bits and say so."""
    from mlx_lm import convert
    from runtime.session import open_session
    out = tmp_path / f"demo-{bits}-{group}"
    convert(str(MODELS["demo"]), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ids, logits, want = mlx_lm_reference(out, PROMPTS[2])
    assert MLXModel(out).expert_kinds(0)["down"] == f"mlx:q{bits}g{group}:bf16"
    for engine in ("numpy", "mlx"):
        with open_session(str(out), "les", budget="0.25", engine=engine) as s:
            assert np.abs(np.asarray(s.step(ids, "prefill")) - logits).max() < 1e-4, engine
            assert s.generate(ids, 8)["tokens"] == want, engine
    with pytest.raises(WorkbenchError, match="run it with --engine numpy or --engine mlx"):
        open_session(str(out), "les", budget="0.25", engine="packed")
    with open_session(str(out), "les", budget="0.25") as s:          # the default engine: one that computes it
        assert s.engine.name in ("numpy", "mlx")


def test_info_on_its_config_alone_sizes_it_as_it_runs_in_place(converted, tmp_path):
    """The config.json of mlx-lm's conversion, alone, is sized at the file's own bits as the in-place run holds them
    (mlx-lm's quantization, the 8-bit routers, each expert run in whole pages): the directory's numbers."""
    alone = tmp_path / "config-only"
    alone.mkdir()
    shutil.copy(converted / "config.json", alone / "config.json")
    env = {"WORKBENCH_CACHE": str(tmp_path / "cache")}
    whole, config = (json.loads(cli("info", "--model", str(m), "--preset", "les", "--json", env=env).stdout)
                     for m in (converted, alone))
    assert config["kind"] == "config" and config["engine"] == whole["engine"]
    for k in ("resident_bytes", "cache_slot_bytes", "needed_bytes", "expected_read_bytes_per_token",
              "smallest_budget_bytes"):
        assert abs(config["memory"][k] - whole["memory"][k]) <= 0.05 * whole["memory"][k], k


@pytest.fixture()
def broken(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "broken"))


def test_a_truncated_shard_is_one_line(broken):
    f = broken / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)
    res = cli("info", "--model", str(broken))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "model.safetensors" in res.stderr and "truncated" in res.stderr


def test_quantization_that_does_not_match_the_tensors_is_one_line(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization"]["bits"] = 3 if cfg["quantization"]["bits"] != 3 else 4
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WorkbenchError, match="not .*-bit codes with scales per 64"):
        MLXModel(broken)
    res = cli("info", "--model", str(broken))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
