"""The llama.cpp engine's verb and its part of `bench` (registered in workbench.commands).

    export-gguf --model demo OUT.gguf --type f16|q8_0|q4_k_m|...   a GGUF of a workbench model (qwen3moe,
                                                                   qwen3next, qwen35moe)
    bench --engine llamacpp --model X.gguf|demo                    stock llama.cpp measured from outside (a child
                                                                   process): experiments/cli.py calls bench_llamacpp
"""
from __future__ import annotations

import os
from pathlib import Path

from engines.llamacpp_engine import GGUF_TYPES, KQUANTS, quantize_gguf
from workbench.commands import command, emit, flags


def _export_flags(p):
    flags("model")(p)
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", default="f16", choices=list(GGUF_TYPES),
                   help="f16 | q8_0 (gguf package); k-quants through llama.cpp's own quantizer")
    p.add_argument("--threads", type=int, default=1)


@command("export-gguf", "write a workbench model as a GGUF for llama.cpp (qwen3moe, qwen3next, qwen35moe)",
         _export_flags)
def cmd_export_gguf(args):
    from engines.gguf_export import export_gguf
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
    emit(args, obj, f"wrote {out} ({g.arch}, {args.type}, {obj['file_size'] / 2**20:.1f} MiB, types {', '.join(types)})")


def bench_llamacpp(args) -> dict:
    from engines.llamacpp_engine import bench_gguf, resolve_gguf
    from workbench.runs import write_run
    path = resolve_gguf(args.model, args.gguf_type, progress=not args.json)
    mode = "warm" if args.warm else "cold"
    threads = args.threads or os.cpu_count() or 1
    res = bench_gguf(path, tokens=args.tokens, prompt=args.prompt, mode=mode, threads=threads)
    res.update(model=args.model, gguf_type=args.gguf_type if not str(args.model).endswith(".gguf") else "as_is")
    if not args.no_record:
        cfg = {"model": args.model, "engine": "llamacpp", "gguf": str(path), "mode": mode,
               "threads": threads, "tokens": args.tokens, "prompt": args.prompt}
        res["run"] = str(write_run(f"llamacpp-{mode}", cfg, res, [], []))
    return res


def bench_flags(p):
    """`bench`'s flags for --engine llamacpp."""
    p.add_argument("--gguf-type", default="f16", choices=list(GGUF_TYPES),
                   help="--engine llamacpp: the GGUF type when exporting a workbench model")
