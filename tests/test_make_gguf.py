"""make-model --out X.gguf: a random checkpoint of a shape in its real llama.cpp architecture, written tensor by
tensor, labelled random, opened by the workbench and by stock llama.cpp (in a child process, tests/child.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[llamacpp]')")

from child import in_child                                     # noqa: E402
from engines.gguf_random import (RECIPES, _SCALES, STD, file_bytes, make_gguf, plan, random_blocks,  # noqa: E402
                                 with_mtp)
from cli import main                                 # noqa: E402
from workbench.errors import WorkbenchError                    # noqa: E402
from workbench.models.gguf_model import GGUFModel              # noqa: E402
from workbench.made_routing import Layout                       # noqa: E402
from workbench.shapes import SHAPES, hf_config, random_label   # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARCH = {"qwen3-30b-a3b": "qwen3moe", "qwen3.6-35b-a3b": "qwen35moe", "qwen3-next-80b-a3b": "qwen3next",
        "minicpm-v-4.7": "qwen35moe"}
SMALL = {"layers": 4, "experts": 12}        # one full-attention layer in the hybrid shapes; top-10 fits


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("made")
    return {shape: make_gguf(shape, root / f"{shape}.gguf", **SMALL) for shape in SHAPES}


@pytest.mark.parametrize("t", sorted(_SCALES))
def test_random_blocks_dequantize_to_mean_0_and_the_intended_std(t):
    x = gguf.quants.dequantize(random_blocks(np.random.Generator(np.random.SFC64(1)), t, 256 * 2048),
                               gguf.GGMLQuantizationType[t])
    assert np.isfinite(x).all()
    assert abs(x.std() / STD - 1) < 0.01 and abs(x.mean()) < 0.02 * STD


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_small_gguf_is_the_real_architecture_at_the_shapes_size(made, shape):
    g = GGUFModel(made[shape])
    spec = plan(shape, **SMALL)[0]
    assert g.arch == ARCH[shape]
    got = {**g.spec.to_dict(), "dense_intermediate_size": 0}     # qwen35moe writes moe ff * top-k there
    if ARCH[shape] == "qwen35moe":                  # its value heads in llama.cpp's order, tiled over the key heads
        assert got["linear"].pop("value_heads") == "tiled"
    assert got == {**spec.to_dict(), "dense_intermediate_size": 0}
    s = SHAPES[shape]
    assert (g.spec.hidden_size, g.spec.moe_intermediate_size, g.spec.top_k, g.spec.num_experts, g.spec.num_layers) \
        == (s["hidden_size"], s["moe_intermediate_size"], s["num_experts_per_tok"], 12, 4)
    if s["hybrid"]:
        assert g.spec.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert g.spec.shared_expert_size == 512 and "blk.0.ffn_gate_inp_shexp.weight" in g.raw
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[ARCH[shape].upper()]]}
    allowed |= {n for t, n in gguf.TENSOR_NAMES.items() if t.name.startswith("NEXTN_")}
    mtp = s["arch"].get("mtp_num_hidden_layers", 0)
    for name in g.raw:
        base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        assert any(base == a.format(bid=i) for a in allowed for i in range(4 + mtp)), name
    assert g.path.stat().st_size - file_bytes(plan(shape, **SMALL)[1]) < 2 ** 20, "the header is small"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_mtp_block_is_written_where_the_real_model_has_one(made, shape):
    """Qwen3-Next and Qwen3.5/3.6-MoE: block 4 after the 4 main layers is a full-attention block with the experts
    and the shared expert, plus nextn's projection and norms (1); the workbench's model is the 4 main layers."""
    g = GGUFModel(made[shape])
    mtp = SHAPES[shape]["arch"].get("mtp_num_hidden_layers", 0)
    assert (g.mtp_layers, g.spec.num_layers, g.meta("{arch}.block_count")) == (mtp, 4, 4 + mtp)
    assert shape in ("qwen3.6-35b-a3b", "qwen3-next-80b-a3b") or not mtp
    blk4 = {n.removeprefix("blk.4.") for n in g.raw if n.startswith("blk.4.")}
    assert set(g.mtp_tensors) == {f"blk.4.{n}" for n in blk4}
    card = json.loads(g.meta("workbench.random_weights"))
    assert any("multi-token-prediction (MTP" in n for n in card["notes"]) == bool(mtp)
    if not mtp:
        assert not blk4
        return
    full = {n.removeprefix("blk.3.") for n in g.raw if n.startswith("blk.3.")}        # layer 3: full attention
    nextn = {"nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"}
    assert blk4 == full | nextn and "ffn_gate_exps.weight" in full and "ffn_up_shexp.weight" in full
    d = g.spec.hidden_size
    assert [int(x) for x in g.raw["blk.4.nextn.eh_proj.weight"].shape] == [2 * d, d]
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert (np.asarray(g.raw[f"blk.4.nextn.{n}.weight"].data) == 1).all()
    w = g._dequantized("blk.4.nextn.eh_proj.weight")
    assert abs(w.std() / STD - 1) < 0.02


def test_dequantized_experts_and_matrices_have_the_intended_std(made):
    g = GGUFModel(made["qwen3-next-80b-a3b"])
    kinds = g.expert_kinds(3)
    assert kinds == {"gate": "gguf:Q2_K", "up": "gguf:Q2_K", "down": "gguf:Q2_K"}, "q2_k_s: the 80B's default"
    end = Layout(with_mtp(g.spec, hf_config("qwen3-next-80b-a3b", 4, 12))).end
    for p, w in g.expert(3, 11).items():
        w = w[end:] if p == "down" else w           # its rows into the routing's dims are scaled (made_routing)
        assert abs(w.std() / STD - 1) < 0.02 and abs(w.mean()) < 0.05 * STD, p
    for name in ("layers.2.lin_out", "lm_head", "layers.0.shared.down", "layers.1.shared.up"):
        w = g.tensor(name)                          # (layers.3.q lays out the routing)
        w = w if name in ("lm_head", "layers.1.shared.up") else w[end:]
        assert abs(w.std() / STD - 1) < 0.02, name
    assert (g.tensor("layers.0.attn_norm") == 1).all()      # norms stored as llama.cpp multiplies (1 + w)
    q4 = GGUFModel(made["qwen3.6-35b-a3b"])
    assert q4.expert_kinds(1) == {"gate": "gguf:Q4_K", "up": "gguf:Q4_K", "down": "gguf:Q4_K"}
    assert q4.expert_kinds(3)["down"] == "gguf:Q6_K", "q4_k_m: llama.cpp's use_more_bits layers (the last eighth)"


def test_the_gguf_is_labelled_random_wherever_it_goes(made, capsys):
    path = made["qwen3-30b-a3b"]
    assert "RANDOM" in random_label(path) and "qwen3moe GGUF (q4_k_m)" in random_label(path)
    card = json.loads(GGUFModel(path).meta("workbench.random_weights"))
    assert card["random_weights"] and card["seed"] == 0 and "12 of 128 experts per layer" in card["notes"]
    assert main(["info", "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "qwen3moe"
    from dashboards.model_size import caption                  # the live page, under its runs
    assert random_label(path) in caption(str(path), None)


@pytest.mark.parametrize("shape,layers", [("qwen3-30b-a3b", 1), ("qwen3.6-35b-a3b", 4)])
def test_the_workbench_runs_it_and_its_runs_are_labelled_random(tmp_path, monkeypatch, shape, layers):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    path = make_gguf(shape, tmp_path / "m.gguf", layers=layers, experts=16)
    from runtime.session import open_session
    with open_session(str(path), "on_demand", budget="0.5") as s:
        s.generate([1, 2, 3], tokens=2)
        assert "RANDOM" in s.summary()["random_weights"]


def _llama_logits(path, ids):
    from engines.llamacpp_engine import LlamaCpp
    with LlamaCpp(path, n_ctx=64, threads=2) as llm:
        return llm.forward(ids)


def _llama_mtp(path):
    """(main layers, MTP layers, an MTP draft context made?) as llama.cpp sees the file with its MTP loaded."""
    from engines.llamacpp_engine import _init
    lc = _init()["lc"]
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts, mp.load_mtp = 0, False, True
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp did not load {path} with load_mtp"
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.ctx_type = 64, 64, 64, lc.LLAMA_CONTEXT_TYPE_MTP
    ctx = lc.llama_init_from_model(model, cp)
    out = (lc.llama_model_n_layer(model), lc.llama_model_n_layer_nextn(model), bool(ctx))
    if ctx:
        lc.llama_free(ctx)
    lc.llama_model_free(model)
    return out


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"])
def test_stock_llamacpp_loads_it_and_gives_finite_logits(made, shape):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    z = in_child(_llama_logits, made[shape], [1, 5, 17, 200])
    assert z.shape[-1] == 4096 and np.isfinite(z).all() and z.std() > 0
    if SHAPES[shape]["arch"].get("mtp_num_hidden_layers"):       # and its MTP block, as a draft model
        assert in_child(_llama_mtp, made[shape]) == (4, 1, True)


def _llama_trace(path, ids):
    from engines.llamacpp_engine import capture_trace
    return capture_trace(path, ids, threads=2)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3.6-35b-a3b", "qwen3-next-80b-a3b"])
def test_llamacpp_traces_every_shape_and_its_router_input_gives_its_router_logits(made, shape):
    """`trace --engine llamacpp` on each architecture: per MoE layer, the recorded router input, normed with the
    layer's own norm and multiplied by its router (the weights as the workbench reads them), is llama.cpp's
    recorded router logits; the recorded experts are the top-k of those logits."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    ids = [1, 5, 17, 200, 33, 7]
    t = in_child(_llama_trace, made[shape], ids)
    m = GGUFModel(made[shape])
    spec = m.spec
    assert t["topk"].shape == (len(ids), len(spec.moe_layers), spec.top_k) and t["moe_layers"] == spec.moe_layers
    for j, L in enumerate(spec.moe_layers):
        h = t["router_input"][:, j].astype(np.float64)
        x = h / np.sqrt((h * h).mean(-1, keepdims=True) + spec.rms_norm_eps) * m.tensor(f"layers.{L}.mlp_norm")
        logits = x @ m.tensor(f"layers.{L}.router").astype(np.float64).T
        np.testing.assert_allclose(logits, t["logits"][:, j], rtol=2e-3, atol=2e-3 * np.abs(logits).max())
        best = np.sort(np.argsort(-t["logits"][:, j], axis=-1)[:, :spec.top_k], -1)
        assert (np.sort(t["topk"][:, j], -1) == best).all()


def test_making_a_model_many_times_the_bound_keeps_memory_flat(tmp_path):
    """Peak RSS of the writer (a fresh process) grows by less than `bound` for a file many times `bound` (the
    Qwen3.6 shape: DeltaNet, gated attention, shared expert and the MTP block)."""
    bound = 64 << 20
    code = ("import resource, subprocess, sys\n"
            "make = ('import sys, engines.gguf_random as g; g.CHUNK = 4 << 20; '\n"
            "        'g.make_gguf(\"qwen3.6-35b-a3b\", sys.argv[1], 4, %d)')\n"
            "subprocess.run([sys.executable, '-c', make, sys.argv[1]], check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}

    def peak(experts, out):
        r = subprocess.run([sys.executable, "-c", code % experts, str(out)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.split()[-1])

    small, big = peak(8, tmp_path / "small.gguf"), peak(64, tmp_path / "big.gguf")
    assert (tmp_path / "big.gguf").stat().st_size > 8 * bound
    assert big - small < bound, f"peak RSS grew {(big - small) / 2**20:.0f} MiB"


def test_bad_requests_are_one_line_errors(tmp_path, capsys, monkeypatch):
    out = tmp_path / "x.gguf"
    for argv, why in [(["--shape", "qwen9"], "--shape 'qwen9': choose one of"),
                      (["--shape", "qwen3-next-80b-a3b", "--layers", "2"], "needs at least 4 layers"),
                      (["--shape", "qwen3-30b-a3b", "--type", "q5_x"], "--type 'q5_x': choose one of"),
                      (["--shape", "qwen3-30b-a3b", "--experts", "4"], "--experts 4")]:
        assert main(["make-model", *argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and "\n" not in err, err
    import workbench.shapes as shapes
    monkeypatch.setattr(shapes, "free_bytes", lambda path: 10 ** 9)
    with pytest.raises(WorkbenchError, match=r"x\.gguf: qwen3-next-80b-a3b \(48 layers, 512 experts, q2_k_s\) needs "
                                             r"27\.\d+ GB, the disk has 1\.00 GB free"):
        make_gguf("qwen3-next-80b-a3b", out)
    assert not list(tmp_path.iterdir()), "nothing written, no temp file left"
    assert set(RECIPES) == {"q4_k_m", "q2_k", "q2_k_s", "q8_0"}


def test_routing_stats_tell_collapsed_from_uniform_routing():
    from experiments.routing_stats import routing_stats
    rng = np.random.default_rng(0)
    same = routing_stats(np.tile(np.arange(8), (200, 2, 1)), 128)
    uniform = routing_stats(np.stack([[rng.choice(128, 8, replace=False) for _ in range(2)] for _ in range(2000)]), 128)
    assert same["entropy"] == pytest.approx(np.log(8) / np.log(128)) and same["lru_hit"]["0.25"] > 0.99
    assert same["reuse"] == 1 and same["hot8_share"] == 1 and same["distinct"] == 8
    assert uniform["entropy"] > 0.99 and uniform["lru_hit"]["0.25"] == pytest.approx(0.25, abs=0.02)
    assert uniform["reuse"] == pytest.approx(8 / 128, abs=0.01) and uniform["distinct_fraction"] == 1


def test_routing_stats_count_as_defined_on_a_small_trace():
    """Two layers, top-2 of 4 experts, four tokens, each statistic by hand."""
    from experiments.routing_stats import routing_stats
    topk = np.array([[[0, 1], [2, 3]], [[1, 2], [2, 3]], [[1, 2], [0, 1]], [[3, 0], [0, 2]]])
    la = np.array([[[-1, -1], [0, 1]], [[-1, -1], [2, 0]], [[-1, -1], [1, 0]], [[-1, -1], [3, 2]]])
    s = routing_stats(topk, 4, fractions=(0.5, 0.75), lookahead=la)
    assert s["reuse_layers"] == [(1 / 2 + 2 / 2 + 0 / 2) / 3, (2 / 2 + 0 / 2 + 1 / 2) / 3]
    # 2 slots: layer 0 hits 1 at t1, 1 and 2 at t2, none at t3 (0 was evicted by 2); layer 1 hits 2 and 3 at t1, 0 at t3
    # 3 slots: layer 0 also hits 0 at t3; layer 1 as with 2 (2 was evicted by 0 and 1)
    assert s["lru_hit"] == {"0.5": 3 / 8, "0.75": pytest.approx((4 + 3) / 16)}
    assert s["hot8_share"] == 1 and s["hot_experts"] == 1
    assert s["hot_share"] == pytest.approx((3 / 8 + 3 / 8) / 2)      # expert 1 in layer 0, 2 in layer 1
    assert s["distinct"] == 4 and s["distinct_fraction"] == 1
    assert s["lookahead_recall"] == pytest.approx((0 / 2 + 1 / 2 + 2 / 2 + 1 / 2) / 4)      # layer 1 alone


CSV = """# route_trace v1
# model=m.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2
# layer=0 expert_bytes=10 dense_bytes=20
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
0,0,0,0,0,3,0.6,0,10
0,0,0,0,1,2,0.4,0,10
0,1,1,0,0,0,0.6,0,10
0,1,1,0,1,1,0.4,0,10
0,1,1,1,0,2,0.6,0,10
0,1,1,1,1,3,0.4,0,10
0,1,2,1,1,3,0.4,0,10
0,1,2,1,0,0,0.6,0,10
0,1,2,0,0,1,0.6,0,10
0,1,2,0,1,2,0.4,0,10
"""


def test_a_route_trace_csv_reads_its_decode_tokens_in_step_order(tmp_path, capsys):
    from experiments.routing_stats import read_route_csv
    p = tmp_path / "t.csv"
    p.write_text(CSV)
    topk, meta = read_route_csv(p)
    assert topk.tolist() == [[[0, 1], [2, 3]], [[1, 2], [0, 3]]]
    assert meta == {"num_experts": 4, "top_k": 2, "layers": 2, "model": "m.gguf"}
    assert main(["routing-stats", str(p), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["tokens"], s["reuse"], s["distinct"]) == (2, (1 / 2 + 1 / 2) / 2, 3)


@pytest.mark.parametrize("edit,why", [
    (lambda t: t.replace("n_expert=4", ""), "not a route_trace v1 CSV"),
    (lambda t: t.replace("0,1,2,0,1,2,0.4", "0,1,2,0,1,x,0.4"), "line 14: a non-integer"),
    (lambda t: t.replace("0,1,2,0,1,2,0.4", "0,1,2,0,1,9,0.4"), "line 14: layer 0, slot 1, expert 9 outside"),
    (lambda t: t.replace("0,1,2,0,1,2,0.4,0,10\n", ""), "step 2 layer 0: fewer than 2 experts routed"),
    (lambda t: t.replace("0,1,", "0,0,"), "no rows of phase 1"),
])
def test_a_malformed_trace_is_one_line_naming_the_file(tmp_path, capsys, edit, why):
    p = tmp_path / "bad.csv"
    p.write_text(edit(CSV))
    assert main(["routing-stats", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and str(p) in err and "\n" not in err, err


def test_routing_stats_refuses_what_is_not_a_trace(tmp_path, capsys):
    for path, why in [(tmp_path / "none.csv", "no such trace file"), (tmp_path / "x.txt", "a routing trace is"),
                      (tmp_path / "none.gguf", "no such GGUF file")]:
        assert main(["routing-stats", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and "\n" not in err, err


def test_a_trace_without_predictions_gets_lookahead_from_its_model_routers(tmp_path):
    """The demo's shipped trace with its recorded predictions dropped: routing-stats computes les's lookahead from
    the trace's router inputs and the demo's routers (the traced pack is gone: the model's name is used), and
    gets the recall the recorded predictions give."""
    from experiments.routing_stats import trace_stats
    from experiments.traces import read_trace, write_trace
    shipped = REPO / "data" / "traces" / "demo-tinystories-256.parquet"
    tr = read_trace(shipped)
    bare = write_trace(tmp_path / "bare.parquet", tr, tr["ids"], {**tr["meta"], "predictions": []})
    assert read_trace(bare)["predictions"] == {}
    got, want = trace_stats(bare), trace_stats(shipped)
    assert want["lookahead_recall"] > 0.5
    assert got["lookahead_recall"] == pytest.approx(want["lookahead_recall"], abs=1e-6)


def _routing(path):
    from experiments.routing_stats import gguf_routing
    return gguf_routing(path, tokens=128)


REAL = json.loads((REPO / "tests" / "fixtures" / "routing_qwen3-30b-a3b.json").read_text())["stats"]


@pytest.mark.slow
def test_a_made_checkpoint_routes_like_the_real_qwen3_30b_a3b_trace(tmp_path):
    """Its own routing of TinyStories in llama.cpp (a 6-layer slice of the 30B shape, every expert), against the real
    trace's statistics (tests/fixtures, made by the command it names): reuse, the LRU curve, the hot experts' share
    and the distinct experts each within 20%, les's lookahead recall inside the published 0.66-0.88."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from experiments.routing_stats import compare, routing_stats
    topk, meta = in_child(_routing, make_gguf("qwen3-30b-a3b", tmp_path / "r.gguf", layers=6, qtype="q2_k"))
    made = routing_stats(topk, meta["num_experts"], lookahead=meta["lookahead"])
    off = {k: v for k, v in compare(made, REAL).items() if v[2] > 0.2}
    assert not off, off
    assert 0.66 <= made["lookahead_recall"] <= 0.88, made["lookahead_recall_layers"]
