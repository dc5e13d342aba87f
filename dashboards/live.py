"""Live dashboard: designs side by side, experts streaming from flash, token by token.

    streamlit run dashboards/live.py --server.address 127.0.0.1     (make demo; HOST=0.0.0.0 opens it to a network)

Booth mode, unattended, a kiosk (dashboards/kiosk.py, docs/booth.md): `make booth` (python -m dashboards.booth)
prepares what it will show, then every page of its server is the booth. On a plain page, ?booth=1 in the URL
(optional: &designs=on_demand,les &tokens=48 &pause=6 &model=demo &trace=NAME &device=ufs22-phone
&shape=qwen3.6-35b-a3b &lever=drop_misses; names from the allow-list only, never paths; without designs it alternates between two
comparisons; a shape replaces the model, as the sidebar's model size does, once it is made; what is not on the
allow-list is ignored, with a caption). A visitor can Start and Stop the comparison shown, nothing else.

Each design generates in its own process (dashboards/worker.py); this page only reads the telemetry they send.
"""
import sys
import time
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamlit as st  # noqa: E402

from dashboards import common as C  # noqa: E402
from dashboards import kiosk as K  # noqa: E402
from dashboards import model_size as M  # noqa: E402
from dashboards import rounds as R  # noqa: E402
from workbench.presets import PRESETS, get_preset  # noqa: E402
from workbench.errors import WorkbenchError  # noqa: E402

st.set_page_config(page_title="moe-workbench · live", page_icon="⚡", layout="wide")
try:
    KIOSK = K.load()            # the operator's booth (make booth): then every session is the booth
except WorkbenchError as e:
    st.error(str(e))
    st.stop()
BOOTH = KIOSK is not None or st.query_params.get("booth") == "1"
if KIOSK is not None:       # this page alone: the kiosk serves none of pages/ (st.navigation replaces that folder)
    def booth():
        pass
    st.navigation([st.Page(booth, title="booth", default=True)], position="hidden").run()
LOCAL = K.is_local(st.get_option("server.address"))
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
    st.subheader(run.name, help=get_preset(run.design).description)
    st.markdown(f"**{run.name} · tokens: {run.generated}** / {run.tokens} · {run.status}")
    st.caption(f"{run.name} · {refreshed}")
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
    if run.judged:
        verdict_numbers(run)
    st.progress(min(1.0, s.get("cache_bytes", 0) / max(1, s.get("budget_bytes", 0))),
                text=f"expert cache {shown['cache MiB']} of {shown['budget MiB']} MiB budget · "
                     f"process peak RSS {shown['peak RSS MiB']} MiB")
    if snap is None:
        return
    state.numbers[run.name] = {"run_id": run.id, "status": run.status, "shown": shown, "tokens": run.generated,
                                 **{k: s.get(k) for k in C.NUMBER_KEYS}}
    if run.record:
        state.records[run.name] = str(run.record)
        st.success(f"run record: `{run.record}`")
    elif run.status == "stopped":
        st.warning("stopped before the end: no run record written")


def verdict_numbers(run: C.DesignRun):
    """The teacher's running verdict on the design's tokens (evals.live): KL(teacher || design) and top-1 agreement,
    the teacher fed the design's own text."""
    v = run.verdict
    if run.verdict_note:
        st.caption(f"not judged: {run.verdict_note}")
        return
    if v is None or not v.n:
        st.caption("the teacher reads the prompt ..." if run.status != "done" or run.generated else "not judged")
        return
    kl, top1 = st.columns(2)
    kl.metric("KL vs teacher", f"{v.kl:.4f}", help="KL(teacher || design) a token, the running mean ± its standard "
              f"error: ± {v.kl_stderr:.4f}")
    top1.metric("top-1 vs teacher", f"{v.top1:.1%}")
    st.caption(f"the teacher's verdict on {v.n} of {run.generated} tokens (full precision, every expert resident, fed "
               "this design's text; it runs in the page's process, on the same cores)")


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
                                   alt=f"{run.name}: {name} chart")
                if C.legend_html(name):
                    st.html(C.legend_html(name))
                if name == "layers":
                    recall = snap.summary.get("prefetch_recall")
                    st.caption("waiting for the first tokens" if snap is C.EMPTY else "no predictor: nothing prefetched"
                               if recall is None else f"prefetch recall, all layers: {recall:.1%}")


def shape_model(shape: str, trace: str | None) -> tuple[str, str]:
    """(model, routing trace) for a model size: its random-weight checkpoint, made here the first time (a spinner
    meanwhile; only on a page that listens on this machine alone), and the trace that drives it (the demo trace
    unless one is given)."""
    p = M.plan(shape, trace)
    if not M.made(p):
        if not LOCAL:
            raise WorkbenchError(f"model size {shape}: not made on this machine, and this page, open to the network, "
                                 f"makes none (python -m dashboards.booth --shape {shape} makes it)")
        with st.spinner(f"making the RANDOM-weight checkpoint of {p.label} (once: later runs reuse it) ..."):
            M.make(p)
    return str(p.path), p.trace


def start(model, designs, budget, prompt, tokens, device=None, routing_trace=None, shape=None, knobs="", lever=None):
    C.stop_runs(state.run_ids)
    state.run_ids, state.numbers, state.records = [], {}, {}
    try:
        if not LOCAL:       # open to the network: no path outside the allowed roots
            if not shape:
                K.check_path(model, "model")
            if routing_trace:
                K.check_path(routing_trace, "routing trace")
        if shape:
            model, routing_trace = shape_model(shape, routing_trace)
        C.check_inputs(model, designs, budget, prompt, tokens)
        from experiments.cli import knobs_of
        sets = knobs_of([k.strip() for k in knobs.split(",") if k.strip()])
        state.run_ids = C.start_runs(model, designs, budget, prompt, tokens, device, routing_trace, sets, lever)
    except WorkbenchError as e:
        st.error(str(e))


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
        mine = st.text_input("design from a file", "", key="design_file", placeholder="path/to/mine.py:Name",
                             disabled=not LOCAL,
                             help="a design of your own beside the presets (docs/designs.md: examples/my_design.py:"
                                  "Mine); comma-separated for several. Runs your code: only while the page listens "
                                  "on this machine")
        budget = st.text_input("expert budget", "0.25", key="budget",
                               help="a fraction of all experts (0.25), a size (96MiB), or all")
        knobs = st.text_input("preset knobs", "", key="knobs", placeholder="KNOB=VALUE, ...",
                              help="set on every design, as bench's --set: e.g. lookahead_recall=0.66, "
                                   "cache_policy=lfu (the names a run record's config gives them)")
        lever = st.selectbox("lossy lever beside each design", ["none"] + list(C.LEVERS), key="lever",
                             help="each design runs twice, as it is and with this lever (workbench.designs.lossy), "
                                  "and the teacher judges every token of both: running KL and top-1 agreement "
                                  "(its price over held-out text: results/lossy.md)")
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
    designs = designs + [d.strip() for d in mine.split(",") if d.strip()] if LOCAL else designs
    return ((model.strip(), designs, budget.strip(), prompt, int(tokens), device, trace.strip() or None, shape,
             knobs, None if lever == "none" else lever) if pressed else None)


@st.fragment(run_every=1.0)
def preparing_view():
    """Booth: what the operator's set-up is preparing; the page redraws in full once all is ready."""
    s = K.status(KIOSK)
    if s["state"] == "ready":
        st.rerun()
    done, total = s.get("done", 0), max(1, s.get("total", 1))
    st.info(f"Preparing the booth: {s.get('step', '')} ({min(done + 1, total)} of {total}). The first comparison "
            "starts as soon as every model, pack and trace it shows is ready.")
    st.progress(min(1.0, done / total))


@st.fragment(run_every=1.0)
def booth_controller():
    """Booth: start the next round of the shared loop a few seconds after the last one ends."""
    started = LOOP.tick()
    when = ("stopped: press Start for the next comparison" if LOOP.paused else LOOP.waiting or
            f"a new round starts {LOOP.cfg['pause']:g} s after every design finishes")
    st.caption(f"booth · round {LOOP.round + 1} · {when}")
    if started or state.run_ids != LOOP.run_ids:
        st.rerun()


if BOOTH:
    st.markdown("<style>html{font-size:22px} [data-testid=stSidebar],[data-testid=stSidebarCollapsedControl],"
                "[data-testid=stHeader],[data-testid=stToolbar]{display:none} "
                "[data-testid=stMetricValue]{font-size:2.4rem}</style>", unsafe_allow_html=True)
    st.title("Experts streaming from flash, live")
    prep = K.status(KIOSK)
    if prep is not None and prep["state"] != "ready":
        preparing_view()
        st.stop()
    cfg, notes = K.settings(st.query_params, KIOSK or K.Booth())
    state.booth = LOOP = R.loop(cfg)
    for note in notes:
        st.caption(note)
    go, halt, _ = st.columns([1, 1, 6])
    if go.button("Start", key="start", type="primary", width="stretch"):
        LOOP.start()
    if halt.button("Stop", key="stop", width="stretch"):
        LOOP.stop()
    state.run_ids = LOOP.run_ids
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
