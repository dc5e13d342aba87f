"""A stand-in for dashboards/worker.py's run_design whose second step outlasts any Stop (tests/test_dashboard_apptest.py):
it starts, sends its first token, then spends `step_s` in one step without looking at the stop event, as a design
does whose step compiles kernels, waits on a slow read or is starved of CPU at nice 19."""
from __future__ import annotations

import time


def run_design(conn, stop, model, design, budget, prompt, tokens, device, routing_trace, knobs=None, judged=False,
               step_s=60.0):
    conn.send(("status", "starting"))
    conn.send(("status", "running"))
    conn.send(("token", " Once", None))
    time.sleep(step_s)
    if stop.is_set():
        conn.send(("stopped", None))
    conn.close()
