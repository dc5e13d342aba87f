"""Sweeps: a grid of cells run on Ray (`python -m workbench sweep GRID.yaml`), drawn from its sweep table."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import streamlit as st  # noqa: E402

from dashboards.sweep_view import VIEWS, grid_chart, read_sweep, sweep_tables  # noqa: E402
from workbench.runs import runs_dir  # noqa: E402

COMMAND = "python -m workbench sweep benchmarks/grids/demo_budgets.yaml"

st.set_page_config(page_title="moe-workbench · sweeps", layout="wide")
st.title("Sweeps")
st.caption("Every cell of a grid (design × budget × precision × engine × task), each a bench or an evaluation run "
           "as a Ray task; timing cells had their node to themselves. One line per design.")

tables = sweep_tables()
if not tables:
    st.info(f"No sweep tables in `{runs_dir() / 'sweeps'}` yet. Run a grid (locally, or on a cluster with --address):")
    st.code(COMMAND, language="bash")
else:
    path = st.selectbox("sweep", tables, format_func=lambda p: p.stem)
    df = read_sweep(path)
    ok, failed = int((df["status"] == "ok").sum()), int((df["status"] == "failed").sum())
    st.markdown(f"**{path.stem}** · {len(df)} cells: {ok} ok, {failed} failed · nodes: "
                f"{', '.join(sorted(df['node'].dropna().unique()))}")
    charts = [c for m, k, t in VIEWS if (c := grid_chart(df, m, k, t)) is not None]
    cols = st.columns(max(1, min(2, len(charts))))
    for i, chart in enumerate(charts):
        with cols[i % len(cols)]:
            st.altair_chart(chart, width="stretch", height=330)
    for _, r in df[df["status"] == "failed"].iterrows():
        st.warning(f"{r['kind']} {r['design']} at budget {r['budget']} failed after {r['attempts']} attempts: {r['error']}")
    shown = [c for c in ("kind", "design", "budget", "engine", "task", "status", "tok_s", "tok_s_min", "tok_s_max",
                         "hit_rate", "kl", "top1", "ppl", "node", "attempts", "resumed", "run") if c in df]
    st.dataframe(df[shown], hide_index=True)
