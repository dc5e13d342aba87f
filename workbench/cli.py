"""`python -m workbench <verb> ...`: every verb takes --json and then prints one JSON object on stdout.

Errors a user can fix (bad paths, corrupt packs, budgets too small) print one line on stderr
and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from workbench.spec import WorkbenchError


def running(p):
    """The flags of every verb that runs a model."""
    p.add_argument("--model", default="demo")
    p.add_argument("--preset", default="on_demand")
    p.add_argument("--budget", default=None, help="0.25 (fraction of all experts), 96MiB, or all")
    p.add_argument("--engine", default="numpy")
    p.add_argument("--page-cache", action="store_true", help="buffered reads (labelled page-cache) instead of O_DIRECT")
    return p


def _print(args, obj: dict, human: str):
    if args.json:
        print(json.dumps(obj, default=_jsonable))
    else:
        print(human)


def _jsonable(o):
    import numpy as np
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _session(args, **kw):
    from workbench.session import Session
    return Session(args.model, args.preset, budget=args.budget, engine=args.engine, direct=not args.page_cache, **kw)


def cmd_info(args):
    from workbench.memory import fits, model_bytes
    from workbench.registry import is_pack, model_dir
    from workbench.store.pack import Pack
    p = model_dir(args.model)
    if is_pack(p):
        pack = Pack(p)
        obj = {"path": str(p), "kind": "pack", "spec": pack.spec.to_dict(), "layout": pack.layout, "quant": pack.quant,
               "expert_nbytes": pack.expert_nbytes, "experts": pack.num_expert_total, "file_size": pack.header["file_size"]}
        mem = fits(*model_bytes(pack.spec, [t["shape"] for t in pack.tensors.values()]))
    else:
        from workbench.models.hf import HFModel
        m = HFModel(p)
        obj = {"path": str(p), "kind": "huggingface", "spec": m.spec.to_dict(), "tensors": len(m.where),
               "expert_tensors": len(m.experts)}
        mem = fits(*model_bytes(m.spec, [m.tensor_shape(n) for n in m.names()]))
    obj["memory"] = mem
    s = obj["spec"]
    _print(args, obj, f"{p}: {s['family']}, {s['num_layers']} layers, {s['num_experts']} experts, top-{s['top_k']}, "
                      f"d={s['hidden_size']}\nmemory (numpy engine, f32): weights {mem['weights_bytes'] / 2**20:.0f} MiB, "
                      f"all experts {mem['all_experts_bytes'] / 2**20:.0f} MiB; largest --budget that fits the "
                      f"available memory: {mem['largest_budget']}")


def cmd_convert(args):
    from workbench.registry import model_dir
    from workbench.store.pack import Pack, convert
    dst = convert(model_dir(args.src), args.dst, layout=args.layout, experts=args.experts, rest=args.rest,
                  progress=not args.json)
    pack = Pack(dst)
    _print(args, {"path": str(dst), "layout": pack.layout, "quant": pack.quant, "file_size": pack.header["file_size"],
                  "expert_nbytes": pack.expert_nbytes}, f"wrote {dst} ({pack.header['file_size'] / 2**20:.1f} MiB)")


def cmd_probe_disk(args):
    from workbench.floor import probe
    res = probe(args.path, seconds_per_point=args.seconds, refresh=True)
    lines = [f"{p['size'] // 1024:>6} KiB  qd {p['depth']}:  {p['mb_s']:8.1f} MB/s  p50 {p['lat_ms_p50']:.3f} ms"
             for p in res["points"]]
    _print(args, res, f"{res['path']} ({res['mode']})\n" + "\n".join(lines))


def cmd_generate(args):
    with _session(args) as s:
        out = s.generate(args.prompt, tokens=args.tokens, stop_at_eos=args.stop_at_eos)
        summ = s.summary()
        out.update(preset=s.preset.name, hit_rate=summ["hit_rate"], bytes_read=summ["bytes_read"])
    _print(args, out, args.prompt + out["text"])


def cmd_bench(args):
    from workbench.bench import bench
    res = bench(args.model, args.preset, budget=args.budget, tokens=args.tokens, prompt=args.prompt,
                engine=args.engine, direct=not args.page_cache, record=not args.no_record)
    _print(args, res, "\n".join(f"{k}: {v}" for k, v in res.items() if k != "per_layer"))


def cmd_ladder(args):
    from workbench.ladder import run_ladder, table
    res = run_ladder(args.name, model=args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds,
                     progress=None if args.json else print)
    _print(args, res, table(res))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m workbench", description="MoE expert-streaming workbench")
    sub = ap.add_subparsers(dest="verb", required=True)

    def verb(name, fn, help):
        p = sub.add_parser(name, help=help)
        p.set_defaults(fn=fn)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return p

    p = verb("info", cmd_info, "describe a model or pack")
    p.add_argument("--model", default="demo")
    p = verb("convert", cmd_convert, "write an expert pack from a Hugging Face checkpoint")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "native"])
    p.add_argument("--experts", default="q4", choices=["q4", "q3", "q2", "q8", "bf16"])
    p.add_argument("--rest", default="q4", choices=["q4", "q8", "bf16"])
    p = verb("probe-disk", cmd_probe_disk, "bandwidth and latency by read size and queue depth")
    p.add_argument("--path", default=None, help="a file or folder on the disk to probe (default: the pack cache)")
    p.add_argument("--seconds", type=float, default=0.3, help="per (size, depth) point")
    p = running(verb("generate", cmd_generate, "generate text greedily"))
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--stop-at-eos", action="store_true")
    p = running(verb("bench", cmd_bench, "measure decode speed, hits and flash wait; writes a run record"))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--no-record", action="store_true")

    from evals.cli import register; register(sub, verb)  # eval ppl|teacher|lm|compare|report, serve
    p = verb("ladder", cmd_ladder, "a design's ablation ladder, alternating arms, one run record per rung")
    p.add_argument("name", choices=["les", "smol", "cache", "designs"])
    p.add_argument("--model", default="demo")
    p.add_argument("--budget", default="0.25")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)

    from workbench.edge0.cli import register; register(sub, verb)  # ladder edge0
    from engines.llamacpp_cli import register; register(sub, verb)  # export-gguf, trace, replay, bench-peer; bench --engine llamacpp
    args = ap.parse_args(argv)
    try:
        args.fn(args)
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
