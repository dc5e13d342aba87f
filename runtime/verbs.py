"""The runtime's verbs: info, convert, probe-disk, make-model, generate (registered in workbench.commands).

`info` and `convert` dispatch on the model's kind: a pack, a Hugging Face directory, a directory in MLX's layout or
a GGUF file.
"""
from __future__ import annotations

import json

from workbench.commands import command, emit, flags, flash, running
from workbench.errors import WorkbenchError


def _info_flags(p):
    flags("model", "preset", "budget", "engine",
          budget={"help": "the expert cache to size the memory needs at (default: the preset's)"},
          preset={"help": "whose storage a checkpoint not yet converted is sized at"})(p)


@command("info", "describe a model, pack or GGUF", _info_flags)
def cmd_info(args):
    """The plan of a run (runtime.plan), nothing converted: a checkpoint not yet converted, or its config.json alone,
    is sized at the pack the preset would write."""
    from runtime.plan import config_only, plan
    from workbench.memory import describe
    from workbench.models.mlx_layout import is_mlx_layout
    from workbench.registry import is_pack, model_dir
    pl = plan(args.model, args.preset, args.budget, args.engine, convert=False, check=False)
    src = model_dir(pl.model)
    if config := config_only(src):
        obj = {"path": str(config), "kind": "config"}
    elif is_pack(src) or is_mlx_layout(src) or src.suffix == ".gguf":     # a pack, or an index of a file in place
        pk = pl.pack
        obj = {"path": str(pk.path), "kind": "pack", "layout": pk.layout, "quant": pk.quant,
               "expert_nbytes": pk.expert_nbytes, "experts": pk.num_expert_total, "file_size": pk.header["file_size"]}
    else:
        from workbench.models.hf import HFModel
        m = HFModel(src)
        obj = {"path": str(src), "kind": "huggingface", "tensors": len(m.where), "expert_tensors": len(m.experts),
               "pack": str(pl.pack.path) if pl.pack else None}
    obj.update(spec=pl.spec.to_dict(), engine=pl.engine, memory=pl.memory)
    s = obj["spec"]
    head = f"{obj['path']}: {s['family']}, {s['num_layers']} layers, {s['num_experts']} experts, top-{s['top_k']}, " \
           f"d={s['hidden_size']}"
    if str(args.model).endswith(".gguf"):
        gguf, head = _info_gguf(args)
        obj = {**gguf, "index": obj["path"], "engine": pl.engine, "memory": pl.memory}
    emit(args, obj, f"{head}\n{describe(pl.memory)}")


def _info_gguf(args) -> tuple[dict, str]:
    from workbench.models.gguf_model import GGUFModel
    g = GGUFModel(args.model)
    types = {}
    for t in g.reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    obj = {"path": str(g.path), "kind": "gguf", "architecture": g.arch, "spec": g.spec.to_dict(),
           "tensors": len(g.raw), "tensor_types": types, "file_size": g.path.stat().st_size,
           "mtp_layers": g.mtp_layers}
    s = obj["spec"]
    mtp = f" (+{g.mtp_layers} MTP, not read)" if g.mtp_layers else ""
    return obj, (f"{g.path}: GGUF {g.arch} ({s['family']}), {s['num_layers']} layers{mtp}, {s['num_experts']} "
                 f"experts, top-{s['top_k']}, d={s['hidden_size']}, types {types}")


def _convert_flags(p):
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "native"])
    p.add_argument("--experts", default=None, choices=["q4", "q3", "q2", "q8", "bf16", "raw", "g4", "g3", "g2", "g8"],
                   help="default g4 (ggml's Q4_K/Q4_0 blocks; q4, MLX's affine layout, without llama-cpp-python); "
                        "raw, the source's own blocks, for a .gguf or MLX source (their default)")
    p.add_argument("--rest", default=None, choices=["q4", "q8", "bf16", "raw"],
                   help="default q4; raw, the source's own blocks, for a .gguf or MLX source (their default)")


@command("convert", "write an expert pack from a Hugging Face checkpoint, an MLX checkpoint or a GGUF", _convert_flags)
def cmd_convert(args):
    from workbench.models.mlx_layout import is_mlx_layout
    from workbench.registry import block_experts, model_dir
    from workbench.store.pack import Pack, convert
    own = str(args.src).endswith(".gguf") or is_mlx_layout(model_dir(args.src))   # keeps its own blocks (raw)
    experts = args.experts or ("raw" if own else block_experts("q4"))
    rest = args.rest or ("raw" if own else "q4")
    if not own and "raw" in (experts, rest):
        raise WorkbenchError("--experts/--rest raw keep a GGUF's or an MLX checkpoint's own blocks: the source must "
                             "be a .gguf file or a directory in MLX's layout")
    dst = convert(model_dir(args.src), args.dst, layout=args.layout, experts=experts, rest=rest, progress=not args.json)
    pack = Pack(dst)
    emit(args, {"path": str(dst), "layout": pack.layout, "quant": pack.quant, "file_size": pack.header["file_size"],
                "expert_nbytes": pack.expert_nbytes}, f"wrote {dst} ({pack.header['file_size'] / 2**20:.1f} MiB)")


def _probe_flags(p):
    p.add_argument("--path", default=None, help="a file or folder on the disk to probe (default: the pack cache)")
    p.add_argument("--seconds", type=float, default=0.3, help="per (size, depth) point")
    p.add_argument("--save-device", default=None, metavar="NAME", help="also write the fit as data/devices/NAME.json")


@command("probe-disk", "bandwidth and latency by read size and queue depth", _probe_flags)
def cmd_probe_disk(args):
    from workbench.disk_probe import probe
    res = probe(args.path, seconds_per_point=args.seconds, refresh=True)
    if args.save_device:              # this machine as a device profile (data/devices/NAME.json)
        from workbench.atomic import atomic_write
        from workbench.devices import DEVICES
        from workbench.disk_probe import profile_from_probe
        prof = profile_from_probe(res, args.save_device, f"this machine ({args.save_device}), measured by probe-disk")
        res["device_profile"] = str(atomic_write(DEVICES / f"{args.save_device}.json", json.dumps(prof, indent=1) + "\n"))
    lines = [f"{p['size'] // 1024:>6} KiB  qd {p['depth']}:  {p['mb_s']:8.1f} MB/s  p50 {p['lat_ms_p50']:.3f} ms"
             for p in res["points"]]
    emit(args, res, f"{res['path']} ({res['mode']})\n" + "\n".join(lines))


def _make_model_flags(p):
    from workbench.shapes import SHAPES
    p.add_argument("--shape", required=True, help=" | ".join(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="layers (default: the model's)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (default: the model's)")
    p.add_argument("--out", default=None, help="the directory, or .gguf file, to write (default: under the pack cache)")
    p.add_argument("--format", default=None, choices=["hf", "gguf"],
                   help="hf: a Hugging Face directory of float16 shards (every shape a Qwen3-MoE); gguf: the real "
                        "architecture for llama.cpp, written tensor by tensor (default: gguf for an --out *.gguf)")
    p.add_argument("--type", default=None, help="gguf: q4_k_m | q2_k | q2_k_s | q8_0 (default: q2_k_s for "
                                                "qwen3-next-80b-a3b, else q4_k_m)")
    p.add_argument("--seed", type=int, default=0)


@command("make-model", "write a random-weight checkpoint with a real model's shape (a HF directory or a GGUF)",
         _make_model_flags)
def cmd_make_model(args):
    from workbench.shapes import SHAPES, checkpoint_path, make_model, random_card
    fmt = args.format or ("gguf" if str(args.out or "").endswith(".gguf") else "hf")
    layers = SHAPES[args.shape]["num_hidden_layers"] if args.layers is None and args.shape in SHAPES else args.layers
    if fmt == "gguf":
        from engines.gguf_random import DEFAULT_TYPE, make_gguf
        qtype = args.type or DEFAULT_TYPE.get(args.shape, "q4_k_m")
        out = args.out or checkpoint_path(args.shape, layers, args.experts, gguf=qtype)
        path = make_gguf(args.shape, out, layers, args.experts, qtype, seed=args.seed, progress=not args.json)
    else:
        if args.type:
            raise WorkbenchError(f"--type {args.type}: a Hugging Face checkpoint is float16; --type is for "
                                 f"--format gguf")
        out = args.out or checkpoint_path(args.shape, layers, args.experts)
        path = make_model(args.shape, layers, out, experts=args.experts, seed=args.seed)
    c = random_card(path)
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir())
    emit(args, {"path": str(path), "format": fmt, "file_size": size, **c},
         f"wrote {path} ({size / 1e9:.2f} GB): {c['label']}")


def _generate_flags(p):
    flags("prompt", "tokens", "threads")(p)
    p.add_argument("--stop-at-eos", action="store_true")


@command("generate", "generate text greedily", running, flash, _generate_flags)
def cmd_generate(args):
    from runtime.session import open_session
    with open_session(args.model, args.preset, args.budget, prompt=args.prompt, tokens=args.tokens,
                      engine=args.engine, direct=not args.page_cache, device=args.device, threads=args.threads) as s:
        out = s.generate(args.prompt, tokens=args.tokens, stop_at_eos=args.stop_at_eos)
        summ = s.summary()
        out.update(preset=s.preset.name, hit_rate=summ["hit_rate"], bytes_read=summ["bytes_read"])
    emit(args, out, args.prompt + out["text"])
