"""The designs leaderboard (`python -m workbench leaderboard TRACE... --out results/leaderboard.md`, which writes
results/leaderboard.json beside it) as data frames and charts: hit rate against the budget with Belady's bound, and
each design's fraction of Belady's. Used by the Leaderboard page and notebooks/designs_leaderboard.ipynb."""
from __future__ import annotations

import json
from pathlib import Path

import altair as alt
import pandas as pd

from dashboards.sweep_view import budget_fraction
from experiments.leaderboard import label
from workbench.errors import WorkbenchError

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMMAND = ("python -m workbench leaderboard data/traces/demo-tinystories-256.parquet --model demo "
           "--out results/leaderboard_demo.md --json")
REPLAY = ("Hit rates are the trace's real routing replayed on an instant clock (replay: every read lands at once); "
          "Belady's is optimal replacement with foresight over the same decode accesses.")


def leaderboard_files(root: Path | None = None) -> list[Path]:
    return sorted(Path(root or RESULTS).glob("leaderboard*.json"))


def frame(res: dict) -> pd.DataFrame:
    """The rows of a leaderboard result, a design named as tables name it and the budget as a fraction of all
    experts (None for a size in bytes: no fraction without the model)."""
    df = pd.DataFrame(res["rows"])
    df["design"] = df["design"].map(label)
    df["budget"] = [budget_fraction(b) for b in df["budget"]]
    return df


def read_leaderboard(path) -> tuple[dict, pd.DataFrame]:
    """(the result, its rows as `frame` makes them); a one-line WorkbenchError naming the file when it is not one."""
    path = Path(path)
    try:
        res = json.loads(path.read_text())
        df = frame(res)
        missing = {"trace", "design", "hit_rate", "belady_hit_rate", "of_belady", "simulated_tok_s",
                   "not_run"} - set(df.columns)
        if missing or not isinstance(res["traces"], list) or not isinstance(res["devices"], list):
            raise ValueError(f"no {', '.join(sorted(missing))}" if missing else "traces and devices are not lists")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WorkbenchError(f"{path.name}: not a leaderboard result ({type(e).__name__}: {e})") from None
    return res, df


def hit_rate_chart(df: pd.DataFrame, bound: str = "on_demand", mine: str | None = None) -> alt.LayerChart:
    """Hit rate against the budget, one line per design, and in black Belady's hit rate from `bound`'s start;
    `mine` drawn solid and the others dashed. Facet it by trace where `df` holds several."""
    dash = {} if mine is None else {"strokeDash": alt.condition(alt.datum.design == mine, alt.value([1, 0]),
                                                                alt.value([4, 2]))}
    hit = alt.Chart().mark_line(point=True).encode(
        x=alt.X("budget:Q", title="expert budget (fraction of all experts)"),
        y=alt.Y("hit_rate:Q", title="hit rate", scale=alt.Scale(zero=False)),
        color=alt.Color("design:N", scale=alt.Scale(scheme="tableau20"),
                        legend=alt.Legend(columns=3, orient="bottom", labelLimit=200)),
        **dash, tooltip=["trace", "design", "budget", alt.Tooltip("hit_rate:Q", format=".3f")])
    line = alt.Chart().transform_filter(alt.datum.design == bound).mark_line(color="black", strokeWidth=2).encode(
        x="budget:Q", y="belady_hit_rate:Q")
    return alt.layer(hit, line, data=df)


def of_belady_chart(df: pd.DataFrame, mine: str | None = None) -> alt.LayerChart:
    """Each design's hit rate over Belady's (rows at one budget), best first, with 1 marked."""
    color = alt.value("steelblue") if mine is None else alt.condition(alt.datum.design == mine, alt.value("crimson"),
                                                                        alt.value("steelblue"))
    frac = alt.Chart().mark_bar().encode(
        x=alt.X("design:N", sort="-y", title=None, axis=alt.Axis(labelAngle=-35)),
        y=alt.Y("of_belady:Q", title="hit rate / Belady's"), color=color,
        tooltip=["trace", "design", alt.Tooltip("of_belady:Q", format=".2f")])
    rule = alt.Chart(pd.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[3, 3]).encode(y="y:Q")
    return alt.layer(frac, rule, data=df)


def simulated(df: pd.DataFrame, devices: list[str]) -> pd.DataFrame:
    """One `tok/s DEVICE (SIMULATED)` column per device profile, empty where the row has none."""
    tok_s = lambda d: [s.get(d) if isinstance(s, dict) else None for s in df["simulated_tok_s"]]
    return pd.DataFrame({f"tok/s {d} (SIMULATED)": tok_s(d) for d in devices}, index=df.index)
