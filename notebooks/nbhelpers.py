"""Helpers for the ablation notebooks: parameters, labels, published numbers, alternating arms, tables, figures.

No engine logic lives here: every number comes from the library (experiments.ladder, experiments.bench,
runtime.session, workbench.io, workbench.edge0, evals.*); this module arranges, labels and draws them.

    WB_NB_SMALL=1        the tests' setting (read by each notebook's first cell)
    WB_NB_FIGURES=DIR    where figures go (default: notebooks/figures at the full setting, a temporary
                         directory at the small one, so a test never touches the committed figures)
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

NB_DIR = Path(__file__).resolve().parent
REPO = NB_DIR.parent
if str(REPO) not in sys.path:          # dashboards/ (the published numbers) is not an installed package
    sys.path.insert(0, str(REPO))

PROMPT = "Once upon a time"


# ---------------------------------------------------------------- parameters and places

def figures_dir(small: bool) -> Path:
    env = os.environ.get("WB_NB_FIGURES")
    if env:
        d = Path(env)
    elif small:
        d = Path(tempfile.mkdtemp(prefix="wb-nb-figures-"))
    else:
        d = NB_DIR / "figures"
    d.mkdir(parents=True, exist_ok=True)
    return d


def shown(path) -> str:
    """A path as a notebook prints it, naming no one's machine: under the runs root, the cache, the figures folder
    or the temporary folder as $WORKBENCH_RUNS/..., $WORKBENCH_CACHE/..., $WB_NB_FIGURES/..., $TMPDIR/... (the
    deepest that holds it), else relative to the repository, else from ~ under the home folder."""
    if not path:
        return path
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    from workbench.registry import cache_dir
    roots = {"$WORKBENCH_CACHE": cache_dir(), "$TMPDIR": Path(tempfile.gettempdir()), "": REPO, "~": Path.home()}
    roots |= {f"${v}": Path(os.environ[v]) for v in ("WORKBENCH_RUNS", "WB_NB_FIGURES") if os.environ.get(v)}
    holding = [(len(root.resolve().parts), name, root.resolve()) for name, root in roots.items()
               if p.resolve().is_relative_to(root.resolve())]
    if not holding:
        return str(p)
    _, name, root = max(holding)
    rel = p.resolve().relative_to(root)
    return str(rel) if not name else f"{name}/{rel}" if rel.parts else name


def run_id(path) -> str | None:
    """A run record's id, as tables show it: its directory's name under the runs root (runs/ or $WORKBENCH_RUNS)."""
    return Path(path).name if path else None


# ---------------------------------------------------------------- labels: whose number, on what device

def machine() -> dict:
    from workbench.runs import environment
    return environment()


def ours_label(engine: str) -> str:
    env = machine()
    cpu = env.get("cpu") or env.get("machine") or "this machine"
    return f"ours: {cpu} ({env.get('cores')} cores), {engine} engine"


def published(name: str) -> dict | None:
    """The paper's numbers for `name` from dashboards/published.py, or None."""
    from dashboards.published import published as find
    return find(name)


def paper_label(pub: dict | None) -> str:
    if not pub:
        return "paper: no published number recorded"
    return f"paper: {pub['paper']}, {pub['model']} on {pub['device']}"


# ---------------------------------------------------------------- alternating arms (A B C ... A B C ...)

def bench_arm(model: str, preset, budget, tokens: int, warmup: int = 4, note: dict | None = None,
              prompt: str = PROMPT) -> dict:
    """One arm, one round: a fresh Session (runtime.session.open_session), experiments.bench.measure, a run record.

    Returns measure's fields plus the per-token TokenRecords (`token_rows`), the cache's slots per layer and
    the record's path. Measured cold (experiments.bench.measure), after `warmup` tokens on other text.
    """
    from experiments.bench import measure
    from workbench.runs import write_run
    from runtime.session import open_session
    with open_session(model, preset, budget, prompt=prompt, tokens=tokens) as s:
        res = measure(s, prompt, tokens, warmup=warmup)
        res.update(preset=s.preset.name, budget=s.budget_text, slots_per_layer=min(s.cache.capacity.values()),
                   item_bytes=s.slot_bytes, token_rows=s.tel.token_rows())
        cfg = {**s.config(), "notebook": (note or {}).get("notebook"), "study": (note or {}).get("study"),
               "arm": (note or {}).get("arm"), "tokens": tokens, "prompt": prompt, "warmup": warmup}
        res["run"] = str(write_run(s.preset.name, cfg, {k: v for k, v in res.items() if k != "token_rows"},
                                   s.tel.per_layer("decode"), [], res["token_rows"]))
    return res


def alternating(arms: dict, rounds: int, run_one, progress=print) -> list[dict]:
    """Run every arm once per round, in order (A B C ... A B C ...), `run_one(name, arm)` -> a dict with tok_s.

    One row per arm: the median round's fields, tok_s its median with min-max, every round's tok_s, and
    every round's result under `rounds_results`.
    """
    results = {name: [] for name in arms}
    for r in range(rounds):
        for name, arm in arms.items():
            res = run_one(name, arm)
            results[name].append(res)
            if progress:
                progress(f"round {r + 1}/{rounds} {name}: {res['tok_s']:.2f} tok/s")
    rows = []
    for name, runs in results.items():
        tps = [x["tok_s"] for x in runs]
        med = sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2]
        rows.append({**med, "arm": name, "tok_s": statistics.median(tps), "tok_s_min": min(tps),
                     "tok_s_max": max(tps), "tok_s_rounds": tps, "rounds_results": runs})
    return rows


# ---------------------------------------------------------------- tables

TIME_PARTS = ("compute_s", "router_s", "dequant_s", "flash_wait_s", "other_s")


def per_token_ms(row: dict) -> dict:
    """A bench/ladder row's time split (sums over decode steps) as ms per decode step, with the wall time."""
    n = max(1, row["decode_steps"])
    out = {p.replace("_s", " ms"): 1e3 * row[p] / n for p in TIME_PARTS}
    out["wall ms"] = 1e3 * row["decode_s"] / n
    return out


def split_adds_up(row: dict, rel: float = 1e-6) -> bool:
    """The five parts add up to the decode wall time (other_s is wall minus the rest, clipped at zero)."""
    total = sum(row[p] for p in TIME_PARTS)
    return abs(total - row["decode_s"]) <= rel * max(1e-9, row["decode_s"]) + 1e-9


def frame(rows: list[dict], columns: dict):
    """A DataFrame of `rows` with `columns` {source key: header}, in that order."""
    import pandas as pd
    return pd.DataFrame([{h: run_id(r.get(k)) if k == "run" else r.get(k) for k, h in columns.items()} for r in rows])


def ladder_vs_paper(res: dict, pub: dict | None, ours: str):
    """run_ladder's rows beside the published ladder rung by rung (by position): tok/s and x first rung."""
    import pandas as pd
    rows = []
    pr = (pub or {}).get("rungs", [])
    for i, r in enumerate(res["rungs"]):
        p = pr[i] if i < len(pr) else (None, None)
        rows.append({"rung": r["rung"], f"tok/s ({ours})": r["tok_s"], "min": r["tok_s_min"], "max": r["tok_s_max"],
                     "x first rung (ours)": r["speedup"], "paper rung": p[0],
                     f"tok/s ({paper_label(pub)})": p[1],
                     "x first rung (paper)": (p[1] / pr[0][1]) if p[1] is not None else None})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- full size: results/full_size_*.json on realistic routing

# The full-size files (benchmarks/full_size.py) on routing a real model has, by the routing they ran on. The earlier
# files on made routing no real model has (`-designs-`, the first 35B's) stay out: results/full_size.md's "before".
FULL_SIZE_ROUTING = {"full_size_*-realistic*.json": "made, with real statistics",
                     "full_size_*-real-trace*.json": "the real Qwen3-30B-A3B trace"}
FULL_SIZE_PARTS = ("compute", "router", "dequant", "flash_wait", "other")


def full_size_files() -> dict[str, str]:
    """{results/ file name: the routing it ran on} for every full-size file on realistic routing present now."""
    return {p.name: routing for pattern, routing in FULL_SIZE_ROUTING.items()
            for p in sorted((REPO / "results").glob(pattern))}


def full_size(files: dict[str, str] | None = None):
    """One row per model, routing, budget and design of the full-size files, pooling every round of every file that
    ran it: tok/s the median (min, max), the time split the mean (ms per decode step), peak RSS the largest; stock
    llama.cpp's tok/s and whole step the same over those files' llama.cpp rounds (None where none ran one), and
    whether it did the same work (not where the designs followed a routing trace: llama.cpp routes itself); Belady's
    bound the mean of those files' bounds."""
    import json
    import pandas as pd
    step_ms = lambda run, key: 1e3 * run.get(key, 0.0) / max(1, run["decode_steps"])
    arms = []
    for name, routing in (files or full_size_files()).items():
        fs = json.loads((REPO / "results" / name).read_text())
        llama = [runs for d, _, runs in fs["arms"] if d == "llama.cpp"]
        for r in fs["rows"]:
            if r["design"] == "llama.cpp":
                continue
            runs = next(runs for d, b, runs in fs["arms"] if (d, b) == (r["design"], r["budget"]))
            bound = r.get("own_bound") or fs["bounds"].get(r["budget"], {})    # a design routing otherwise: its own
            arms.append({"model": Path(fs["model"]).stem, "routing": routing, "budget": r["budget"],
                         "design": r["design"], "file": name, "measured": fs["date"], "runs": runs,
                         "llama runs": llama[0] if llama else [], "Belady tok/s": bound.get("belady_tok_s"),
                         "llama same work": "--routing-trace" not in fs["command"]})
    rows = []
    for key, g in pd.DataFrame(arms).groupby(["model", "routing", "budget", "design"], sort=False):
        runs, llama = [x for rs in g["runs"] for x in rs], [x for rs in g["llama runs"] for x in rs]
        tps = [x["tok_s"] for x in runs]
        rows.append({**dict(zip(("model", "routing", "budget", "design"), key)),
                     "tok/s": statistics.median(tps), "min": min(tps), "max": max(tps), "rounds": len(runs),
                     "llama.cpp tok/s": statistics.median(x["tok_s"] for x in llama) if llama else None,
                     "Belady tok/s": g["Belady tok/s"].mean(),
                     "peak RSS GiB": max(x["peak_rss_bytes"] for x in runs) / 2**30,
                     **{f"{p} ms": statistics.mean(step_ms(x, f"{p}_s") for x in runs) for p in FULL_SIZE_PARTS},
                     "llama.cpp step ms": statistics.mean(step_ms(x, "decode_s") for x in llama) if llama else None,
                     "llama.cpp same work": bool(g["llama same work"].all()),
                     "files": ", ".join(g["file"]), "measured": ", ".join(g["measured"])})
    out = pd.DataFrame(rows)
    out["of Belady"] = out["tok/s"] / out["Belady tok/s"]
    return out


def gib(budget: str) -> float:
    """A budget's GiB, for sorting: "2GiB" -> 2.0; any other budget ("all") after them."""
    return float(budget.removesuffix("GiB")) if budget.endswith("GiB") else float("inf")


def llama_reference(same_work: bool) -> str:
    """What stock llama.cpp's reference line in a full-size panel is (full_size's "llama.cpp same work")."""
    return "stock llama.cpp" if same_work else "stock llama.cpp, on the file's own routing"


def panels_per_budget(df, panel, title: str):
    """The full-size figure: a row of panels for each model and routing, one panel for each budget it ran (no empty
    panels); `panel(rows)` is the layered chart of one row's data."""
    import altair as alt
    rows = [panel(g).facet(column=alt.Column("budget:N", sort=sorted(set(g.budget), key=gib), title=None))
            .properties(title=f"{model}, RANDOM weights; routing: {routing}").resolve_scale(x="independent")
            for (model, routing), g in df.groupby(["model", "routing"], sort=False)]
    return alt.vconcat(*rows).properties(title=title)


# ---------------------------------------------------------------- stamps: what made a figure

def stamp(rows=(), model: str | None = None, simulated: bool = False, engine: str | None = None, **extra) -> dict:
    """What made a figure, read from the run records of `rows` (their "run" paths) where they have them: engine(s),
    presets with their knobs, model, machine (CPU, cores), commit, date, and the labels that apply (EMULATED <device>,
    SIMULATED, RANDOM WEIGHTS). `engine`: for numbers that come without a run record (a simulation's compute)."""
    import datetime
    from workbench.runs import read_run
    engines_, presets, devices, random_weights, models = set(), {}, set(), False, set()
    for r in rows:
        cfg = read_run(r["run"])["config"] if r.get("run") else {}
        engines_.add(cfg.get("engine") or r.get("engine"))
        p = cfg.get("preset")
        if p:
            presets[p["name"]] = {k: v for k, v in p.items() if k not in ("name", "description")}
        if cfg.get("emulated", r.get("emulated")):
            d = cfg.get("device") or r.get("device")            # a record's device: its profile's description
            devices.add(str(d.get("name") if isinstance(d, dict) else d))
        random_weights |= bool(cfg.get("random_weights", r.get("random_weights")))
        models.add(cfg.get("model") or r.get("model"))
    engines_ |= {engine}
    env = machine()
    labels = ([f"EMULATED {d}" for d in sorted(devices)] + (["SIMULATED"] if simulated else [])
              + (["RANDOM WEIGHTS"] if random_weights else []))
    return {"engine": ", ".join(sorted(e for e in engines_ if e)) or "none",
            "model": model or ", ".join(sorted(shown(m) for m in models if m)), "presets": presets,
            "cpu": env.get("cpu") or env.get("machine"), "cores": env.get("cores"),
            "commit": (env.get("git_commit") or "unknown")[:10], "date": datetime.date.today().isoformat(),
            "labels": labels, **extra}


def stamp_runs(since: float, model: str, **kw) -> dict:
    """stamp() of the run records written since `since` (time.time()): the runs a notebook has made so far."""
    from workbench.runs import list_runs
    rows = [{"run": str(p)} for p in list_runs() if (p / "config.json").stat().st_mtime >= since]
    return stamp(rows, model, **kw)


def results_stamp(files, model: str, engine: str, labels=("RANDOM WEIGHTS",)) -> dict:
    """stamp() of numbers read from results/ files rather than from this notebook's runs: it names the files and
    the dates they were measured."""
    import json
    source = [f"results/{f} (measured {json.loads((REPO / 'results' / f).read_text())['date']})" for f in sorted(set(files))]
    return {**stamp((), model, engine=engine), "labels": list(labels), "source": source}


def stamp_lines(st: dict) -> list[str]:
    """The stamp as the lines under a figure's title."""
    lines = [f"{st['engine']} engine · model {st['model']} · {st['cpu']} ({st['cores']} cores) · "
             f"commit {st['commit']} · {st['date']}"]
    if st["presets"]:
        lines.append("presets: " + ", ".join(st["presets"]))
    if st["labels"]:
        lines.append(" · ".join(st["labels"]))
    if st.get("source"):                # numbers read from results/ files, not from this notebook's runs
        lines += [f"from {src}" for src in st["source"]]
    return lines


STAMP_KEY = "moe-workbench stamp"      # the PNG text chunk that holds a figure's stamp as JSON


def read_stamp(path) -> dict | None:
    """The stamp a figure was saved with, or None."""
    import json
    from PIL import Image
    with Image.open(path) as im:
        text = im.text.get(STAMP_KEY)
    return json.loads(text) if text else None


# ---------------------------------------------------------------- figures (Altair, saved as PNG by vl-convert)

class Figure:
    """A saved figure as a cell shows it: the PNG (what a repository browser renders) and the Vega-Lite spec
    (what JupyterLab renders, without a kernel), one output."""

    def __init__(self, chart, png: bytes, path: Path):
        self.chart, self.png, self.path = chart, png, path

    def _repr_mimebundle_(self, include=None, exclude=None):
        import base64
        return {"image/png": base64.b64encode(self.png).decode(), "application/vnd.vegalite.v5+json": self.chart.to_dict(),
                "text/plain": f"<figure {self.path.name}>"}


def save(chart, name: str, directory: Path, stamp: dict) -> Figure:
    """Write `chart`, its stamp under the title, to directory/name.png (the stamp also in the PNG's metadata) and
    return it as the cell shows it (the PNG and the chart)."""
    import json
    import altair as alt
    import vl_convert as vlc
    from workbench.atomic import atomic_write
    title = chart.title if chart.title is not alt.Undefined else ""
    text = title.text if isinstance(title, alt.TitleParams) else title
    chart = chart.properties(title=alt.TitleParams(text=text or " ", subtitle=stamp_lines(stamp), subtitleFontSize=9,
                                                   subtitleColor="gray", anchor="start"))
    import io
    from PIL import Image, PngImagePlugin
    info = PngImagePlugin.PngInfo()
    info.add_text(STAMP_KEY, json.dumps(stamp, sort_keys=True))
    out = io.BytesIO()
    Image.open(io.BytesIO(vlc.vegalite_to_png(chart.to_json(), scale=1.5))).save(out, "PNG", pnginfo=info)
    path = Path(directory) / f"{name}.png"
    atomic_write(path, out.getvalue())
    return Figure(chart, out.getvalue(), path)


def bars_vs_paper(df, x: str, y: str, source: str, title: str, y_title: str):
    import altair as alt
    return alt.Chart(df, title=title).mark_bar().encode(
        x=alt.X(f"{x}:N", sort=None, title=None, axis=alt.Axis(labelAngle=-25, labelLimit=220)),
        xOffset=alt.XOffset(f"{source}:N"),
        y=alt.Y(f"{y}:Q", title=y_title),
        color=alt.Color(f"{source}:N", legend=alt.Legend(orient="bottom", title=None, columns=1, labelLimit=600)),
        tooltip=[x, source, alt.Tooltip(f"{y}:Q", format=".3f")],
    ).properties(width=520, height=260)


def md(text: str):
    """Show `text` (an f-string of computed values, indented like the cell's code) as Markdown."""
    import textwrap
    from IPython.display import Markdown, display
    display(Markdown(textwrap.dedent(text).strip()))
