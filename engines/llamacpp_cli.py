"""CLI verbs of the llama.cpp adapter, registered into `python -m workbench` by one hook line in cli.main().

    export-gguf --model demo OUT.gguf --type f16|q8_0|q4_k_m|...   a qwen3moe GGUF of a workbench model
    trace --engine llamacpp|numpy --model M --data FILE --tokens N --out trace.parquet
    replay trace.parquet --preset les --budget 0.25                 hit rate / recall of each design
    bench-peer --model demo --budget 0.25                           workbench vs stock llama.cpp, side by side

and, on existing verbs:
    bench --engine llamacpp --model X.gguf|demo    stock llama.cpp measured from outside (a child process)
    convert model.gguf PACK                        GGUF import; --experts/--rest default to raw for a GGUF
    info --model X.gguf                            describe a GGUF checkpoint
"""
from __future__ import annotations

from pathlib import Path

from workbench.spec import WorkbenchError


def _print(args, obj, human):
    from workbench.cli import _print as p
    p(args, obj, human)


def cmd_export_gguf(args):
    from engines.llamacpp_engine import KQUANTS, quantize_gguf
    from workbench.models.gguf_export import export_gguf
    from workbench.models.hf import HFModel
    from workbench.registry import is_pack, model_dir
    from workbench.store.pack import Pack
    src = model_dir(args.model)
    source = Pack(src) if is_pack(src) else HFModel(src)
    out = Path(args.out)
    if args.type in KQUANTS:
        tmp = out.with_name(f".{out.name}.f16.gguf")
        try:
            export_gguf(source, tmp, "f16", progress=not args.json)
            quantize_gguf(tmp, out, args.type, threads=args.threads)
        finally:
            if tmp.exists():
                tmp.unlink()
    else:
        export_gguf(source, out, args.type, progress=not args.json)
    from workbench.models.gguf_model import GGUFModel
    g = GGUFModel(out)
    types = sorted({t.tensor_type.name for t in g.reader.tensors})
    obj = {"path": str(out), "architecture": g.arch, "type": args.type, "file_size": out.stat().st_size,
           "tensors": len(g.raw), "tensor_types": types, "spec": g.spec.to_dict()}
    _print(args, obj, f"wrote {out} ({g.arch}, {args.type}, {obj['file_size'] / 2**20:.1f} MiB, types {', '.join(types)})")


def _trace_ids(args, tokenize) -> list[int]:
    from workbench.textdata import text_of
    text = text_of(args.data)
    ids = tokenize(text[: args.tokens * 8 + 64])[: args.tokens]
    if len(ids) < args.tokens:
        ids = tokenize(text)[: args.tokens]
    if not ids:
        raise WorkbenchError(f"{args.data}: no tokens")
    return ids


def cmd_trace(args):
    from workbench.traces import capture_numpy, write_trace
    if args.engine == "llamacpp":
        from engines.llamacpp_engine import LlamaCpp, capture_trace, resolve_gguf
        from workbench.models.gguf_model import GGUFModel
        path = resolve_gguf(args.model, args.type)
        g = GGUFModel(path)
        with LlamaCpp(path, n_ctx=64) as llm:
            ids = _trace_ids(args, llm.tokenize)
        tr = capture_trace(path, ids, threads=args.threads)
        if tr["moe_layers"] != g.spec.moe_layers:
            raise WorkbenchError(f"{path}: llama.cpp reported MoE layers {tr['moe_layers']}, the GGUF has {g.spec.moe_layers}")
        meta = {"engine": "llamacpp", "model": args.model, "gguf": str(Path(path).resolve()), "spec": g.spec.to_dict(),
                "source": g.source_info(), "data": args.data}
    elif args.engine == "numpy":
        from workbench.registry import resolve_pack, tokenizer_for
        from workbench.presets import get_preset
        from workbench.store.pack import Pack
        p = get_preset(args.preset)
        tok = tokenizer_for(Pack(resolve_pack(args.model, p.layout, p.experts, p.rest)))
        if tok is None:
            raise WorkbenchError(f"{args.model}: no tokenizer")
        ids = _trace_ids(args, lambda t: tok.encode(t).ids)
        tr, meta = capture_numpy(args.model, ids, args.preset)
        meta["data"] = args.data
    else:
        raise WorkbenchError(f"--engine {args.engine!r}: trace supports llamacpp and numpy")
    from workbench.routing_trace import named_predictions
    from workbench.spec import MoESpec
    from workbench.traces import _weights_for
    spec = MoESpec.from_dict(meta["spec"])
    out = write_trace(args.out, tr, ids, meta, predictions=named_predictions(tr, spec, _weights_for(meta, None, spec)))
    obj = {"path": str(out), "engine": args.engine, "tokens": len(ids), "moe_layers": tr["moe_layers"],
           "top_k": int(tr["topk"].shape[2]), "rows": len(ids) * len(tr["moe_layers"])}
    _print(args, obj, f"wrote {out}: {len(ids)} tokens x {len(tr['moe_layers'])} layers ({args.engine})")


def cmd_replay(args):
    from workbench.traces import DESIGNS, replay, table
    designs = tuple(args.designs.split(",")) if args.designs else DESIGNS
    bad = [d for d in designs if d not in DESIGNS]
    if bad:
        raise WorkbenchError(f"--designs {bad[0]!r}: choose from {', '.join(DESIGNS)}")
    res = replay(args.trace, args.preset, args.budget, model=args.model, designs=designs, skip=args.skip)
    _print(args, res, table(res))


def bench_llamacpp(args) -> dict:
    from engines.llamacpp_engine import bench_gguf, resolve_gguf
    from workbench.runs import write_run
    path = resolve_gguf(args.model, args.gguf_type, progress=not args.json)
    res = bench_gguf(path, tokens=args.tokens, prompt=args.prompt, mode=args.llama_mode, threads=args.llama_threads)
    res.update(model=args.model, gguf_type=args.gguf_type if not str(args.model).endswith(".gguf") else "as_is")
    if not args.no_record:
        cfg = {"model": args.model, "engine": "llamacpp", "gguf": str(path), "mode": args.llama_mode,
               "threads": args.llama_threads, "tokens": args.tokens, "prompt": args.prompt}
        res["run"] = str(write_run(f"llamacpp-{args.llama_mode}", cfg, res, [], []))
    return res


def cmd_bench_peer(args):
    from engines.llamacpp_peer import run_peer
    res = run_peer(model=args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds,
                   gguf_type=args.type, threads=args.threads, prompt=args.prompt, out=Path(args.out),
                   progress=None if args.json else print)
    _print(args, res, res["markdown"])


def _wrap(sub, verb_name, wrapper):
    p = sub.choices[verb_name]
    original = p.get_default("fn")
    p.set_defaults(fn=lambda args: wrapper(args, original))
    return p


def _bench(args, original):
    if args.engine != "llamacpp":
        return original(args)
    res = bench_llamacpp(args)
    _print(args, res, "\n".join(f"{k}: {v}" for k, v in res.items() if k != "token_ids"))


def _convert(args, original):
    gguf = str(args.src).endswith(".gguf")
    args.experts = args.experts or ("raw" if gguf else "q4")
    args.rest = args.rest or ("raw" if gguf else "q4")
    if not gguf and "raw" in (args.experts, args.rest):
        raise WorkbenchError("--experts/--rest raw keep a GGUF's own blocks: the source must be a .gguf file")
    return original(args)


def _info(args, original):
    if not str(args.model).endswith(".gguf"):
        return original(args)
    from workbench.models.gguf_model import GGUFModel
    g = GGUFModel(args.model)
    types = {}
    for t in g.reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    obj = {"path": str(g.path), "kind": "gguf", "architecture": g.arch, "spec": g.spec.to_dict(),
           "tensors": len(g.raw), "tensor_types": types, "file_size": g.path.stat().st_size}
    s = obj["spec"]
    _print(args, obj, f"{g.path}: GGUF {g.arch} ({s['family']}), {s['num_layers']} layers, {s['num_experts']} experts, "
                      f"top-{s['top_k']}, d={s['hidden_size']}, types {types}")


def register(sub, verb):
    from engines.llamacpp_engine import GGUF_TYPES

    p = verb("export-gguf", cmd_export_gguf, "write a workbench model as a qwen3moe GGUF for llama.cpp")
    p.add_argument("--model", default="demo")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", default="f16", choices=list(GGUF_TYPES),
                   help="f16 | q8_0 (gguf package); k-quants through llama.cpp's own quantizer")
    p.add_argument("--threads", type=int, default=1)

    p = verb("trace", cmd_trace, "capture per-token per-layer routing into a Parquet trace")
    p.add_argument("--engine", default="llamacpp", choices=["llamacpp", "numpy"])
    p.add_argument("--model", default="demo", help="a .gguf, or a workbench model (exported to GGUF for llamacpp)")
    p.add_argument("--data", default="tinystories", help="tinystories, wikitext2, or a text file")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", required=True)
    p.add_argument("--type", default="f16", choices=list(GGUF_TYPES), help="GGUF type when exporting (llamacpp)")
    p.add_argument("--preset", default="teacher", help="the pack the numpy engine traces")
    p.add_argument("--threads", type=int, default=1)

    p = verb("replay", cmd_replay, "simulate the expert cache of each design over a routing trace")
    p.add_argument("trace")
    p.add_argument("--preset", default="les")
    p.add_argument("--budget", default=None, help="0.25 (fraction of all experts), 96MiB, or all")
    p.add_argument("--model", default=None, help="where to read the routers for lookahead (default: the trace's)")
    p.add_argument("--designs", default=None, help="comma-separated subset of on_demand,history,shuffled,lookahead,oracle")
    p.add_argument("--skip", type=int, default=0, help="tokens that only warm the cache, not counted")

    p = verb("bench-peer", cmd_bench_peer, "workbench resident/les vs stock llama.cpp cold/warm; writes results/peer.*")
    p.add_argument("--model", default="demo")
    p.add_argument("--budget", default="0.25")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--type", default="q4_k_m", choices=list(GGUF_TYPES), help="the GGUF llama.cpp runs")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))

    b = _wrap(sub, "bench", _bench)
    b.add_argument("--gguf-type", default="f16", choices=list(GGUF_TYPES),
                   help="--engine llamacpp: the GGUF type when exporting a workbench model")
    b.add_argument("--llama-mode", default="cold", choices=["cold", "warm"],
                   help="--engine llamacpp: drop the GGUF from the page cache first (cold) or read it in (warm)")
    b.add_argument("--llama-threads", type=int, default=1, help="--engine llamacpp: llama.cpp threads")

    c = _wrap(sub, "convert", _convert)
    for a in c._actions:       # GGUF import: raw (the GGUF's own blocks) is the default there
        if a.dest in ("experts", "rest"):
            a.choices = list(a.choices) + ["raw"]
            a.default = None
            a.help = (a.help or "") + " (default q4; raw, the GGUF's own blocks, for a .gguf source)"
    _wrap(sub, "info", _info)
