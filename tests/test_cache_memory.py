"""At budget 0.25 the expert cache costs the budget's bytes of real memory: the process's peak RSS grows by the
budget's bytes within 10% (against the same run at the smallest budget that runs; experiments/rss.py)."""
from __future__ import annotations

from experiments.rss import growth


def test_peak_rss_grows_by_the_budgets_bytes():
    g = growth("demo", "les", "0.25", tokens=16, repeats=3)
    assert g["arena_bytes"] <= g["budget_bytes"]
    assert abs(g["ratio"] - 1) <= 0.10, g
