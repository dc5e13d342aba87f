"""A Hugging Face directory of several safetensors shards (model-0000i-of-0000n.safetensors and
model.safetensors.index.json) streams where it lies, as one file does: the cache holds an index that maps each
expert part to its shard and offset (workbench/store/safetensors_index.py), the reader holds one fd a shard
(workbench/io.py), and the index is refused once any shard changes. The shards are the ones transformers'
save_pretrained(max_shard_size=...) writes: the demo re-saved in bf16 (nine shards; an expert's down_proj and its
gate_proj can lie in different ones) and in f16.
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

from workbench.errors import WorkbenchError
from workbench.models.hf import HFModel
from workbench.registry import MODELS

REPO = Path(__file__).resolve().parents[1]
IDS = [3, 40, 900, 7, 1000, 22, 5, 17, 200, 31]
RUNS = [("teacher", {}), ("on_demand", dict(budget="0.25", experts="raw")), ("les", dict(budget="0.25", experts="raw")),
        ("smol", dict(budget="0.5", experts="raw"))]


def save_sharded(dtype, out: Path, max_shard_size: str = "8MB") -> Path:
    """The demo as transformers loads it at `dtype` (a torch dtype), saved again in shards by its own
    save_pretrained."""
    import transformers as tf
    tf.Qwen3MoeForCausalLM.from_pretrained(MODELS["demo"], dtype=dtype).save_pretrained(
        out, max_shard_size=max_shard_size)
    shutil.copy(MODELS["demo"] / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def demo_sharded(tmp_path_factory) -> Path:
    import torch
    return save_sharded(torch.bfloat16, tmp_path_factory.mktemp("shards") / "demo-bf16")


def shards(d: Path) -> list[Path]:
    return sorted(d / f for f in set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))


def files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
                              [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}, timeout=600)


def test_the_fixture_spreads_experts_over_shards(demo_sharded):
    m = HFModel(demo_sharded)
    assert len(m.shards) == 9 and set(m.expert_kinds(0).values()) == {"bf16"}
    homes = {tuple(sorted({rs[0][0].path.name for rs in m.expert_runs(L, e).values()}))
             for L in m.spec.moe_layers for e in range(m.spec.num_experts)}
    assert any(len(h) > 1 for h in homes)           # some expert's parts lie in two shards


@pytest.mark.parametrize("engine", ["packed", "numpy"])
def test_shards_give_the_one_files_logits_bit_for_bit(engine, demo_sharded, tmp_path, monkeypatch):
    """The teacher, on_demand, les and smol (at experts=raw: the checkpoint's own bf16) on the nine shards, read
    O_DIRECT from each, give the logits of the one-file demo in place, bit for bit; the cache holds two indexes."""
    from runtime.session import open_session
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for preset, kw in RUNS:
        got = []
        for model in (str(MODELS["demo"]), str(demo_sharded)):
            with open_session(model, preset, engine=engine, **kw) as s:
                assert s.pack.path.suffix == ".index" and s.reader.mode == "o_direct", (preset, model)
                got.append(np.asarray(s.step(IDS, "prefill")))
                if model == str(demo_sharded):
                    assert s.pack.data_paths == [p.resolve() for p in shards(demo_sharded)]
                    assert s.reader.stats()["bytes_read"] > 0
        assert np.array_equal(*got), (engine, preset)
    made = files(tmp_path / "cache")
    assert sorted(f for f in made if f.startswith("packs")) == sorted(f for f in made if f.endswith(".index")), made
    assert len([f for f in made if f.endswith(".index")]) == 2 and sum(made.values()) < 2**20, made


def test_bench_on_shards_grows_the_cache_by_the_index_alone(demo_sharded, tmp_path):
    cache = tmp_path / "cache"
    res = cli("bench", "--model", str(demo_sharded), "--preset", "les", "--budget", "0.25", "--set", "experts=raw",
              "--tokens", "4", "--json", env={"WORKBENCH_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["reader_mode"] == "o_direct" and rec["bytes_read"] > 0
    made = files(cache)
    assert [f for f in made if f.startswith("packs")] == [f for f in made if f.endswith(".index")] != [], made
    assert sum(made.values()) < 2**20, made


def test_f16_shards_keep_their_precision_for_the_teacher(tmp_path, monkeypatch, capsys):
    """A checkpoint of f16 shards (make-model writes them) is its own teacher in place, not a bf16 copy: the index,
    the numpy engine (the packed kernels compute bf16, not f16), transformers' fp32 logits within 1e-4, and
    streaming at a quarter of the experts the resident logits bit for bit; `info --preset teacher` sizes that run."""
    import torch
    from runtime.session import open_session
    from test_reference import hf_logits
    d = save_sharded(torch.float16, tmp_path / "demo-f16")
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    with open_session(str(d), "teacher") as t:
        assert t.pack.path.suffix == ".index" and t.engine.name == "numpy" and len(t.pack.data_paths) > 1
        resident = np.asarray(t.step(IDS, "prefill"))
    assert np.abs(resident - hf_logits(d, IDS)).max() < 1e-4
    with open_session(str(d), "on_demand", budget="0.25", experts="raw") as s:
        assert np.array_equal(np.asarray(s.step(IDS, "prefill")), resident)
    assert not [f for f in files(tmp_path / "cache") if f.endswith(".pack")]
    from cli import main                     # info sizes the teacher as it runs: its index, the numpy engine
    assert main(["info", "--model", str(d), "--preset", "teacher", "--budget", "0.25", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "huggingface" and info["pack"].endswith(".index") and info["engine"] == "numpy"
    assert info["memory"]["cache_slot_bytes"] == 4 * 3 * 256 * 128         # an expert as f32: d 256, ff 128


def test_an_index_is_refused_once_a_shard_changes(demo_sharded, tmp_path, monkeypatch):
    """The index names every shard with its size, mtime and a hash of its header: a shard touched since is one
    line naming it; a run then indexes the directory afresh (its fingerprint changed)."""
    from runtime.session import open_session
    from workbench.store.pack import Pack
    d = Path(shutil.copytree(demo_sharded, tmp_path / "copy"))
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    with open_session(str(d), "on_demand", budget="0.25", experts="raw") as s:
        index = s.pack.path
    st = (d / "model-00004-of-00009.safetensors").stat()
    os.utime(d / "model-00004-of-00009.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(WorkbenchError, match=r"model-00004-of-00009.safetensors changed since this index was made"):
        Pack(index)
    with open_session(str(d), "on_demand", budget="0.25", experts="raw") as s:
        assert s.pack.path != index


def assert_one_line(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("damage", ["truncated", "missing", "unnamed"])
def test_a_bad_shard_is_one_line_naming_it(damage, demo_sharded, tmp_path):
    """A shard cut short, one deleted, or an index naming a file the directory lacks: exit 2, one line naming the
    file, before anything is read or written."""
    d = Path(shutil.copytree(demo_sharded, tmp_path / "bad"))
    name = "model-00005-of-00009.safetensors"
    if damage == "truncated":
        with open(d / name, "r+b") as f:
            f.truncate((d / name).stat().st_size - 4096)
    elif damage == "missing":
        (d / name).unlink()
    else:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.norm.weight"] = name = "model-00010-of-00009.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    env = {"WORKBENCH_CACHE": str(tmp_path / "cache")}
    for verb in (["info", "--model", str(d)],
                 ["bench", "--model", str(d), "--preset", "on_demand", "--set", "experts=raw", "--tokens", "2"]):
        assert_one_line(cli(*verb, env=env), name, *(["truncated"] if damage == "truncated" else ["missing"]))
    assert not files(tmp_path / "cache") or not [f for f in files(tmp_path / "cache") if "packs" in f]


def test_eval_takes_its_teacher_from_another_checkpoint_streamed_from_its_shards(demo_sharded, tiny_models, tmp_path,
                                                                                   monkeypatch):
    """eval teacher --teacher-model: the student (here the demo) against a teacher read from another checkpoint
    (the same weights in nine shards, streamed at a tenth of its experts): the numbers of the demo against its own
    resident teacher, bit for bit. A teacher of another vocabulary or other layers is refused in one line."""
    from evals.teacher import run
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    kw = dict(data="tinystories", n_ctx=64, chunks=2, progress=False, record=False)
    own = run("demo", "les", "0.25", **kw)
    other = run("demo", "les", "0.25", teacher_model=str(demo_sharded), teacher_budget="0.1", **kw)
    for k in ("kl", "top1", "ppl", "ppl_teacher", "routing_agreement"):
        assert other[k] == own[k], k
    assert other["teacher_model"] == str(demo_sharded) and other["peak_rss_bytes"] >= other["teacher_peak_rss_bytes"] > 0
    with pytest.raises(WorkbenchError, match="not the same model's"):
        run("demo", "les", "0.25", teacher_model=str(tiny_models["qwen3_moe"]), **kw)
