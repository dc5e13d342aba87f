"""Load on the OpenAI-compatible server: N concurrent clients send M greedy completions, every Kth one a
stream the client drops after its first event; the server's RSS is sampled as the requests go.

    python benchmarks/server_load.py --model demo --preset les --budget 0.25 --clients 8 --requests 1000

Reports requests/s, p50/p99 latency of the completed requests, errors (non-200 answers or failed connections:
must be 0), disconnects, and the server's RSS after a warm-up and after the run (and every 100 requests), in
JSON on stdout and, with --out, in a file. The server generates one request at a time (evals/server.py), so
requests/s measures the model's speed under queueing, not parallel generation. Numbers are from the machine at
hand; say what else was running.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workbench.commands import flags  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "She looked at the sky and", "Tom had a red ball.",
           "In the morning, the sun", "The cat said"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    from workbench.host import rss_bytes
    return rss_bytes(pid)


def post(port: int, body: dict, timeout: float = 300) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def drop_mid_stream(port: int, body: dict) -> bool:
    """Ask for a stream, read its first event, then close the socket. True if the first event came."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status == 200 and r.fp.readline().startswith(b"data: ")
    finally:
        c.sock.close() if c.sock else None
        c.close()


def start_server(a, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", a.model, "--preset", a.preset, "--port", str(port)]
    if a.budget:
        cmd += ["--budget", a.budget]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 300
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            time.sleep(0.25)
    p.kill()
    raise SystemExit("the server did not come up in 300 s")


def run(a) -> dict:
    port = free_port()
    log = Path(a.log)
    srv = start_server(a, port, log)
    try:
        model_id = json.loads(post_get(port, "/v1/models"))["data"][0]["id"]
        body = lambda i: {"model": model_id, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": a.max_tokens,
                          "temperature": 0}
        for i in range(a.warmup):
            post(port, body(i))
        rss0 = rss_bytes(srv.pid)
        lock, next_i, lat, errors, drops, samples = threading.Lock(), [0], [], [], [0], [(0, rss0)]

        def client():
            while True:
                with lock:
                    i = next_i[0]
                    if i >= a.requests:
                        return
                    next_i[0] += 1
                t0 = time.perf_counter()
                try:
                    if a.disconnect_every and i % a.disconnect_every == a.disconnect_every - 1:
                        ok, dropped = drop_mid_stream(port, body(i)), True
                    else:
                        status, payload = post(port, body(i))
                        ok = status == 200 and json.loads(payload)["choices"][0]["text"] is not None
                        dropped = False
                except (OSError, ValueError, KeyError) as e:
                    ok, dropped = False, False
                    payload = repr(e).encode()
                dt = time.perf_counter() - t0
                with lock:
                    if not ok:
                        errors.append(f"request {i}: {payload[:200]!r}" if not dropped else f"request {i}: no first event")
                    elif dropped:
                        drops[0] += 1
                    else:
                        lat.append(dt)
                    done = len(lat) + drops[0] + len(errors)
                    if done % 100 == 0:
                        samples.append((done, rss_bytes(srv.pid)))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        alive = json.loads(post_get(port, "/health")) is not None
        rss1 = rss_bytes(srv.pid)
    finally:
        srv.terminate()
        srv.wait(30)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None
    return {"model": a.model, "preset": a.preset, "budget": a.budget, "clients": a.clients, "requests": a.requests,
            "max_tokens": a.max_tokens, "disconnect_every": a.disconnect_every, "warmup_requests": a.warmup,
            "wall_s": wall, "requests_per_s": a.requests / wall, "completed": len(lat), "disconnects": drops[0],
            "errors": len(errors), "error_samples": errors[:5], "latency_p50_s": q(0.50), "latency_p99_s": q(0.99),
            "rss_after_warmup_bytes": rss0, "rss_after_bytes": rss1, "rss_growth_bytes": rss1 - rss0,
            "rss_every_100": samples, "server_alive_after": alive, "cpu": os.cpu_count()}


def post_get(port: int, path: str) -> bytes:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        return c.getresponse().read()
    finally:
        c.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags("model", "preset", "budget", preset="les", budget="0.25")(ap)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--disconnect-every", type=int, default=10, help="every Kth request drops its stream (0: none)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--log", default="/tmp/server_load.log", help="the server's stderr")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    res = run(a)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        from workbench.atomic import atomic_write
        atomic_write(a.out, text + "\n")
    return 0 if res["errors"] == 0 and res["server_alive_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
