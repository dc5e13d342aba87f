"""One command for a booth: serve the kiosk page and make every model, pack and trace it will show before its first
round (docs/booth.md).

    python -m dashboards.booth [--model NAME|DIR] [--trace NAME|FILE] [--shape SHAPE] [--device NAME]
                               [--designs on_demand,les] [--tokens 48] [--pause 6] [--host 127.0.0.1] [--port 8501]
    make booth HOST=0.0.0.0 ARGS="--shape qwen3.6-35b-a3b --device ufs22-phone"

The page opens at once and says what is being prepared; the first round starts when everything is ready. Every page
of this server is the booth (dashboards/kiosk.py): names from the allow-list only, a visitor starts and stops the
comparison shown. A bad option is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dashboards import kiosk as K
from dashboards.common import LEVERS
from dashboards import model_size as M
from workbench.errors import WorkbenchError

LIVE = M.REPO / "dashboards" / "live.py"
KIOSK_FLAGS = ["--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
               "--server.runOnSave", "false", "--client.toolbarMode", "minimal", "--client.showErrorDetails", "none",
               "--client.showSidebarNavigation", "false"]


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dashboards.booth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="a registered name (demo) or a model directory or pack")
    ap.add_argument("--trace", default=None, help="a routing trace: a name in data/traces or a .parquet file")
    ap.add_argument("--shape", default=None, help="a real model's shape, run as a RANDOM-weight checkpoint driven by "
                                                  "the trace (made here once); replaces --model")
    ap.add_argument("--device", default=None, help="an emulated device's flash (data/devices)")
    ap.add_argument("--designs", default="", help="comma-separated presets shown every round (default: two "
                                                  "comparisons in turn)")
    ap.add_argument("--lever", default=None, help="a lossy lever run beside each design (at most 2 designs a round), "
                    "the teacher judging every token of both: " + ", ".join(LEVERS))
    ap.add_argument("--tokens", type=int, default=48, help="tokens a round generates (1-2048)")
    ap.add_argument("--pause", type=float, default=6.0, help="seconds between rounds")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=8501)
    return ap


def booth_from(a) -> K.Booth:
    """The operator's program from the options, checked; a WorkbenchError names what is wrong."""
    from workbench.devices import names
    from workbench.presets import PRESETS
    from workbench.registry import MODELS, model_dir
    from workbench.shapes import SHAPES
    models, traces = {}, {}
    if a.shape and a.model != "demo":
        raise WorkbenchError("--shape replaces --model: give one of them")
    model = a.model
    if model not in MODELS:
        path = model_dir(model).resolve()
        model = path.name
        models[model] = str(path)
    trace = a.trace
    if trace and trace not in K.traces(K.Booth()):
        from experiments.traces import read_trace
        path = Path(trace).resolve()
        read_trace(path)
        trace = path.stem
        traces[trace] = str(path)
    if a.shape:
        if a.shape not in SHAPES:
            raise WorkbenchError(f"--shape {a.shape!r}: choose one of {', '.join(SHAPES)}")
        M.plan(a.shape, K.traces(K.Booth(traces=traces)).get(trace))
    if a.device and a.device not in names():
        raise WorkbenchError(f"--device {a.device!r}: choose one of {', '.join(names())}")
    designs = tuple(d for d in a.designs.split(",") if d)
    if unknown := [d for d in designs if d not in PRESETS]:
        raise WorkbenchError(f"--designs {', '.join(unknown)}: not presets (choose among {', '.join(PRESETS)})")
    if len(designs) > K.MAX_DESIGNS:
        raise WorkbenchError(f"--designs: at most {K.MAX_DESIGNS} in a round")
    if a.lever and a.lever not in LEVERS:
        raise WorkbenchError(f"--lever {a.lever!r}: choose one of {', '.join(LEVERS)}")
    if a.lever and (a.trace or a.shape):
        raise WorkbenchError("--lever: a lever needs the model's own weights and routing, not --trace or --shape")
    if not 1 <= a.tokens <= 2048:
        raise WorkbenchError(f"--tokens {a.tokens}: between 1 and 2048")
    if a.pause < 0:
        raise WorkbenchError(f"--pause {a.pause:g}: not negative")
    return K.Booth(model=model, models=models, trace=trace, traces=traces, shape=a.shape, device=a.device,
                   designs=designs, tokens=a.tokens, pause=a.pause, lever=a.lever)


def steps(booth: K.Booth) -> list[tuple[str, object]]:
    """(what the page says, the call that makes it) for everything the booth's rounds open."""
    from dashboards.common import booth_round
    from workbench.presets import PRESETS, budget_for
    cfg, _ = K.settings({}, booth)
    out = []
    if booth.shape:
        plan = M.plan(booth.shape, cfg["routing_trace"])
        cfg["model"], cfg["routing_trace"] = str(plan.path), plan.trace
        if not M.made(plan):
            out.append((f"making the RANDOM-weight checkpoint of {plan.label}", lambda: M.make(plan)))
    model, trace = cfg["model"], cfg["routing_trace"]
    label = f"the {booth.shape} checkpoint" if booth.shape else M.shown(model)
    designs = list(booth.designs) or list(dict.fromkeys(d for i in (0, 1) for d in booth_round(i, model)[1]))

    def opener(design):
        def open_once():
            from experiments.routing_trace import drive
            from runtime.session import open_session
            open_session(model, design, budget_for(PRESETS[design], "0.25"), prompt=booth_round(0, model)[0],
                         tokens=2, drive=drive(trace)).close()
        return open_once
    for d in designs:
        out.append((f"{d}: its pack of {label} and what it warms from", opener(d)))
    return out


def prepare(booth: K.Booth, todo: list, page=None) -> float:
    """Run the steps, the status file saying which; returns the seconds it took. page: the page's server process,
    which must stay up meanwhile (a port in use ends it at once)."""
    t0 = time.time()
    for i, (what, make) in enumerate(todo):
        if page is not None and page.poll() is not None:
            raise WorkbenchError(f"the page's server exited (code {page.returncode}; is its port taken?)")
        K.set_status(booth, state="preparing", step=what, done=i, total=len(todo))
        print(f"booth: preparing {i + 1}/{len(todo)}: {what}", file=sys.stderr, flush=True)
        make()
    K.set_status(booth, state="ready", done=len(todo), total=len(todo), seconds=round(time.time() - t0, 1))
    return time.time() - t0


def wait_up(page, host: str, port: int, timeout: float = 120):
    """Until the page's server answers; a WorkbenchError when it exits first."""
    import urllib.request
    near = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, host)      # every interface: ask this machine's
    url = f"http://{near}:{port}/_stcore/health"
    deadline = time.time() + timeout
    while page.poll() is None and time.time() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.25)
    raise WorkbenchError(f"the page's server exited (code {page.returncode}; is its port taken?)"
                         if page.poll() is not None else f"the page's server did not answer on {url} in {timeout:g} s")


def streamlit_cmd(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(LIVE), "--server.address", host, "--server.port", str(port),
            *KIOSK_FLAGS]


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    import os
    import signal
    a = args_parser().parse_args(argv)
    old = signal.signal(signal.SIGTERM, _stop)     # a terminate takes the page's server down with it, as Ctrl-C
    tmp = Path(tempfile.mkdtemp(prefix="wb-booth-"))
    proc = None
    try:
        booth = replace(booth_from(a), status=str(tmp / "status.json"))
        todo = steps(booth)
        K.set_status(booth, state="preparing", step="starting", done=0, total=len(todo))
        K.write(booth, tmp / "booth.json")
        proc = subprocess.Popen(streamlit_cmd(a.host, a.port), cwd=M.REPO,
                                env={**os.environ, K.BOOTH_ENV: str(tmp / "booth.json")})
        print(f"booth: http://{a.host}:{a.port} (the page says what is prepared until the first round)",
              file=sys.stderr, flush=True)
        seconds = prepare(booth, todo, proc)
        wait_up(proc, a.host, a.port)
        print(f"booth: ready after {seconds:.0f} s", file=sys.stderr, flush=True)
        return proc.wait()
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
