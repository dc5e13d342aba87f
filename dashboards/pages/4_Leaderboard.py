"""Leaderboard: every design on a routing trace at each budget against Belady's bound, from the leaderboard's
results (results/leaderboard*.json, written by `python -m workbench leaderboard TRACE... --out FILE.md`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from dashboards import leaderboard_view as L  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402

COLUMNS = {"design": "design", "hit_rate": "hit rate", "belady_hit_rate": "Belady", "of_belady": "of Belady",
           "reads_per_token": "reads/token", "recall": "recall", "precision": "precision"}

st.set_page_config(page_title="moe-workbench · leaderboard", layout="wide")
st.title("Designs leaderboard")
st.caption("Each design on a recorded routing trace at each cache budget. A prefetching design can pass Belady's hit "
           "rate: a prefetch that lands in time is a hit that demand reads lack.")

boards = {}
for path in L.leaderboard_files():
    try:
        boards[path.name] = L.read_leaderboard(path)
    except WorkbenchError as e:
        st.warning(str(e))
if not boards:
    st.info(f"No leaderboard results in `{L.RESULTS}` yet. Make one with:")
    st.code(L.COMMAND, language="bash")
    st.stop()

name = st.selectbox("leaderboard", list(boards), key="board")
res, df = boards[name]
trace = st.selectbox("trace", res["traces"], key="trace") if len(res["traces"]) > 1 else res["traces"][0]
st.caption(f"`{res.get('command', '(no command recorded)')}` · {L.REPLAY} tok/s on each device profile: "
           f"{res.get('compute', {}).get(trace, 'no compute profile recorded')}.")

rows = df[df["trace"] == trace]
ok, not_run = rows[rows["not_run"].isna()], rows[rows["not_run"].notna()]
ok = ok[ok["budget"].notna()]
if ok.empty:
    st.info(f"No design ran on {trace} in {name}.")
else:
    bound = "on_demand" if "on_demand" in set(ok["design"]) else ok["design"].iloc[0]
    st.altair_chart(L.hit_rate_chart(ok, bound).properties(
        title=f"hit rate against the budget; black: Belady's bound from {bound}'s start"), width="stretch", height=560)
    budgets = sorted(ok["budget"].unique())
    near = min(range(len(budgets)), key=lambda i: abs(budgets[i] - 0.25))     # the budget the docs quote
    budget = st.selectbox("budget", budgets, index=near, format_func="{:g}".format, key="budget")
    at = ok[ok["budget"] == budget].sort_values("hit_rate", ascending=False)
    st.altair_chart(L.of_belady_chart(at).properties(title=f"fraction of Belady's hit rate at budget {budget:g}")
                    .configure_axisX(labelOverlap=False), width="stretch", height=320)   # every design named
    table = pd.concat([at[list(COLUMNS)].rename(columns=COLUMNS),
                       L.simulated(at, res["devices"]).dropna(axis=1, how="all")], axis=1)
    st.markdown(f"**budget {budget:g}** · best hit rate first; tok/s SIMULATED, not measured")
    st.dataframe(table, hide_index=True, height="content", column_config={
        **{c: st.column_config.NumberColumn(format="%.3f") for c in ("hit rate", "Belady", "recall", "precision")},
        "of Belady": st.column_config.NumberColumn(format="%.2f"),
        "reads/token": st.column_config.NumberColumn(format="%.1f"),
        **{c: st.column_config.NumberColumn(format="%.1f") for c in table.columns if c.startswith("tok/s ")}})
if not not_run.empty:
    st.subheader("Not run")
    st.dataframe(not_run[["design", "budget", "not_run"]].rename(columns={"not_run": "why"}), hide_index=True)
said = rows[rows["prediction"].notna()] if "prediction" in rows else rows.iloc[:0]
for design, why in dict(zip(said["design"], said["prediction"])).items():     # how the trace drove its predictor
    st.caption(f"{design}: {why}")
