"""The OpenAI-compatible server's limits under abuse, on this machine's loopback only (127.0.0.1, fixed).

    python benchmarks/server_limits.py --out results/server_limits.md

Starts `python -m workbench serve --model demo --preset les` on 127.0.0.1 and, one phase at a time:
  burst      64 concurrent clients (--clients), 2 greedy completions of 16 tokens (--tokens) each; a 429 is
             retried after its Retry-After
  oversize   8 clients at once send a body over the server's MAX_BODY; one declares one and sends nothing
  loris      64 connections trickle a request's header a byte a second (under the connection cap), then 200
             (over it); meanwhile one completion a second from a well-behaved client
After each phase one completion must be answered 200 and the server still running. Reports every answer's status,
latencies, how long the slow connections were held, and the server's RSS and thread count. Exit 1 when a phase
crashed the server, left it unanswering, or got an answer that is neither the request's nor a clean 4xx.
"""
from __future__ import annotations

import argparse
import http.client
import json
import platform
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_load import free_port, rss_bytes, start_server  # noqa: E402
from workbench import host  # noqa: E402

HOST = "127.0.0.1"          # never another address: this load test targets this machine's loopback alone
PROMPTS = ["Once upon a time", "The little dog", "She looked at the sky and", "Tom had a red ball."]


def request(port: int, body: bytes, timeout: float = 120, path: str = "/v1/completions") -> tuple[int | str, dict]:
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", path, body, {"Content-Type": "application/json"})
        r = c.getresponse()
        payload = r.read()
        return r.status, {"retry_after": r.getheader("Retry-After"), "body": payload[:300]}
    except OSError as e:
        return type(e).__name__, {}
    finally:
        c.close()


def completion(i: int = 0, tokens: int = 16) -> bytes:
    return json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0}).encode()


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def burst(port: int, clients: int = 64, each: int = 2, tokens: int = 16) -> dict:
    statuses, lat, lock = Counter(), [], threading.Lock()

    def client(c):
        for k in range(each):
            t0 = time.perf_counter()
            for _ in range(120):
                st, info = request(port, completion(c + k, tokens))
                with lock:
                    statuses[st] += 1
                if st != 429:
                    break
                time.sleep(float(info.get("retry_after") or 1))
            with lock:
                lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    lat.sort()
    return {"clients": clients, "requests": clients * each, "statuses": dict(statuses),
            "wall_s": time.perf_counter() - t0, "latency_p50_s": lat[len(lat) // 2], "latency_max_s": lat[-1]}


def oversize(port: int, max_body: int, clients: int = 8) -> dict:
    statuses = Counter()
    big = b'{"prompt": "' + b"a" * (max_body + 2**20) + b'"}'

    def client():
        st, _ = request(port, big)
        statuses[st] += 1
    ts = [threading.Thread(target=client) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with socket.create_connection((HOST, port), timeout=30) as s:      # declared, never sent
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (10 * max_body))
        head = s.recv(4096).split(b"\r\n", 1)[0].decode()
    return {"clients": clients, "body_bytes": len(big), "statuses": dict(statuses), "declared_only": head}


def loris(port: int, connections: int, seconds: float) -> dict:
    """`connections` sockets each send a request's first line and then a header byte a second; one completion a
    second from a polite client meanwhile."""
    held, refused, lock, stop = [], Counter(), threading.Lock(), threading.Event()

    def slow():
        t0 = time.perf_counter()
        try:
            with socket.create_connection((HOST, port), timeout=seconds + 30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                s.settimeout(1.0)
                while not stop.is_set():
                    try:
                        got = s.recv(4096)
                    except socket.timeout:
                        s.sendall(b"X")             # a header that never ends
                        continue
                    with lock:
                        if got.startswith(b"HTTP/1.1 429"):
                            refused["429 at the door"] += 1
                        else:
                            held.append(time.perf_counter() - t0)
                    return
        except OSError:
            with lock:
                held.append(time.perf_counter() - t0)
    polite = Counter()

    def well_behaved():
        while not stop.is_set():
            st, _ = request(port, completion(tokens=4), timeout=30)
            polite[st] += 1
            time.sleep(1.0)
    ts = [threading.Thread(target=slow) for _ in range(connections)]
    for t in ts:
        t.start()
    p = threading.Thread(target=well_behaved)
    p.start()
    deadline = time.time() + seconds
    while time.time() < deadline and any(t.is_alive() for t in ts):
        time.sleep(0.5)
    stop.set()
    for t in ts:
        t.join(10)
    p.join(60)
    held.sort()
    return {"connections": connections, "refused": dict(refused), "dropped_by_server": len(held),
            "held_s_min": held[0] if held else None, "held_s_max": held[-1] if held else None,
            "polite_statuses_meanwhile": dict(polite)}


def run(a) -> dict:
    from evals.server import MAX_BODY, MAX_CONNECTIONS, MAX_WAITING, READ_TIMEOUT
    port = free_port()
    srv = start_server(a, port, Path(a.log))
    out = {"command": f"python benchmarks/server_limits.py --clients {a.clients} --tokens {a.tokens}" +
                      (f" --out {a.out}" if a.out else ""),
           "server": f"python -m workbench serve --model {a.model} --preset {a.preset} --budget {a.budget} "
                     f"--port PORT (on {HOST})",
           "limits": {"MAX_BODY": MAX_BODY, "MAX_WAITING": MAX_WAITING, "MAX_CONNECTIONS": MAX_CONNECTIONS,
                      "READ_TIMEOUT": READ_TIMEOUT},
           "date": time.strftime("%Y-%m-%d"), "phases": {},
           "machine": f"{platform.machine()}, {host.cores()} cores, Python {platform.python_version()}"}
    try:
        request(port, completion())                     # the first request converts nothing but warms the engine
        base = {"rss_bytes": rss_bytes(srv.pid), "threads": threads_of(srv.pid)}
        out["before"] = base
        phases = [("burst", lambda: burst(port, a.clients, tokens=a.tokens)), ("oversize", lambda: oversize(port, MAX_BODY)),
                  ("loris under the cap", lambda: loris(port, 64, READ_TIMEOUT + 10)),
                  ("loris over the cap", lambda: loris(port, MAX_CONNECTIONS + 72, READ_TIMEOUT + 10))]
        for name, phase in phases:
            res = phase()
            time.sleep(1.0)
            st, _ = request(port, completion())
            res.update(next_request=st, server_running=srv.poll() is None, rss_bytes=rss_bytes(srv.pid),
                       threads=threads_of(srv.pid))
            out["phases"][name] = res
            print(f"{name}: {json.dumps(res)}", file=sys.stderr, flush=True)
    finally:
        srv.terminate()
        srv.wait(30)
    clean = lambda sts: all(isinstance(s, int) and (s == 200 or 400 <= s < 500) for s in sts)
    out["ok"] = all(p["next_request"] == 200 and p["server_running"] and
                    clean(p.get("statuses", {})) and clean(p.get("polite_statuses_meanwhile", {}))
                    for p in out["phases"].values())
    return out


def markdown(r: dict) -> str:
    lim = r["limits"]
    rows = []
    say = lambda counts: ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))
    for name, p in r["phases"].items():
        answers = say(p.get("statuses") or {**p.get("refused", {}), "closed by the server": p.get("dropped_by_server")})
        extra = ""
        if "latency_p50_s" in p:
            extra = f"latency p50 {p['latency_p50_s']:.1f} s, max {p['latency_max_s']:.1f} s (retries included)"
        elif "declared_only" in p:
            extra = f"a body declared over the limit and never sent: `{p['declared_only']}`"
        elif "held_s_max" in p:
            extra = (f"each held {p['held_s_min']:.1f}-{p['held_s_max']:.1f} s; a polite client (one request a "
                     f"second) meanwhile: {say(p['polite_statuses_meanwhile'])}")
        rows.append(f"| {name} | {answers} | {extra} | {p['next_request']} | {p['server_running']} | "
                    f"{p['rss_bytes'] / 2**20:.0f} | {p['threads']} |")
    b = r["before"]
    note = ("Over the connection cap, polite clients are refused too until the slow connections time out: the cap "
            "protects the process, not the service.")
    return "\n".join([
        "# The server's limits under abuse (loopback only)", "",
        f"`{r['command']}` ({r['date']}) on {r['machine']}, a shared machine (other work ran beside it: the times "
        "say little). "
        f"Server: `{r['server']}`. Limits: a body of at most {lim['MAX_BODY']} bytes (413), {lim['MAX_WAITING']} "
        f"generation requests waiting behind the running one (429, Retry-After), {lim['MAX_CONNECTIONS']} open "
        f"connections (the next answered 429 and closed), a whole request within {lim['READ_TIMEOUT']:g} s "
        "(408 for a body, a close for a header).", "",
        f"Before: RSS {b['rss_bytes'] / 2**20:.0f} MiB, {b['threads']} threads.", "",
        "| phase | answers | | next request | server running | RSS MiB | threads |", "|---|---|---|---|---|---|---|",
        *rows, "", f"All phases clean (every answer 200 or 4xx, the next request answered): {r['ok']}. {note}", ""])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--preset", default="les")
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients in the burst, 2 completions each")
    ap.add_argument("--tokens", type=int, default=16, help="tokens a burst completion asks for")
    ap.add_argument("--log", default="/tmp/server_limits.log", help="the server's stderr")
    ap.add_argument("--out", default=None, help="write the Markdown here (and the JSON beside it)")
    a = ap.parse_args(argv)
    res = run(a)
    print(json.dumps(res, indent=1, default=str))
    if a.out:
        from workbench.atomic import atomic_write
        atomic_write(a.out, markdown(res))
        atomic_write(Path(a.out).with_suffix(".json"), json.dumps(res, indent=1, default=str) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
