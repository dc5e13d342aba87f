"""`bench-peer`: the workbench's `resident` and `les` against stock llama.cpp (cold and warm), side by side.

    python -m workbench bench-peer --model demo --budget 0.25 --json

Every arm runs in its own fresh process, so peak RSS is that arm's alone, in alternating order
(resident, les, llama.cpp cold, llama.cpp warm, then again) for `--rounds` rounds; reported per arm:
median tok/s with min-max, the median round's other fields.

  workbench resident   every expert in memory, int4 (`python -m workbench bench --preset resident`)
  workbench les        the LES design at --budget, experts streamed with O_DIRECT reads
  ..., GGUF blocks     the same two on a pack of the GGUF itself (`convert --experts raw --rest raw`: llama.cpp's
                       own blocks byte for byte, computed by ggml's kernels in the packed engine), so the
                       workbench and llama.cpp run the same weights
  llama.cpp cold       the GGUF (mmap on) after posix_fadvise(DONTNEED) on it: the first pass faults
                       in from disk; no warm-up run (it would warm the page cache)
  llama.cpp warm       the whole file read into the page cache first, then a 4-token warm-up run

Writes results/peer.json and results/peer.md (atomically) with the command that produced them.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workbench.atomic import atomic_write
from workbench.errors import WorkbenchError

REPO = Path(__file__).resolve().parents[1]


def _workbench_arm(model, preset, budget, tokens, prompt) -> dict:
    cmd = [sys.executable, "-m", "workbench", "bench", "--model", model, "--preset", preset, "--budget", budget,
           "--tokens", str(tokens), "--prompt", prompt, "--json", "--no-record"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise WorkbenchError(f"workbench bench --preset {preset} failed: {tail[0]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_peer(model: str = "demo", budget: str = "0.25", tokens: int = 64, rounds: int = 3, gguf_type: str = "q4_k_m",
             threads: int = 1, prompt: str = "Once upon a time", out: Path | None = None, progress=None) -> dict:
    from engines.llamacpp_engine import bench_gguf, resolve_gguf
    from workbench.registry import resolve_pack
    gguf = resolve_gguf(model, gguf_type)
    raw = str(resolve_pack(str(gguf), "contiguous", "raw", "raw"))
    arms = [("workbench resident", lambda: _workbench_arm(model, "resident", "all", tokens, prompt)),
            (f"workbench les @{budget}", lambda: _workbench_arm(model, "les", budget, tokens, prompt)),
            ("workbench resident, GGUF blocks", lambda: _workbench_arm(raw, "resident", "all", tokens, prompt)),
            (f"workbench les @{budget}, GGUF blocks", lambda: _workbench_arm(raw, "les", budget, tokens, prompt)),
            ("llama.cpp cold", lambda: bench_gguf(gguf, tokens, prompt, "cold", threads)),
            ("llama.cpp warm", lambda: bench_gguf(gguf, tokens, prompt, "warm", threads))]
    results = {name: [] for name, _ in arms}
    for r in range(rounds):
        for name, run in arms:
            res = run()
            results[name].append(res)
            if progress:
                progress(f"round {r + 1}/{rounds} {name}: {res['tok_s']:.1f} tok/s, peak RSS "
                         f"{res['peak_rss_bytes'] / 2**20:.0f} MiB")
    rows = []
    for name, _ in arms:
        runs = results[name]
        tps = [x["tok_s"] for x in runs]
        med = sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2]
        row = {"arm": name, "tok_s": statistics.median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
               "tok_s_rounds": tps, "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in runs),
               "peak_rss_bytes": statistics.median(x["peak_rss_bytes"] for x in runs)}
        keep = ("hit_rate", "bytes_read_per_token", "cache_bytes", "budget_bytes", "reader_mode", "floor_tok_s",
                "rss_anon_bytes", "rss_file_bytes", "gguf_mapped_rss_bytes", "file_size", "file_resident_before_bytes",
                "file_resident_after_bytes", "load_s", "threads", "text")
        row.update({k: med[k] for k in keep if k in med})
        rows.append(row)
    same_text = len({r.get("text") for r in rows}) == 1
    same_weights = {r.get("text") for r in rows if r["arm"].startswith("llama") or r["arm"].endswith("GGUF blocks")}
    command = (f"python -m workbench bench-peer --model {model} --budget {budget} --tokens {tokens} --rounds {rounds} "
               f"--type {gguf_type} --threads {threads}")
    from workbench.runs import environment
    res = {"command": command, "model": model, "budget": budget, "tokens": tokens, "rounds": rounds, "prompt": prompt,
           "gguf": str(gguf), "gguf_type": gguf_type, "gguf_size": gguf.stat().st_size, "threads": threads,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "env": environment(), "arms": rows,
           "same_text": same_text, "same_text_same_weights": len(same_weights) == 1, "raw_pack": raw}
    res["markdown"] = markdown(res)
    if out is not None:
        atomic_write(Path(out) / "peer.json", json.dumps({k: v for k, v in res.items() if k != "markdown"},
                                                          indent=1, default=str) + "\n")
        atomic_write(Path(out) / "peer.md", res["markdown"])
    return res


def markdown(res: dict) -> str:
    mib = lambda b: "" if b is None else f"{b / 2**20:.1f}"
    lines = ["# Workbench vs stock llama.cpp, measured\n", f"`{res['command']}`\n",
             f"Model `{res['model']}`; llama.cpp runs `{Path(res['gguf']).name}` ({res['gguf_type']}, "
             f"{mib(res['gguf_size'])} MiB, mmap on, {res['threads']} thread(s)); {res['rounds']} alternating rounds of "
             f"{res['tokens']} tokens, each arm a fresh process; median tok/s (min-max). "
             f"Machine: {res['env'].get('cpu', '')}, {res['env'].get('cores')} cores.\n",
             "| arm | tok/s | min-max | prefill tok/s | peak RSS MiB | detail |", "|---|---:|---:|---:|---:|---|"]
    for r in res["arms"]:
        if r["arm"].startswith("llama"):
            detail = (f"GGUF mapped and touched {mib(r.get('gguf_mapped_rss_bytes'))} MiB (RSS file "
                      f"{mib(r.get('rss_file_bytes'))} with the libraries, anon {mib(r.get('rss_anon_bytes'))}); page cache "
                      f"held of the GGUF before {mib(r.get('file_resident_before_bytes'))}, after "
                      f"{mib(r.get('file_resident_after_bytes'))} MiB; load {r.get('load_s', 0):.2f} s")
        else:
            detail = (f"hit {r.get('hit_rate', 0):.2f}, {r.get('bytes_read_per_token', 0) / 1e3:.0f} KB read/token, "
                      f"expert cache {mib(r.get('cache_bytes'))} MiB ({r.get('reader_mode')})")
        lines.append(f"| {r['arm']} | {r['tok_s']:.1f} | {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} | "
                     f"{r['prefill_tok_s']:.0f} | {mib(r['peak_rss_bytes'])} | {detail} |")
    why = "yes" if res["same_text"] else "no (different weights: workbench int4/int3 packs vs the GGUF's quantization)"
    texts = {r["arm"]: (r.get("text") or "").split() for r in res["arms"]}
    a, b = texts.get("workbench resident, GGUF blocks", []), texts.get("llama.cpp cold", [])
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    same = "yes" if res.get("same_text_same_weights") else (
        f"no: resident on the GGUF blocks and llama.cpp agree on the first {agree} words; past the blocks the two "
        f"compute differently (llama.cpp keeps an f16 KV cache and its own graph; the workbench f32 numpy), so a "
        f"near-tie can break either way")
    lines += ["", f"Greedy text identical across arms: {why}.",
              f"Greedy text identical between the arms on the same weights (GGUF blocks, llama.cpp): {same}.",
              "", "Peak RSS is the arm's process high-water mark (VmHWM): for llama.cpp it includes the GGUF pages "
              "it mapped and touched (RssFile); for the workbench, the non-expert weights as the engine holds them "
              "(packed: encoded matrices, f32 embeddings and norms) and the expert cache it holds (anonymous; the packed engine's cache is its slot arena of packed experts). Both "
              "processes carry the Python and numpy baseline, the workbench also numba's.", ""]
    cold = next((r for r in res["arms"] if r["arm"] == "llama.cpp cold"), None)
    if cold and cold.get("file_resident_after_bytes") == cold.get("file_size"):
        lines += [f"llama.cpp maps the GGUF with MAP_POPULATE (prefetch): a cold start reads the whole file during "
                  f"load ({cold.get('load_s', 0):.2f} s here, not in tok/s), so its decode runs from the page cache; "
                  f"it has no per-expert on-demand reading for MoE tensors (its lazy-read mode covers only tensors "
                  f"an architecture marks, none in qwen3moe).", ""]
    return "\n".join(lines)
