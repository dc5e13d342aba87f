"""One design generating in its own process, for the live page (dashboards/common.py's DesignRun).

Each design gets its own interpreter, so one design's Python (routing, the streamer, its reader threads' callbacks)
does not hold the GIL another design needs. The process sends what the page shows through a pipe:

    ("status", "starting" | "running")
    ("prompt", token ids)                             judged runs: the text the teacher reads first (evals.live)
    ("unjudged", why)                                 a run asked to be judged that cannot be
    ("token", text so far, telemetry or None, judged)  telemetry at most every SNAPSHOT_S, the numbers the page draws;
                                                      judged: (token id, the logits it was chosen from) or None
    ("done", text, summary, telemetry, record path)
    ("stopped", telemetry or None) | ("error", one line, telemetry or None)

telemetry: (token records, the recent layer events, Session.summary of them), copied under the telemetry's lock.
A Stop is the `stop` event, seen after each token; the page ends a process still running STOP_GRACE_S after it
(dashboards/common.py: a step can outlast a Stop).
The process runs at a lower priority than the page (and so do its reader threads, which inherit it).
"""
from __future__ import annotations

import sys
import time
import traceback

WORKER_NICE = 19    # tests/test_dashboard_e2e.py on 2 cores: longest redraw gap 0.9-1.3 s at nice 0, 0.7-0.85 s at 19
SNAPSHOT_S = 0.25   # the page redraws its numbers every 0.5 s


class _Stopped(Exception):
    pass


def telemetry(s) -> tuple:
    """Copy the telemetry under its lock, then aggregate the copy with Session.summary."""
    from workbench.telemetry import Telemetry
    tel = s.tel
    with tel.lock:
        tokens, ring, events = list(tel.tokens), list(tel.ring), list(tel.events)
        counters = dict(prefetch_issued=tel.prefetch_issued, prefetch_used=tel.prefetch_used,
                        prefetch_wasted=tel.prefetch_wasted, wasted_bytes=tel.wasted_bytes,
                        spec_steps=tel.spec_steps, spec_proposed=tel.spec_proposed, spec_accepted=tel.spec_accepted)
    copy = Telemetry(tel.num_layers, events=events, tokens=tokens, **counters)
    return tokens, ring, s.summary(copy)


def run_design(conn, stop, model: str, design: str, budget, prompt: str, tokens: int, device, routing_trace,
               knobs: dict | None = None, judged: bool = False):
    """The process's body: a Session, generate, write the run record; every outcome is a message. judged: send each
    token's logits, for the page's teacher (dashboards.common.DesignRun) to score."""
    from workbench.host import lower_priority
    lower_priority(WORKER_NICE)         # every thread (some start while the process imports); later ones inherit it
    s = None
    try:
        from experiments.routing_trace import drive
        from workbench.errors import WorkbenchError
        from workbench.runs import write_run
        from runtime.session import open_session
        conn.send(("status", "starting"))
        s = open_session(model, design, budget, prompt=prompt, tokens=tokens, drive=drive(routing_trace),
                         device=device, **(knobs or {}))
        conn.send(("status", "running"))
        why = "forced text" if s.text.forced is not None else \
            "speculative steps verify drafts in batches" if s.preset.execution.speculative else None
        if judged and why:
            conn.send(("unjudged", why))
        judged = judged and why is None
        if judged:
            conn.send(("prompt", s.encode(prompt)))
        last = [0.0]

        def on_token(session, token_id, text):
            now = time.monotonic()
            due = now - last[0] >= SNAPSHOT_S
            if due:
                last[0] = now
            conn.send(("token", text, telemetry(session) if due else None,
                       (token_id, session.logits[-1].astype("float32")) if judged else None))
            if stop.is_set():
                raise _Stopped()

        if stop.is_set():
            raise _Stopped()
        out = s.generate_text(prompt, tokens, on_token=on_token)
        # one dict: what the page shows for a finished run is exactly what summary.json holds
        summary = {**s.summary(), "tokens": len(out["tokens"]), "text": out["text"], "preset": s.preset.name,
                   "budget": s.budget_text}
        config = {**s.config(), "tokens": tokens, "prompt": prompt, "source": "dashboard"}
        record = write_run(s.preset.name, config, summary, summary["per_layer"], s.tel.event_rows(), s.tel.token_rows())
        conn.send(("done", out["text"], summary, (list(s.tel.tokens), list(s.tel.ring), summary), str(record)))
    except _Stopped:
        conn.send(("stopped", telemetry(s) if s else None))
    except Exception as e:  # noqa: BLE001 - shown as one line in the design's column; tracebacks to stderr
        from workbench.errors import WorkbenchError
        if not isinstance(e, WorkbenchError):
            traceback.print_exc(file=sys.stderr)
        msg = str(e) if isinstance(e, WorkbenchError) else f"{design}: unexpected {type(e).__name__}: {e}"
        conn.send(("error", msg, telemetry(s) if s else None))
    finally:
        if s is not None:
            s.close()
        conn.close()
