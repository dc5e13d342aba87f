"""Sweep tables (runs/sweeps/*.parquet, written by `python -m workbench sweep`) as data frames and charts:
a metric against the cache budget, one line per design. Used by the Sweeps page and the sweep notebook."""
from __future__ import annotations

from pathlib import Path

import altair as alt
import pandas as pd

from workbench.errors import WorkbenchError
from workbench.presets import Budget
from workbench.runs import runs_dir

# (metric, cell kind, axis title): what the grid view draws when the table has it
VIEWS = [("tok_s", "bench", "decode tok/s (median over rounds)"),
         ("kl", "eval teacher", "KL(teacher || design) per token"),
         ("ppl", "eval ppl", "perplexity")]


def sweep_tables(root: Path | None = None) -> list[Path]:
    d = (root or runs_dir()) / "sweeps"
    return sorted(d.glob("*.parquet"), key=lambda p: p.stat().st_mtime, reverse=True) if d.exists() else []


def budget_fraction(text) -> float | None:
    """'0.25' -> 0.25, 'all' -> 1.0; a size in bytes has no fraction without the model (None)."""
    try:
        fraction, _ = Budget(str(text)).parse()
    except WorkbenchError:
        return None
    return fraction or None


def read_sweep(path) -> pd.DataFrame:
    df = pd.read_parquet(path)
    df["budget fraction"] = [budget_fraction(b) for b in df["budget"]]
    return df


def grid_chart(df: pd.DataFrame, metric: str, kind: str, title: str, y_title: str | None = None) -> alt.Chart | None:
    """`metric` against the budget for the finished cells of `kind`, one line per design (None when absent)."""
    if metric not in df:
        return None
    d = df[(df["kind"] == kind) & (df["status"] == "ok") & df[metric].notna() & df["budget fraction"].notna()]
    if d.empty:
        return None
    d = d[["design", "budget fraction", metric, "budget", "node"]]
    return alt.Chart(d, title=title).mark_line(point=True).encode(
        x=alt.X("budget fraction:Q", title="expert cache budget (fraction of all experts)"),
        y=alt.Y(f"{metric}:Q", title=y_title or title), color=alt.Color("design:N", legend=alt.Legend(orient="bottom")),
        tooltip=["design", "budget", alt.Tooltip(f"{metric}:Q", format=".4g"), "node"])
