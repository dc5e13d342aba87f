"""The Leaderboard page (dashboards/pages/4_Leaderboard.py) through Streamlit's AppTest, on leaderboard results
written to a temporary folder: the figure, the table, the rows not run, and a file that is not a leaderboard."""
from __future__ import annotations

import json
import sys

import pyarrow as pa
import pytest
from conftest import REPO
from streamlit.testing.v1 import AppTest

sys.path.insert(0, str(REPO))

from dashboards import leaderboard_view as L  # noqa: E402  (the module the page imports)

PAGE = str(REPO / "dashboards" / "pages" / "4_Leaderboard.py")
TRACES = ["data/traces/a.parquet", "data/traces/b.parquet"]
COMMAND = "python -m workbench leaderboard data/traces/a.parquet data/traces/b.parquet --out results/leaderboard.md"


def row(trace, design, budget, hit, belady, tok_s=None, not_run=None):
    nan = float("nan")
    if not_run:
        return dict(trace=trace, design=design, budget=budget, slots=0, hit_rate=nan, late_rate=nan,
                    reads_per_token=nan, bytes_per_token=nan, belady_hit_rate=nan, of_belady=nan, recall=None,
                    precision=None, simulated_tok_s={}, prediction=None, not_run=not_run)
    return dict(trace=trace, design=design, budget=budget, slots=10, hit_rate=hit, late_rate=0.0, reads_per_token=3.0,
                bytes_per_token=1e6, belady_hit_rate=belady, of_belady=hit / belady, recall=None, precision=None,
                simulated_tok_s={"ufs22-phone": tok_s}, prediction=None, not_run=None)


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A leaderboard of two traces: on_demand, les and the field's LFU at two budgets, smol not run at 0.1."""
    rows = []
    for t, shift in zip(TRACES, (0.0, 0.1)):
        for b, base in (("0.1", 0.3), ("0.25", 0.5)):
            rows += [row(t, "on_demand", b, base + shift, 0.8, 2.0), row(t, "les", b, base + shift + 0.2, 0.8, 3.0),
                     row(t, "workbench.designs.field:LFU", b, base + shift + 0.1, 0.8, 2.5)]
        rows.append(row(t, "smol", "0.1", 0, 0, not_run="the budget gives 3 slots per layer, below top-k (4)"))
    res = {"traces": TRACES, "designs": ["on_demand", "les", "smol", "workbench.designs.field:LFU"],
           "budgets": ["0.1", "0.25"], "devices": ["ufs22-phone"], "rows": rows, "seconds": 1.0, "command": COMMAND,
           "compute": {t: f"SIMULATED with a compute profile of the packed engine ({t})" for t in TRACES}}
    (tmp_path / "leaderboard.json").write_text(json.dumps(res))       # NaN written as the leaderboard writes it
    monkeypatch.setattr(L, "RESULTS", tmp_path)
    return tmp_path


def page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def chart_data(at: AppTest, i: int):
    return pa.ipc.open_stream(at.get("vega_lite_chart")[i].proto.datasets[0].data.data).read_all().to_pandas()


def test_the_page_draws_a_leaderboard_and_says_what_did_not_run(results):
    at = page()
    assert not at.warning and not at.info
    assert at.selectbox(key="board").options == ["leaderboard.json"]
    assert at.selectbox(key="trace").options == TRACES and at.selectbox(key="budget").value == 0.25
    assert any(COMMAND in c.value and "instant clock" in c.value and f"SIMULATED with a compute profile of the "
               f"packed engine ({TRACES[0]})" in c.value for c in at.caption)

    assert len(at.get("vega_lite_chart")) == 2
    hit = chart_data(at, 0)         # hit rate against the budget: every design that ran, on the first trace only
    assert sorted(set(hit["design"])) == ["LFU", "les", "on_demand"] and set(hit["trace"]) == {TRACES[0]}
    assert sorted(hit["budget"].unique()) == [0.1, 0.25]
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert {"field": "belady_hit_rate", "type": "quantitative"} == spec["layer"][1]["encoding"]["y"]

    table = at.dataframe[0].value   # at budget 0.25, best hit rate first
    assert table["design"].tolist() == ["les", "LFU", "on_demand"]
    assert table["hit rate"].tolist() == pytest.approx([0.7, 0.6, 0.5])
    assert table["of Belady"].tolist() == pytest.approx([0.875, 0.75, 0.625])
    assert table["tok/s ufs22-phone (SIMULATED)"].tolist() == [3.0, 2.5, 2.0]

    assert "Not run" in [h.value for h in at.subheader]
    skipped = at.dataframe[1].value
    assert skipped["design"].tolist() == ["smol"] and "below top-k" in skipped["why"].iloc[0]

    at = at.selectbox(key="trace").set_value(TRACES[1]).run()
    assert set(chart_data(at, 0)["trace"]) == {TRACES[1]}
    assert at.dataframe[0].value["hit rate"].tolist() == pytest.approx([0.8, 0.7, 0.6])
    at = at.selectbox(key="budget").set_value(0.1).run()
    assert at.dataframe[0].value["hit rate"].tolist() == pytest.approx([0.6, 0.5, 0.4])


@pytest.mark.parametrize("text", ["{not json", '{"traces": ["a"], "rows": "not rows"}', "[]"])
def test_a_file_that_is_not_a_leaderboard_is_one_warning_naming_it(results, text):
    (results / "leaderboard_broken.json").write_text(text)
    at = page()
    assert len(at.warning) == 1 and at.warning[0].value.startswith("leaderboard_broken.json: not a leaderboard result")
    assert "\n" not in at.warning[0].value
    assert at.selectbox(key="board").options == ["leaderboard.json"] and at.dataframe     # the good one still shown


def test_without_a_leaderboard_the_page_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "RESULTS", tmp_path)
    (tmp_path / "leaderboard.json").write_text("")
    at = page()
    assert len(at.warning) == 1 and "No leaderboard results" in at.info[0].value
    assert [c.value for c in at.code] == [L.COMMAND] and not at.get("vega_lite_chart")


def test_the_shipped_leaderboards_read_without_a_warning():
    at = page()
    assert not at.warning and {"leaderboard.json", "leaderboard_demo.json"} <= set(at.selectbox(key="board").options)
