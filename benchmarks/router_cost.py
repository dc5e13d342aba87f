"""What a full-size router product costs a decoded token, with its weights in cache and out of it.

    python benchmarks/router_cost.py --shape qwen3-next-80b-a3b --rounds 5

A router is (experts x hidden); the packed engine keeps a full-size one in Q8_0 (engines/packed_engine.py,
ROUTER_KIND) and computes it on one thread in ggml's kernel (engines/ggml_kernels.py, dense). A decoded token
computes it twice a MoE layer under les: the layer's own router, and the next layer's as the lookahead. Arms, each
on the shape's layers' own matrices (random weights, the shape's sizes from workbench/shapes.py), alternating in
every round:

  warm   one layer's router, computed again and again: its bytes stay in the core's cache (the cost of the
         product alone)
  cold   every layer's router once, in the token's order, after a sweep of a buffer larger than the caches: as a
         decode step meets them, the whole token's other weights (attention, shared and routed experts) having
         passed through the cache since each was last read

  side by side   cold, the layer's router and the lookahead's (another layer's matrix, as cold) in one
         G.routers call, one product on each of the engine's threads (engines/packed_engine.py, routers): what a
         decoded token does since; its time is per product (the pair's over two)

Q4_0 is measured beside Q8_0 (half the bytes, a different rounding of the router: it changes what it ranks
first), to say how much of the cold product is its bytes. Per token: 2 x the MoE layers x the cold product.
Writes router_cost.{json,md} (atomically) into --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engines.packed_engine  # noqa: E402,F401  (its OpenMP wait policy, as the engine runs)
import numba  # noqa: E402
from engines import ggml_kernels as G  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.shapes import SHAPES  # noqa: E402
from workbench.store import ggml_blocks as B  # noqa: E402

KINDS = ("Q8_0", "Q4_0")


def routers(shape: str, kind: str, layers: int, rng) -> list[np.ndarray]:
    s = SHAPES[shape]
    w = rng.standard_normal((s["num_experts"], s["hidden_size"])).astype(np.float32)
    return [np.ascontiguousarray(B.quantize(w * np.float32(1 + i / 97), kind).view(np.uint8).reshape(-1))
            for i in range(layers)]


def measure(shape: str, rounds: int, repeat: int, sweep_mib: int, layers: int | None = None) -> dict:
    s = SHAPES[shape]
    rows, cols = s["num_experts"], s["hidden_size"]
    layers = layers or s["num_hidden_layers"]
    rng = np.random.default_rng(0)
    mats = {k: routers(shape, k, 2 * layers, rng) for k in KINDS}      # the lookahead's: the second half
    parts = {k: G.part_row(k, cols) for k in KINDS}
    x, y = rng.standard_normal((1, cols)).astype(np.float32), np.empty((1, rows), np.float32)
    sweep = np.ones(sweep_mib << 20, np.uint8)
    sink = np.empty_like(sweep)

    def warm(k):
        b, p = mats[k][0], parts[k]
        G.dense(b, rows, cols, p, x, y)
        t = time.perf_counter()
        for _ in range(repeat):
            G.dense(b, rows, cols, p, x, y)
        return (time.perf_counter() - t) / repeat * 1e6

    def cold(k):
        np.copyto(sink, sweep)
        t = time.perf_counter()
        for b in mats[k][:layers]:
            G.dense(b, rows, cols, parts[k], x, y)
        return (time.perf_counter() - t) / layers * 1e6

    def side_by_side(k):
        np.copyto(sink, sweep)
        norms, biases = np.ones((1, cols), np.float32), np.zeros((1, rows), np.float32)
        t = time.perf_counter()
        for i in range(layers):
            G.routers([mats[k][i], mats[k][layers + i]], rows, cols, parts[k], x, x, norms, 1e-6, biases, 8)
        return (time.perf_counter() - t) / (2 * layers) * 1e6

    numba.set_num_threads(threads := min(2, numba.config.NUMBA_NUM_THREADS))
    side_by_side(KINDS[0])
    run = {"warm": warm, "cold": cold, "side by side": side_by_side}
    arms = {(k, a): [] for k in KINDS for a in run}
    for _ in range(rounds):
        for (k, a), got in arms.items():
            got.append(run[a](k))
    out = []
    for (k, a), us in arms.items():
        med = float(np.median(us))
        out.append({"kind": k, "arm": a, "bytes": int(mats[k][0].nbytes), "us": med, "us_min": float(min(us)),
                    "us_max": float(max(us)), "us_rounds": us, "gb_s": mats[k][0].nbytes / med / 1e3,
                    "ms_per_token_2_per_layer": 2 * layers * med / 1e3})
    return {"shape": shape, "rows": rows, "cols": cols, "layers": layers, "rounds": rounds, "repeat": repeat,
            "threads": threads,
            "sweep_mib": sweep_mib, "arms": out}


def markdown(res: dict, command: str) -> str:
    md = [f"# A full-size router product, warm and cold: {res['shape']}", "",
          f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one thread; side by side "
          f"{res['threads']})", "",
          f"Router ({res['rows']} x {res['cols']}), {res['layers']} layers' own matrices; warm: one matrix "
          f"{res['repeat']} times; cold: every layer's once after a {res['sweep_mib']} MiB sweep; side by side: "
          f"cold, two a call on {res['threads']} threads (us per product). Median of "
          f"{res['rounds']} alternating rounds (min-max). Per token: two products a MoE layer (its router and the "
          f"lookahead's), at that arm's cost.", "",
          "| kind | arm | bytes | us / product | min-max | GB/s | ms / token (2 a layer) |",
          "|---|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['kind']} | {r['arm']} | {r['bytes']:,} | {r['us']:.0f} | {r['us_min']:.0f}-{r['us_max']:.0f} | "
           f"{r['gb_s']:.1f} | {r['ms_per_token_2_per_layer']:.1f} |" for r in res["arms"]]
    us = {(r["kind"], r["arm"]): r for r in res["arms"]}
    q8c, q8w, q4c = us[("Q8_0", "cold")], us[("Q8_0", "warm")], us[("Q4_0", "cold")]
    q8s = us[("Q8_0", "side by side")]
    md += ["", f"Cold, a Q8_0 product takes {q8c['us'] / q8w['us']:.1f}x its warm time: "
           f"{q8c['ms_per_token_2_per_layer']:.1f} ms a token before any Python or prefetch issue; side by side on "
           f"{res['threads']} threads, {q8s['us'] / q8c['us']:.2f}x that ({q8s['ms_per_token_2_per_layer']:.1f} ms a "
           f"token). Q4_0's half the bytes takes {q4c['us'] / q8c['us']:.2f}x Q8_0's cold time "
           f"({q4c['ms_per_token_2_per_layer']:.1f} ms a token)."]
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-next-80b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--sweep-mib", type=int, default=512, help="a buffer larger than the caches (default 512)")
    ap.add_argument("--layers", type=int, default=None, help="fewer than the shape's (a quick check)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    a = ap.parse_args(argv)
    command = (f"python benchmarks/router_cost.py --shape {a.shape} --rounds {a.rounds} --repeat {a.repeat} "
               f"--sweep-mib {a.sweep_mib}" + (f" --layers {a.layers}" if a.layers else ""))
    res = {**measure(a.shape, a.rounds, a.repeat, a.sweep_mib, a.layers), "command": command}
    md = markdown(res, command)
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write(a.out / "router_cost.json", json.dumps(res, indent=1) + "\n")
    atomic_write(a.out / "router_cost.md", md)
    print(md)


if __name__ == "__main__":
    main()
