"""The lossy levers' price on one chart, from `benchmarks/lossy.py`'s results (results/lossy.json): tok/s against
KL from the teacher at one budget, each arm's min-max over its rounds, the Pareto front joined. The Quality page
draws it; a notebook can too."""
from __future__ import annotations

import json
from pathlib import Path

import altair as alt
import pandas as pd

from workbench.errors import WorkbenchError
from workbench.registry import REPO

RESULTS = REPO / "results" / "lossy.json"
COMMAND = "python benchmarks/lossy.py --model demo --budgets 0.1,0.25,0.5 --rounds 3 --out results/lossy.md"
LOSSLESS = ("les",)         # the arms whose output is their design's own (their KL is their quantization's)


def read(path: Path = RESULTS) -> tuple[dict, pd.DataFrame]:
    """The result and one row per arm and budget that ran (budget a string, as the result names it)."""
    try:
        res = json.loads(Path(path).read_text())
        df = pd.DataFrame([r for r in res["rows"] if "not_run" not in r])
        df = df[["arm", "budget", "tok_s", "tok_s_min", "tok_s_max", "kl", "kl_stderr", "top1", "over_les"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WorkbenchError(f"{path}: not a lossy-levers result ({type(e).__name__}: {e})") from None
    df["lossless"] = df["arm"].isin(LOSSLESS)
    df["front"] = [arm in res.get("pareto", {}).get(b, []) for arm, b in zip(df["arm"], df["budget"])]
    return res, df


def pareto_chart(df: pd.DataFrame) -> alt.LayerChart:
    """One budget's arms: tok/s against KL (lower left: slow and exact; upper right: fast and lossy), the gray
    vertical line at the lossless designs' KL (their quantization's: no lever's)."""
    base = alt.Chart(df).encode(x=alt.X("kl:Q", title="KL(teacher || arm), nats a token"),
                                y=alt.Y("tok_s:Q", title="tok/s (median)", scale=alt.Scale(zero=False)))
    front = base.transform_filter(alt.datum.front).mark_line(color="gray", strokeDash=[4, 3]).encode(order="kl:Q")
    spread = base.mark_rule().encode(y="tok_s_min:Q", y2="tok_s_max:Q", color="arm:N")
    points = base.mark_point(filled=True, size=90).encode(
        color=alt.Color("arm:N", legend=alt.Legend(orient="bottom", columns=2, title=None)),
        shape=alt.Shape("lossless:N", legend=None),
        tooltip=["arm", alt.Tooltip("tok_s:Q", format=".1f"), alt.Tooltip("over_les:Q", format=".2f", title="x les"),
                 alt.Tooltip("kl:Q", format=".4f"), alt.Tooltip("top1:Q", format=".3f")])
    lossless = alt.Chart(df).transform_filter(alt.datum.lossless).mark_rule(color="gray").encode(x="kl:Q")
    return lossless + front + spread + points
