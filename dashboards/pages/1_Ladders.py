"""Ablation ladders: one knob added per rung. Ours from saved run records, the papers' beside them; below, LES's
ladder SIMULATED on the iPhone profile (results/regimes.json)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import altair as alt  # noqa: E402
import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402

from dashboards import common as C  # noqa: E402
from dashboards import simulated as S  # noqa: E402
from dashboards.published import LADDERS  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402
from workbench.runs import runs_dir  # noqa: E402

COMMAND = "python -m workbench ladder les --model demo --json"

st.set_page_config(page_title="moe-workbench · ladders", layout="wide")
st.title("Ablation ladders")
st.caption("Each rung adds one knob to the rung before. Ours ran on this machine; the published numbers ran on the "
           "paper's device, so compare the shape (speed-up over the first rung) rather than absolute tok/s.")


def ladder_groups() -> dict:
    """{(ladder, model): [(rung, path, config), ...] in rung order}; the newest record of a rung wins."""
    groups, first_seen = {}, {}
    for path, cfg in C.record_configs("ladder"):                 # oldest first
        key = (str(cfg["ladder"]), str(cfg.get("model", "?")))
        rung = str(cfg.get("rung", (cfg.get("preset") or {}).get("name", "?")))
        seen = first_seen.setdefault((key, rung), len(first_seen))
        order = cfg["rung_index"] if isinstance(cfg.get("rung_index"), int) else 1000 + seen
        groups.setdefault(key, {})[rung] = (order, rung, path, cfg)
    return {k: [v[1:] for v in sorted(g.values(), key=lambda v: v[0])] for k, g in sorted(groups.items())}


def published_table(pub: dict) -> pd.DataFrame:
    first = pub["rungs"][0][1]
    return pd.DataFrame([{"rung": r, f"tok/s ({pub['device']})": v, "× first rung": v / first}
                         for r, v in pub["rungs"]])


NUMBER_FORMATS = {"tok/s": "%.2f", "min": "%.2f", "max": "%.2f", "× first rung": "%.2f×", "hit rate": "percent",
                  "recall": "percent", "top-1": "percent", "ppl": "%.3f", "KL/token": "%.4f"}


def show_group(ladder: str, model: str, rungs: list):
    rows = []
    for label, path, cfg in rungs:
        try:
            rec = C.read_record(path)
        except Exception as e:  # noqa: BLE001 - a damaged record is named, not raised
            st.warning(f"{Path(path).name}: cannot read this run record ({e})")
            continue
        s = rec["summary"]
        rows.append({"rung": label, "tok/s": s.get("tok_s"), "min": s.get("tok_s_min"), "max": s.get("tok_s_max"),
                     "hit rate": s.get("hit_rate"), "recall": s.get("prefetch_recall"),
                     "ppl": s.get("heldout_ppl"), "KL/token": s.get("kl_per_token"), "top-1": s.get("top1_agreement"),
                     "budget": cfg.get("budget"), "record": Path(path).name, "cpu": rec["env"].get("cpu", "")})
    if not rows:
        return
    ours = pd.DataFrame(rows)
    speed = ours["tok/s"].dropna()
    ours["× first rung"] = ours["tok/s"] / speed.iloc[0] if len(speed) else None
    pub = LADDERS.get(ladder)
    device = ours["cpu"].iloc[-1] or "this machine"
    if rungs and rungs[-1][2].get("simulated"):        # simulate's records: a virtual clock, not this machine
        device = (f"SIMULATED on the {rungs[-1][2].get('device')} profile, compute measured on {device} · "
                  f"{S.calibration(s)}")
    st.subheader(f"{ladder} ladder · model {model}")
    if len(speed) >= 2:
        mine = f"ours ({device})"
        series = [ours.dropna(subset=["tok/s"]).assign(source=mine)]
        if pub:
            series.append(published_table(pub).assign(source=f"{pub['paper']}: {pub['model']} ({pub['device']})"))
        both = pd.concat([s[["rung", "× first rung", "source"]].assign(step=range(len(s))) for s in series])
        names = dict(enumerate(series[0]["rung"]))
        both["rung #"] = [f"{i}: {names.get(i, r)}" for i, r in zip(both["step"], both["rung"])]
        st.altair_chart(alt.Chart(both, title="speed-up over the first rung").mark_bar().encode(
            x=alt.X("rung #:N", title=None, sort=None,
                    axis=alt.Axis(labelAngle=-30, labelLimit=150, labelOverlap=False)),
            xOffset=alt.XOffset("source:N", sort=[mine]), y=alt.Y("× first rung:Q", title="× first rung"),
            color=alt.Color("source:N", sort=[mine], legend=alt.Legend(orient="bottom", title=None, columns=1,
                                                                         labelLimit=400)),
            tooltip=["source", "rung", alt.Tooltip("× first rung:Q", format=".2f")]), width="stretch", height=330)
    else:
        st.caption("quality rungs: no tok/s to compare, see the table")
    st.markdown(f"**ours** · {device}")
    cols = [c for c in ("rung", "tok/s", "× first rung", "min", "max", "hit rate", "recall", "ppl", "KL/token",
                        "top-1", "budget", "record") if ours[c].notna().any()]
    st.dataframe(ours[cols], hide_index=True, column_config={
        c: st.column_config.NumberColumn(format=f) for c, f in NUMBER_FORMATS.items() if c in cols})
    if pub:
        st.markdown(f"**published** · {pub['paper']}, {pub['model']} on {pub['device']}")
        st.dataframe(published_table(pub), hide_index=True,
                     column_config={"× first rung": st.column_config.NumberColumn(format="%.2f×")})
    else:
        st.caption(f"no published numbers for the {ladder} ladder (dashboards/published.py)")


groups = ladder_groups()
if not groups:
    st.info(f"No ladder run records in `{runs_dir()}` yet. Make the LES ladder (one run record per rung) with:")
    st.code(COMMAND, language="bash")
    st.subheader("Published numbers")
    for name, pub in LADDERS.items():
        st.markdown(f"**{name}** · {pub['paper']}, {pub['model']} on {pub['device']}")
        st.dataframe(published_table(pub), hide_index=True,
                     column_config={"× first rung": st.column_config.NumberColumn(format="%.2f×")})
else:
    cols = st.columns(min(2, len(groups)))
    for i, ((ladder, model), rungs) in enumerate(groups.items()):
        with cols[i % len(cols)]:
            show_group(ladder, model, rungs)


def simulated_ladder():
    """LES's ladder SIMULATED on the iPhone profile (results/regimes.json), the paper's numbers beside it."""
    st.header("SIMULATED: LES's ladder on the iPhone profile")
    try:
        found = S.les_ladder()
    except WorkbenchError as e:
        st.error(str(e))
        return
    if found is None:
        st.info(f"No simulated ladder in `{S.REGIMES}` yet. Make it (simulate, a few minutes) with:")
        st.code(S.COMMAND, language="bash")
        return
    cfg, rows = found
    st.caption(f"SIMULATED, not measured: `simulate` on the {cfg['device']} profile, {cfg['shape_note'] or cfg['shape']}, "
               f"budget {cfg['budget']}, {cfg['tokens']} tokens, driven by the demo trace; compute is this engine's, "
               f"measured on this machine (not the iPhone's), so compare the speed-ups. From {S.REGIMES.name} "
               f"({cfg['when']}, benchmarks/regimes.py). {cfg['calibration']}.")
    both = pd.concat([rows.assign(source=f"SIMULATED ({cfg['device']} profile)", x=rows["SIMULATED ×"]),
                      rows.assign(source="LES paper (iPhone, measured)", x=rows["paper ×"])])
    both["rung #"] = [f"{i}: {r}" for i, r in zip(list(range(len(rows))) * 2, both["rung"])]
    st.altair_chart(alt.Chart(both, title="SIMULATED vs the paper: speed-up over the first rung").mark_bar().encode(
        x=alt.X("rung #:N", title=None, sort=None, axis=alt.Axis(labelAngle=-30, labelLimit=150, labelOverlap=False)),
        xOffset="source:N", y=alt.Y("x:Q", title="× first rung"),
        color=alt.Color("source:N", legend=alt.Legend(orient="bottom", title=None, columns=1, labelLimit=400)),
        tooltip=["source", "rung", alt.Tooltip("x:Q", format=".2f")]), width="stretch", height=330)
    st.markdown(f"**SIMULATED** on the {cfg['device']} profile · **paper**: LES, MiniCPM-V 4.7 LES on an iPhone")
    st.dataframe(rows, hide_index=True, column_config={
        c: st.column_config.NumberColumn(format=f) for c, f in (
            ("paper tok/s", "%.2f"), ("paper ×", "%.2f×"), ("SIMULATED tok/s", "%.2f"), ("SIMULATED ×", "%.2f×"),
            ("SIMULATED hit rate", "percent"), ("SIMULATED Belady tok/s", "%.2f"))})


simulated_ladder()
