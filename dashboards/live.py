"""Live dashboard: designs side by side, experts streaming from flash, token by token.

    streamlit run dashboards/live.py

Booth mode, unattended: add ?booth=1 to the URL (optional: &designs=on_demand,les &tokens=48 &pause=6
&model=demo &device=ufs22-phone &shape=qwen3.6-35b-a3b; without designs it alternates between two comparisons; a
shape replaces the model, as the sidebar's model size does; an unknown device or shape is ignored, with a caption).

Each design generates in its own process (dashboards/worker.py); this page only reads the telemetry they send.
"""
import sys
import time
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamlit as st  # noqa: E402

from dashboards import common as C  # noqa: E402
from dashboards import model_size as M  # noqa: E402
from workbench.presets import PRESETS  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402

st.set_page_config(page_title="moe-workbench · live", page_icon="⚡", layout="wide")
BOOTH = st.query_params.get("booth") == "1"
state = st.session_state
state.setdefault("run_ids", [])
state.setdefault("numbers", {})
state.setdefault("records", {})
state.setdefault("refreshes", {})


def numbers_view(ids: list[str], live: bool):
    """Per design: status, text, headline numbers. A fragment redrawing every REFRESH_S s while runs go on."""
    runs = C.get_runs(ids)
    if live and not any(r.active for r in runs):
        st.rerun()   # all finished: redraw the page once, static, with the run records shown
    if not runs:
        return
    state.refreshes["numbers"] = n = state.refreshes.get("numbers", 0) + 1
    for col, run in zip(st.columns(len(runs)), runs):
        with col:
            design_numbers(run, f"view refreshed #{n} at {time.strftime('%H:%M:%S')}" + ("" if live else " · final"))


def design_numbers(run: C.DesignRun, refreshed: str):
    """One layout from the first redraw to the last (placeholders while the design starts): the page does not
    reflow, and so re-lay out every chart below, when the first token lands."""
    snap = run.snapshot()
    st.subheader(run.design, help=PRESETS[run.design].description)
    st.markdown(f"**{run.design} · tokens: {run.generated}** / {run.tokens} · {run.status}")
    st.caption(f"{run.design} · {refreshed}")
    if run.error:
        st.error(run.error)
    if snap is None and not run.active:
        return
    s = snap.summary if snap else {}
    text = (f"<span style='color:#888'>{escape(run.prompt)}</span><b>{escape(run.text)}</b>" if snap else
            "<i style='color:#888'>starting: the pack is converted on first use, then the experts stream from "
            "flash</i>")
    with st.container(height=180 if BOOTH else 120, border=True):
        st.html(f"<div style='line-height:1.4'>{text}</div>")
    shown = C.display_numbers(s)
    items = list(shown.items())
    for row in range(0, len(items), 2):
        for col, (label, value) in zip(st.columns(2), items[row:row + 2]):
            col.metric(label, value)
    st.progress(min(1.0, s.get("cache_bytes", 0) / max(1, s.get("budget_bytes", 0))),
                text=f"expert cache {shown['cache MiB']} of {shown['budget MiB']} MiB budget · "
                     f"process peak RSS {shown['peak RSS MiB']} MiB")
    if snap is None:
        return
    state.numbers[run.design] = {"run_id": run.id, "status": run.status, "shown": shown, "tokens": run.generated,
                                 **{k: s.get(k) for k in C.NUMBER_KEYS}}
    if run.record:
        state.records[run.design] = str(run.record)
        st.success(f"run record: `{run.record}`")
    elif run.status == "stopped":
        st.warning("stopped before the end: no run record written")


def charts_view(ids: list[str]):
    """Per design, the charts (a slower fragment than the numbers: they cost the browser more)."""
    runs = C.get_runs(ids)
    for col, run in zip(st.columns(max(1, len(runs))), runs):
        snap = run.snapshot()
        if snap is None and not run.active:
            continue
        snap = snap or C.EMPTY    # empty charts while a design starts: the browser sets them up before tokens flow
        with col:
            for name, (_, _, height) in C.LIVE_CHARTS.items():
                st.vega_lite_chart(C.chart_data(name, snap), C.chart_spec(name), width="stretch", height=height,
                                   alt=f"{run.design}: {name} chart")
                if C.legend_html(name):
                    st.html(C.legend_html(name))
                if name == "layers":
                    recall = snap.summary.get("prefetch_recall")
                    st.caption("waiting for the first tokens" if snap is C.EMPTY else "no predictor: nothing prefetched"
                               if recall is None else f"prefetch recall, all layers: {recall:.1%}")


def shape_model(shape: str, trace: str | None) -> tuple[str, str]:
    """(model, routing trace) for a model size: its random-weight checkpoint, made here the first time (a spinner
    meanwhile), and the trace that drives it (the demo trace unless one is given)."""
    p = M.plan(shape, trace)
    if not M.made(p):
        with st.spinner(f"making the RANDOM-weight checkpoint of {p.label} (once: later runs reuse it) ..."):
            M.make(p)
    return str(p.path), p.trace


def start(model, designs, budget, prompt, tokens, device=None, routing_trace=None, shape=None):
    C.stop_runs(state.run_ids)
    state.run_ids, state.numbers, state.records = [], {}, {}
    try:
        if shape:
            model, routing_trace = shape_model(shape, routing_trace)
        C.check_inputs(model, designs, budget, prompt, tokens)
    except WorkbenchError as e:
        st.error(str(e))
        return
    state.run_ids = C.start_runs(model, designs, budget, prompt, tokens, device, routing_trace)


THIS_MACHINE = "this machine (real reads)"


def sidebar():
    """The controls; returns the settings when Start was pressed, else None."""
    with st.sidebar:
        st.header("Compare designs")
        size = st.selectbox("model size", M.choices(), key="shape",
                            help="demo: the model named below. A real model's shape: a RANDOM-weight checkpoint of its "
                                 f"expert size ({M.LAYERS} layers; made once, in the workbench cache) that every "
                                 "design runs with its routing replayed from the routing trace (the demo trace "
                                 "unless one is given below)")
        model = st.text_input("model", "demo", key="model", disabled=size != M.DEMO,
                              help="`demo` (data/models/demo-moe), a Hugging Face directory, or a pack "
                                   "(model size demo only)")
        designs = st.multiselect("designs to compare", list(PRESETS), default=C.default_designs(), key="designs",
                                 help="presets from workbench/presets.py")
        budget = st.text_input("expert budget", "0.25", key="budget",
                               help="a fraction of all experts (0.25), a size (96MiB), or all")
        prompt = st.text_area("prompt", "Once upon a time", key="prompt", height=80)
        tokens = st.number_input("tokens", min_value=1, max_value=2048, value=64, step=8, key="tokens")
        from workbench.devices import names
        flash = st.selectbox("flash", [THIS_MACHINE] + [n for n in names() if n != "this-machine"], key="device",
                             help="an emulated device (data/devices): every read takes at least its profile's time")
        trace = st.text_input("routing trace", "", key="routing_trace",
                              help="optional: route and prefetch as recorded in this trace (e.g. data/traces/"
                                   "demo-tinystories-256.parquet), for a make-model checkpoint of a real model's shape")
        go, halt = st.columns(2)
        pressed = go.button("Start", type="primary", key="start", width="stretch")
        if halt.button("Stop", key="stop", width="stretch"):
            C.stop_runs(state.run_ids)
        st.caption("Designs whose preset keeps every expert resident (resident, teacher) ignore the budget.")
    device, shape = None if flash == THIS_MACHINE else flash, None if size == M.DEMO else size
    return ((model.strip(), designs, budget.strip(), prompt, int(tokens), device, trace.strip() or None, shape)
            if pressed else None)


def booth_settings() -> dict:
    """The booth's settings from the URL; `notes` says what was ignored, and why."""
    from workbench.devices import names
    q = st.query_params
    try:
        tokens, pause = int(q.get("tokens", 48)), float(q.get("pause", 6))
    except ValueError:
        tokens, pause = 48, 6.0
    designs = [d for d in q.get("designs", "").split(",") if d in PRESETS]
    cfg = {"model": q.get("model", "demo"), "tokens": max(1, tokens), "pause": pause, "designs": designs,
           "device": q.get("device") or None, "routing_trace": None, "notes": []}
    if cfg["device"] == "this-machine":
        cfg["device"] = None
    elif cfg["device"] and cfg["device"] not in names():
        cfg["notes"].append(f"device={cfg['device']!r} ignored: not a device profile in data/devices (one of "
                            f"{', '.join(names())}); the flash is this machine's")
        cfg["device"] = None
    shape = q.get("shape") or M.DEMO
    if shape != M.DEMO:
        try:
            cfg["model"], cfg["routing_trace"] = shape_model(shape, None)
        except WorkbenchError as e:
            cfg["notes"].append(f"shape={shape!r} ignored ({e}); the model is {cfg['model']}")
    return cfg


@st.fragment(run_every=1.0)
def booth_controller():
    """Booth: start the next round (prompt and designs) a few seconds after the last one ends."""
    b = state.setdefault("booth", {"round": -1, "done_at": None})
    runs, cfg, now = C.get_runs(state.run_ids), state.booth_cfg, time.time()
    st.caption(f"booth · round {b['round'] + 1} · a new round starts {cfg['pause']:g} s after every design finishes")
    if any(r.active for r in runs):
        return
    if runs and b["done_at"] is None:
        b["done_at"] = now
    if not runs or now - b["done_at"] >= cfg["pause"]:
        b["round"], b["done_at"] = b["round"] + 1, None
        prompt, designs = C.booth_round(b["round"], cfg["model"])
        state.run_ids = C.start_runs(cfg["model"], cfg["designs"] or designs, "0.25", prompt, cfg["tokens"],
                                     cfg["device"], cfg["routing_trace"])
        st.rerun()


if BOOTH:
    st.markdown("<style>html{font-size:22px} [data-testid=stSidebar],[data-testid=stSidebarCollapsedControl],"
                "[data-testid=stHeader],[data-testid=stToolbar]{display:none} "
                "[data-testid=stMetricValue]{font-size:2.4rem}</style>", unsafe_allow_html=True)
    st.title("Experts streaming from flash, live")
    state.booth_cfg = booth_settings()
    for note in state.booth_cfg["notes"]:
        st.caption(note)
else:
    st.title("Live: MoE experts streaming from flash")
    settings = sidebar()
    if settings:
        start(*settings)

runs = C.get_runs(state.run_ids)
if not runs and not BOOTH:
    st.info("Pick designs and a budget in the sidebar, then press **Start**. Each design generates the same "
            "prompt in its own process; the charts follow the tokens as they come.")
elif runs:
    if len({r.prompt for r in runs}) == 1 and BOOTH:
        st.markdown(f"### “{runs[0].prompt}”")
    ids, live = [r.id for r in runs], any(r.active for r in runs)
    st.caption(C.cores_note(len(runs)))
    if runs[0].device:
        st.caption(f"Flash: EMULATED {runs[0].device} (this machine's reads, each slowed to the profile's time in "
                   "data/devices); its tok/s are not this machine's.")
    random_weights = M.caption(runs[0].model, runs[0].routing_trace)
    if random_weights:
        st.caption(random_weights)
    elif runs[0].routing_trace:
        st.caption(f"Routing and prefetches replayed from {M.shown(runs[0].routing_trace)} (the text is not the "
                   "model's).")
    (st.fragment(run_every=C.REFRESH_S)(numbers_view) if live else numbers_view)(ids, live)
    (st.fragment(run_every=C.CHARTS_REFRESH_S)(charts_view) if live else charts_view)(ids)
if BOOTH:
    booth_controller()     # last: it starts the next round once this one is over
