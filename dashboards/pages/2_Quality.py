"""Quality: each design against the teacher (KL, top-1 agreement, routing agreement) and perplexity,
from eval run records (records whose config has an "eval" key, written by `python -m workbench eval ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import altair as alt  # noqa: E402
import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from dashboards import common as C  # noqa: E402
from dashboards import lossy_view as LV  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.runs import runs_dir  # noqa: E402

try:    # the eval verbs' own table (newest record per model, preset, budget and metric; change from the teacher)
    from evals.compare import eval_runs, table
except ImportError:
    eval_runs = table = None

COMMAND = "python -m workbench eval teacher --model demo --preset les --json"

st.set_page_config(page_title="moe-workbench · quality", layout="wide")
st.title("Quality against the teacher")
st.caption("The teacher is the full-precision model with every expert resident and exact routing. Lower perplexity "
           "and KL, higher top-1 and routing agreement are better.")


def flat(summary: dict) -> dict:
    """Scalars of a summary, with one level of nested dicts flattened as parent.key."""
    out = C.scalars(summary)
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in C.scalars(v).items()})
    return out


if LV.RESULTS.exists():
    try:
        lossy, ldf = LV.read(LV.RESULTS)
    except WorkbenchError as e:
        st.warning(str(e))
    else:
        st.subheader("What each lossy lever buys and costs")
        budget = st.selectbox("budget", lossy["budgets"], key="lossy_budget",
                              index=lossy["budgets"].index("0.25") if "0.25" in lossy["budgets"] else 0)
        st.altair_chart(LV.pareto_chart(ldf[ldf["budget"] == budget]), width="stretch", height=360)
        st.caption(f"`{lossy['command']}` ({lossy['created']}) · speed over {lossy['rounds']} alternating cold rounds "
                   f"(median, min-max), KL on {lossy['quality_tokens']} held-out tokens decoded a token a step. "
                   f"Dashed: the Pareto front. les (a square) changes nothing but its experts' quantization.")

records = C.record_configs("eval")
if not records:
    st.info(f"No eval run records in `{runs_dir()}` yet. Compare a design with the teacher with:")
    st.code(COMMAND, language="bash")
    st.stop()

if table is not None:
    t = table(eval_runs())
    if t["rows"]:
        st.subheader("Designs against the teacher")
        head = lambda r: {"model": r["model"], "design": r["preset"], "budget": r["budget"]}
        st.dataframe(pd.DataFrame([{**head(r), **r["metrics"]} for r in t["rows"]]), hide_index=True)
        deltas = [{**head(r), **r["vs_teacher"]} for r in t["rows"] if r["vs_teacher"]]
        if deltas:
            st.caption("change from the teacher row (perplexity relative, accuracies absolute)")
            st.dataframe(pd.DataFrame(deltas), hide_index=True, column_config={
                c: st.column_config.NumberColumn(format="percent") for c in t["columns"] if c.startswith("ppl ")})
        paired = [{**head(r), "measure": c, "difference": p["diff"], "95% low": p["ci"][0], "95% high": p["ci"][1],
                   "significant": "yes" if p["significant"] else "no", "teacher only": p["teacher_only"],
                   "preset only": p["preset_only"], "items": p["n"]}
                  for r in t["rows"] for c, p in r.get("paired", {}).items() if p.get("ci")]
        if paired:
            st.subheader("Paired against the teacher, item by item")
            st.caption("The same items answered by the design and by the teacher: mean difference (design − teacher) "
                       "with its 95% bootstrap interval; significant when the interval excludes 0 (and, for right/wrong "
                       "answers, the exact sign test on the flips gives p < 0.05). Teacher only / "
                       "preset only: the items only one of them got right.")
            st.dataframe(pd.DataFrame(paired), hide_index=True)
        ppl = [c for c in t["columns"] if c.startswith("ppl ")]
        long = pd.DataFrame([{"design": r["preset"], "measure": c, "perplexity": r["metrics"][c]}
                             for r in t["rows"] for c in ppl if r["metrics"].get(c) is not None])
        if not long.empty:
            st.altair_chart(alt.Chart(long, title="perplexity (lower is better)").mark_bar().encode(
                x=alt.X("design:N", sort=None, axis=alt.Axis(labelAngle=0)), xOffset="measure:N",
                y="perplexity:Q", color=alt.Color("measure:N", legend=alt.Legend(orient="bottom", title=None)),
                tooltip=["design", "measure", alt.Tooltip("perplexity:Q", format=".3f")]), width="stretch", height=320)

st.subheader("Eval run records")
by_eval: dict[str, list] = {}
for path, cfg in records:
    try:
        rec = C.read_record(path)
    except Exception as e:  # noqa: BLE001 - a damaged record is named, not raised
        st.warning(f"{Path(path).name}: cannot read this run record ({e})")
        continue
    preset = cfg.get("preset")
    row = {"design": preset.get("name") if isinstance(preset, dict) else preset, "budget": cfg.get("budget"),
           "data": cfg.get("data"), "record": Path(path).name, **flat(rec["summary"])}
    by_eval.setdefault(str(cfg["eval"]), []).append((row, rec))
for name, items in by_eval.items():
    st.markdown(f"**eval {name}** · {len(items)} record(s)")
    st.dataframe(pd.DataFrame([row for row, _ in items]).dropna(axis=1, how="all"), hide_index=True)
    for row, rec in items:
        tables = {k: v for k, v in rec["summary"].items() if isinstance(v, list) and v and isinstance(v[0], dict)}
        if tables:
            with st.expander(f"{name} · {row['design']} · {row['record']}"):
                for k, v in tables.items():
                    st.markdown(f"**{k}**")
                    st.dataframe(pd.DataFrame(v), hide_index=True)
