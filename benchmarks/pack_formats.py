"""The packed engine's expert format on the demo: MLX's affine group-64 (q4, q3: its default before
results/kernels.md's decision) against ggml's blocks (g4, g3: Q4_K/Q3_K, Q4_0 for the 128-value rows of `down`),
on the same engine: tokens/s cold, the arms alternating in one process; bytes per expert; and KL, top-1 and
perplexity against the teacher on TinyStories.

    python benchmarks/pack_formats.py --rounds 6 --tokens 128        # writes results/pack_formats.md and .json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench import bench  # noqa: E402
from workbench.atomic import atomic_write  # noqa: E402
from workbench.registry import resolve_pack  # noqa: E402
from runtime.session import open_session  # noqa: E402
from workbench.store.pack import Pack  # noqa: E402

ARMS = [("on_demand", "q4", "g4"), ("les", "q3", "g3")]     # (preset, old default, new default)


def speed(rounds: int, tokens: int, budget: str) -> list[dict]:
    packs = {x: str(resolve_pack("demo", "contiguous", x, "q4")) for _, a, b in ARMS for x in (a, b)}
    rows = []
    for r in range(rounds):
        for preset, a, b in ARMS:
            for x in ((a, b) if r % 2 == 0 else (b, a)):         # alternating, the first arm swapped each round
                res = bench(packs[x], preset, budget, tokens=tokens, engine="packed", record=False)
                rows.append({"round": r, "preset": preset, "experts": x, "tok_s": res["tok_s"],
                             "compute_ms_per_token": 1e3 * res["compute_s"] / res["decode_steps"],
                             "hit_rate": res["hit_rate"], "bytes_read_per_token": res["bytes_read_per_token"],
                             "slot_bytes": res["expert_mem_bytes"], "cache_slots": res["cache_slots"],
                             "page_cache_dropped": res["page_cache_dropped"]})
    return rows


def quality(budget: str, chunks: int) -> list[dict]:
    from evals.common import text_ids
    from evals.ppl import tokens_needed
    from evals.teacher import TeacherTrace, compare
    out, trace = [], None
    for preset, a, b in ARMS:
        for x in (a, b):
            with open_session("demo", preset, budget, engine="packed", experts=x) as s:
                if trace is None:
                    ids = text_ids(s.tokenizer, "tinystories", tokens_needed(512, chunks, None))
                    with open_session("demo", "teacher", engine="numpy") as t:
                        trace = TeacherTrace(t, ids, 512, chunks, None, False, "tinystories")
                r = compare(s, trace, False)
                p = Pack(s.pack_path)
                out.append({"preset": preset, "experts": x, "kinds": p.expert_kinds, "expert_nbytes": p.expert_nbytes,
                            **{k: r[k] for k in ("kl", "kl_stderr", "top1", "top1_stderr", "ppl", "ppl_teacher",
                                                 "routing_agreement_mean", "tokens")}})
    return out


def render(rows, qual, command, load) -> str:
    md = [f"# The packed engine's expert format: affine group-64 vs ggml's blocks (demo)\n\n`{command}`\n",
          f"Load average {load[0]:.1f} while measuring (2 cores: above about 1, other jobs shared them; the arms "
          "alternate, so both saw the same load). Packed engine, one compute thread, cold (empty expert cache, the "
          "pack out of the page cache), budget 0.25.\n",
          "| preset | experts | tok/s median | min-max | compute ms/token median | hit rate | MB read/token | slot bytes |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for preset, a, b in ARMS:
        for x in (a, b):
            rs = [r for r in rows if r["preset"] == preset and r["experts"] == x]
            med = lambda k: statistics.median(r[k] for r in rs)
            md.append(f"| {preset} | {x} | {med('tok_s'):.1f} | {min(r['tok_s'] for r in rs):.1f}-"
                      f"{max(r['tok_s'] for r in rs):.1f} | {med('compute_ms_per_token'):.3f} | {med('hit_rate'):.3f} | "
                      f"{med('bytes_read_per_token') / 1e6:.3f} | {rs[0]['slot_bytes']:,} |")
    md += ["", "Quality against the teacher (bf16), TinyStories, exact routing (the budget does not change it):", "",
           "| preset | experts | kinds (gate, up, down) | bytes / expert | KL | top-1 | ppl (teacher) | routing agreement |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for q in qual:
        k = ", ".join(q["kinds"][p].removeprefix("gguf:") for p in ("gate", "up", "down"))
        md.append(f"| {q['preset']} | {q['experts']} | {k} | {q['expert_nbytes']:,} | {q['kl']:.5f} +/- "
                  f"{q['kl_stderr']:.5f} | {q['top1']:.4f} +/- {q['top1_stderr']:.4f} | {q['ppl']:.3f} "
                  f"({q['ppl_teacher']:.3f}) | {q['routing_agreement_mean']:.4f} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    a = ap.parse_args(argv)
    command = (f"python benchmarks/pack_formats.py --rounds {a.rounds} --tokens {a.tokens} --budget {a.budget} "
               f"--chunks {a.chunks}")
    rows, qual = speed(a.rounds, a.tokens, a.budget), quality(a.budget, a.chunks)
    load = os.getloadavg()
    atomic_write(a.out / "pack_formats.json", json.dumps({"command": command, "load": load, "speed": rows,
                                                           "quality": qual}, indent=1) + "\n")
    md = render(rows, qual, command, load)
    atomic_write(a.out / "pack_formats.md", md)
    print(md)


if __name__ == "__main__":
    main()
