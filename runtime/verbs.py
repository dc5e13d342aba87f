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
    from engines import default_engine, engine_class, slot_bytes
    from workbench.presets import Budget, get_preset
    from workbench.edge0.artifacts import edge0_dir, edge0_dir_of, served_bytes
    from workbench.models.mlx_layout import is_mlx_layout
    from workbench.registry import GGUF_STORAGE, is_pack, model_dir, resolve_pack, storage_for
    preset = get_preset(args.preset)
    gguf = _info_gguf(args) if str(args.model).endswith(".gguf") else None
    p = model_dir(args.model)
    config = config_only(p)
    if not config and (gguf or is_mlx_layout(p) or storage_for(args.model, preset.storage) == GGUF_STORAGE):
        p = resolve_pack(args.model, *GGUF_STORAGE)     # a run streams it through its index: sized as that pack
    if config:                      # before the download: the shapes from config.json alone
        from workbench.memory import tensor_shapes
        from workbench.models.hf import read_config
        from workbench.spec import from_hf_config
        spec = from_hf_config(read_config(config), str(config))
        shapes = tensor_shapes(spec)
        obj = {"path": str(config), "kind": "config", "spec": spec.to_dict(), "engine": args.engine or default_engine()}
        item, resident_bytes = slot_bytes(obj["engine"], spec, preset.storage), None
        if "quantization" in read_config(config):       # MLX's layout: it runs at its own bits, in place
            from types import SimpleNamespace
            from engines.packed_kernels import affine_of
            from workbench.memory import planned_mlx
            tensors, slot, kinds = planned_mlx(read_config(config), spec)
            if not args.engine and obj["engine"] == "packed" and not all(map(affine_of, kinds)):
                obj["engine"] = "numpy"                 # as default_engine picks for its index
            cls = engine_class(obj["engine"])
            resident_bytes = cls.resident_bytes(SimpleNamespace(spec=spec, tensors=tensors))
            item = slot if cls.slot_arena else cls.slot_bytes(spec)
        adapters = 0
    elif is_pack(p):
        from workbench.store.pack import Pack
        pack = Pack(p)
        obj = {"path": str(p), "kind": "pack", "spec": pack.spec.to_dict(), "layout": pack.layout, "quant": pack.quant,
               "expert_nbytes": pack.expert_nbytes, "experts": pack.num_expert_total, "file_size": pack.header["file_size"]}
        spec, shapes = pack.spec, {n: t["shape"] for n, t in pack.tensors.items()}
        obj["engine"] = args.engine or default_engine(pack)
        item, resident_bytes = slot_bytes(obj["engine"], pack), engine_class(obj["engine"]).resident_bytes(pack)
        adapters = served_bytes(edge0_dir(pack), preset)
    else:
        from workbench.models.hf import HFModel
        m = HFModel(p)
        obj = {"path": str(p), "kind": "huggingface", "spec": m.spec.to_dict(), "tensors": len(m.where),
               "expert_tensors": len(m.experts), "engine": args.engine or default_engine()}
        spec, shapes = m.spec, {n: m.tensor_shape(n) for n in m.where}
        # not converted yet: an expert costs what it will in the pack the preset's Session converts it to
        item, resident_bytes = slot_bytes(obj["engine"], spec, preset.storage), None
        adapters = served_bytes(edge0_dir_of(p), preset)
    from workbench.memory import describe, memory_needs
    from workbench.host import peak_rss_bytes
    budget = Budget(str(args.budget if args.budget is not None else preset.cache.budget))
    engine_class(obj["engine"])         # its module imported: this process's memory is a run's runtime
    obj["memory"] = memory_needs(spec, shapes, budget, item, resident_bytes, obj["engine"],
                                 runtime_bytes=peak_rss_bytes(), speculative=preset.execution.speculative,
                                 adapter_bytes=adapters, scope=preset.cache.scope.value)
    s = obj["spec"]
    head = f"{p}: {s['family']}, {s['num_layers']} layers, {s['num_experts']} experts, top-{s['top_k']}, " \
           f"d={s['hidden_size']}"
    if gguf:
        obj = {**gguf[0], "index": str(p), "engine": obj["engine"], "memory": obj["memory"]}
        head = gguf[1]
    emit(args, obj, f"{head}\n{describe(obj['memory'])}")


def config_only(p):
    """The config.json to size a model by when `p` is one, or a directory holding it and no weights; else None."""
    from pathlib import Path
    p = Path(p)
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "config.json").is_file() and not any(p.glob("*.safetensors")) \
            and not (p / "model.safetensors.index.json").exists():
        return p / "config.json"
    return None


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
