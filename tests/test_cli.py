"""The CLI's JSON fields are a contract other tools read: each verb with --json prints one JSON object."""
from __future__ import annotations

import json

import pytest

from test_bad_input import cli

BENCH_FIELDS = {"tok_s", "prefill_tok_s", "hit_rate", "bytes_read", "flash_wait_s", "compute_s", "cache_bytes",
                "peak_rss_bytes", "floor_tok_s", "per_layer", "prefetch_recall", "prefetch_precision", "wasted_bytes"}


def run_json(*args) -> dict:
    res = cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.macos
def test_info(tiny_models):
    out = run_json("info", "--model", str(tiny_models["dots1"]))
    assert out["spec"]["family"] == "dots1" and out["spec"]["router"] == "sigmoid_group"


def test_convert_then_info_on_the_pack(tiny_models, tmp_path):
    out = run_json("convert", str(tiny_models["qwen3_moe"]), str(tmp_path / "t.pack"), "--layout", "native",
                   "--experts", "q3", "--rest", "q8")
    assert out["layout"] == "native" and out["quant"] == {"experts": "q3", "rest": "q8"}
    info = run_json("info", "--model", str(tmp_path / "t.pack"))
    assert info["kind"] == "pack" and info["experts"] == 16


@pytest.mark.macos
def test_probe_disk(tmp_path):
    out = run_json("probe-disk", "--path", str(tmp_path), "--seconds", "0.02")
    assert out["mode"] in ("o_direct", "page-cache", "f_nocache+pread")
    assert len(out["points"]) == 20 and all(p["mb_s"] > 0 for p in out["points"])


def test_generate(tiny_models):
    out = run_json("generate", "--model", str(tiny_models["qwen3_moe"]), "--prompt", "Once upon", "--tokens", "5")
    assert len(out["tokens"]) == 5 and isinstance(out["text"], str) and out["tok_s"] > 0


@pytest.mark.macos
@pytest.mark.parametrize("preset", ["on_demand", "les"])
def test_bench_reports_the_contract_fields_and_writes_a_record(tiny_models, preset, surface):
    out = run_json("bench", "--model", str(tiny_models["qwen3_moe"]), "--preset", preset, "--tokens", "8",
                   "--budget", "0.25")
    assert BENCH_FIELDS <= set(out)
    assert out["tokens"] == 8 and out["tok_s"] > 0 and out["floor_tok_s"] >= out["tok_s"] * 0.5
    assert len(out["per_layer"]) == 2 and {"hits", "misses", "wait_s"} <= set(out["per_layer"][0])
    assert out["cache_bytes"] <= out["budget_bytes"]
    from workbench.runs import read_run
    rec = read_run(out["run"])
    assert rec["summary"]["tok_s"] == out["tok_s"] and len(rec["events"]) > 0
    assert (out["reader_mode"] == "f_nocache+pread") == (surface == "macos")
    assert (rec["env"]["cpu"] == "Apple M4 Pro") == (surface == "macos") and rec["env"]["cpu"]
    if preset == "les":
        assert out["prefetch_recall"] is not None and 0 <= out["prefetch_recall"] <= 1


def test_the_oracle_replays_the_routing_of_what_it_decodes_and_is_refused_without_it(tiny_models):
    from workbench.errors import WorkbenchError
    from runtime.plan import plan
    from runtime.session import Session, open_session, oracle_trace
    model = str(tiny_models["qwen3_moe"])
    with pytest.raises(WorkbenchError, match="oracle replays the true routing"):
        Session(plan(model, "oracle", "0.25"))      # it would prefetch nothing: on demand under the oracle's name
    with open_session(model, "oracle", budget="0.25", trace=oracle_trace(model, "oracle", "Once upon", 6)) as s:
        s.generate("Once upon", tokens=6)
        assert s.summary()["prefetch_recall"] == 1.0
    out = run_json("generate", "--model", model, "--preset", "oracle", "--prompt", "Once upon", "--tokens", "5")
    assert len(out["tokens"]) == 5 and out["preset"] == "oracle"


def test_bench_changes_a_preset_knob_by_its_record_name(tiny_models):
    model = str(tiny_models["qwen3_moe"])
    out = run_json("bench", "--model", model, "--preset", "les", "--set", "predictor=oracle", "--tokens", "6",
                   "--budget", "0.25")
    from workbench.runs import read_run
    assert read_run(out["run"])["config"]["preset"]["predictor"] == "oracle" and out["prefetch_recall"] == 1.0
    bad = cli("bench", "--model", model, "--preset", "les", "--set", "predictr=oracle")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "predictr" in bad.stderr
