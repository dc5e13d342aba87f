"""The experiments' verbs: bench, ladder, trace, import-trace, replay, simulate, leaderboard, bench-peer, routing-stats
(registered in workbench.commands).

`bench --engine llamacpp` measures stock llama.cpp from outside (engines/llamacpp_cli.py); every other engine
is measured here, in process.
"""
from __future__ import annotations

from pathlib import Path

from workbench.commands import command, emit, flags, flash, running
from workbench.errors import WorkbenchError


def _bench_flags(p):
    from engines.llamacpp_cli import bench_flags
    flags("tokens", "prompt", "threads")(p)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--warm", action="store_true",
                   help="measure warm: the warm-up decodes the measured prompt and its experts stay in memory "
                        "(default: cold, an empty expert cache and the model's file out of the page cache)")
    flags("routing_trace", routing_trace={"help": "route and predict as recorded in this trace (real reads, real "
                                                  "compute; ids mapped, see JSON)"})(p)
    flags("set", "design", "text", "free")(p)
    bench_flags(p)


def one_design(args) -> str:
    """The design a verb that runs one runs: --design's, else --preset's."""
    if len(args.design) > 1:
        raise WorkbenchError(f"--design given {len(args.design)} times: this verb runs one design")
    return args.design[0] if args.design else args.preset


def knobs_of(sets: list[str]) -> dict:
    """--set KNOB=VALUE ... as {knob: value} (the preset parses and checks the values)."""
    bad = [s for s in sets if "=" not in s or not s.split("=", 1)[0]]
    if bad:
        raise WorkbenchError(f"--set {bad[0]!r}: expected KNOB=VALUE, e.g. routing=prerouter:nolora")
    return dict(s.split("=", 1) for s in sets)


@command("bench", "measure decode speed, hits and flash wait; writes a run record", running, flash, _bench_flags)
def cmd_bench(args):
    if args.engine == "llamacpp":
        if args.device or args.routing_trace or args.set:
            raise WorkbenchError("--engine llamacpp reads through llama.cpp's own mmap: --device, --routing-trace and "
                                 "--set need an engine the workbench streams (numpy, mlx)")
        from engines.llamacpp_cli import bench_llamacpp
        res = bench_llamacpp(args)
        return emit(args, res, "\n".join(f"{k}: {v}" for k, v in res.items() if k != "token_ids"))
    from experiments.bench import bench
    res = bench(args.model, one_design(args), budget=args.budget, tokens=args.tokens, prompt=args.prompt,
                engine=args.engine, direct=not args.page_cache, record=not args.no_record, device=args.device,
                routing_trace=args.routing_trace, warm=args.warm, threads=args.threads, text=text_of_args(args),
                **knobs_of(args.set))
    degenerate_warning(res)
    emit(args, res, "\n".join(f"{k}: {v}" for k, v in res.items() if k != "per_layer"))


def text_of_args(args) -> str | None:
    """--free or --text: what a run decodes (runtime.text)."""
    if args.free and args.text:
        raise WorkbenchError("--free and --text: choose one (the model's own tokens, or that text forced)")
    return "free" if args.free else args.text


def degenerate_warning(res: dict):
    """A free run whose text or routing degenerated says so on stderr (its numbers are of routing no model has)."""
    c = res.get("text_check") or {}
    if c.get("degenerate") and res.get("text_source", "").startswith("free"):
        import sys
        print(f"warning: the run's text degenerated ({c['distinct_tokens']:.0%} distinct tokens, next-token expert "
              f"reuse {c['reuse']:.2f} against the real trace's {c['real_trace_reuse']:.2f}): its hit rates are of "
              f"routing no real model has; drop --free (forced text) or pass --text FILE", file=sys.stderr)


def _ladder_flags(p):
    p.add_argument("name", choices=["les", "smol", "cache", "designs", "budgets", "edge0"])
    flags("model", "budget", "tokens", budget="0.25", tokens=48)(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", type=int, default=4, help="edge0: held-out chunks for the quality rungs")
    p.add_argument("--chunk-tokens", type=int, default=256, help="edge0: tokens per held-out chunk")
    p.add_argument("--skip-layers", type=int, default=None, help="edge0: MoE layers routed exactly (default: the heads')")
    flags("routing_trace", routing_trace={"help": "every rung routes and predicts as recorded in this trace (a model "
                                                  "with random weights)"})(p)
    flags("set", "design", set={"help": "set one of the presets' knobs on every rung (as bench's --set); repeatable"},
          design={"help": "designs / budgets: a design of your own as a further rung (at every budget); repeatable"})(p)


@command("ladder", "a design's ablation ladder, alternating arms, one run record per rung "
                   "(edge0: quality rungs, recall, speed A/B)", _ladder_flags, flash)
def cmd_ladder(args):
    progress = None if args.json else print
    if args.name == "edge0":
        if args.device:
            raise WorkbenchError("ladder edge0 runs on this machine's flash: --device is for les, smol, cache, designs")
        from experiments.edge0_ladder import run_edge0, table
        res = run_edge0(args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds, chunks=args.chunks,
                        chunk_tokens=args.chunk_tokens, skip_layers=args.skip_layers, progress=progress)
    else:
        from experiments.ladder import run_ladder, table
        res = run_ladder(args.name, model=args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds,
                         progress=progress, device=args.device, routing_trace=args.routing_trace,
                         knobs=knobs_of(args.set), designs=args.design)
    emit(args, res, table(res))


def _trace_ids(args, tokenize) -> list[int]:
    from workbench.textdata import text_of
    text = text_of(args.data)
    ids = tokenize(text[: args.tokens * 8 + 64])[: args.tokens]
    if len(ids) < args.tokens:
        ids = tokenize(text)[: args.tokens]
    if not ids:
        raise WorkbenchError(f"{args.data}: no tokens")
    return ids


def _trace_flags(p):
    from engines.llamacpp_engine import GGUF_TYPES
    flags("engine", "model", "tokens", "preset",
          engine={"default": "llamacpp", "choices": ["llamacpp", "numpy"], "help": "whose routing is traced"},
          model={"help": "a .gguf, or a workbench model (exported to GGUF for llamacpp)"},
          tokens={"default": 512, "help": "tokens of the text to trace"},
          preset={"default": "teacher", "help": "the pack the numpy engine traces"})(p)
    p.add_argument("--data", default="tinystories", help="tinystories, wikitext2, or a text file")
    p.add_argument("--out", required=True)
    p.add_argument("--type", default="f16", choices=list(GGUF_TYPES), help="GGUF type when exporting (llamacpp)")
    p.add_argument("--threads", type=int, default=1)


@command("trace", "capture per-token per-layer routing into a Parquet trace", _trace_flags)
def cmd_trace(args):
    from experiments.traces import capture_numpy, write_trace
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
    else:
        from workbench.presets import get_preset
        from workbench.registry import resolve_pack, storage_for, tokenizer_for
        from workbench.store.pack import Pack
        p = get_preset(args.preset)
        st = p.storage
        tok = tokenizer_for(Pack(resolve_pack(args.model, *storage_for(args.model, st))))
        if tok is None:
            raise WorkbenchError(f"{args.model}: no tokenizer")
        ids = _trace_ids(args, lambda t: tok.encode(t).ids)
        tr, meta = capture_numpy(args.model, ids, args.preset)
        meta["data"] = args.data
    from experiments.routing_trace import drafts, named_predictions, trained_heads
    from experiments.traces import _weights_for
    from workbench.spec import MoESpec
    spec = MoESpec.from_dict(meta["spec"])
    heads = trained_heads(meta, spec)
    meta["prerouter"] = str(heads.path) if heads else None
    preds = named_predictions(tr, spec, _weights_for(meta, None, spec), heads)
    out = write_trace(args.out, tr, ids, meta, predictions=preds, drafts=drafts(ids))
    obj = {"path": str(out), "engine": args.engine, "tokens": len(ids), "moe_layers": tr["moe_layers"],
           "top_k": int(tr["topk"].shape[2]), "rows": len(ids) * len(tr["moe_layers"])}
    emit(args, obj, f"wrote {out}: {len(ids)} tokens x {len(tr['moe_layers'])} layers ({args.engine})")


def _import_trace_flags(p):
    p.add_argument("file", help="a route_trace v1 CSV, or the plain CSV / JSON Lines of (token, layer, experts, "
                                "weights): docs/cli.md")
    p.add_argument("--out", required=True, help="the workbench trace (.parquet) to write")
    p.add_argument("--shape", default=None, help="the real model's shape (make-model's shapes) for the spec (default: "
                                                 "the one a route_trace header matches; the plain format needs it)")


@command("import-trace", "read a real model's routing trace (route_trace v1 or plain CSV/JSONL) into a workbench trace",
         _import_trace_flags)
def cmd_import_trace(args):
    from experiments.import_trace import import_trace
    res = import_trace(args.file, args.out, shape=args.shape)
    emit(args, res, f"wrote {res['path']}: {res['tokens']} tokens x {res['moe_layers']} layers, top-{res['top_k']} of "
                    f"{res['num_experts']} ({res['format']}, shape {res['shape']})"
                    + (f"; left out {res['left_out']} prompt tokens lacking the last layer" if res["left_out"] else ""))


def _replay_flags(p):
    from experiments.simulate import REPLAYED
    p.add_argument("trace")
    flags("preset", "budget", "engine", "tokens", "prompt_tokens", "skip", "set", "design",
          preset={"default": ",".join(REPLAYED), "help": "the presets, comma-separated (default: %(default)s)"},
          engine={"help": "whose expert cache the budget sizes (default: packed, as bench's: engines.default_engine)"},
          tokens={"default": None, "help": "tokens the window decodes, as bench's (default: the rest of the trace)"})(p)


@command("replay", "each preset's schedule over a routing trace, every read landing at once (no timing)",
         _replay_flags)
def cmd_replay(args):
    from experiments.simulate import replay, table
    res = replay(args.trace, [p for p in args.preset.split(",") if p] + args.design, args.budget, tokens=args.tokens,
                 prompt=args.prompt_tokens, skip=args.skip, engine=args.engine, knobs=knobs_of(args.set))
    emit(args, res, table(res))


def _leaderboard_flags(p):
    from experiments.leaderboard import BUDGETS, DEVICES
    p.add_argument("traces", nargs="+", help="routing traces (.parquet: the shipped ones, import-trace's, trace's)")
    flags("design", "engine", "tokens", "prompt_tokens", "skip",
          design={"help": "a design of your own beside the built-ins (path/to/file.py:Name); repeatable"},
          tokens={"default": None, "help": "tokens the window decodes (default: the rest of each trace)"})(p)
    p.add_argument("--designs", default=None, help="the designs, comma-separated (default: the built-ins and the "
                                                   "field's: experiments.leaderboard)")
    p.add_argument("--budgets", default=",".join(BUDGETS), help="(default: %(default)s)")
    p.add_argument("--devices", default=",".join(DEVICES), help="device profiles simulated (default: %(default)s)")
    p.add_argument("--model", default=None, help="measure the compute profile the simulation times on this model")
    p.add_argument("--compute", default=None, help="a compute profile JSON instead of measuring one")
    p.add_argument("--out", default=None, metavar="FILE.md", help="also write the table there, its command at the "
                                                                 "top, and the whole result beside it (FILE.json)")


@command("leaderboard", "every design on every trace at budgets 0.05-0.5: hit rate, reads, Belady's fraction, "
                        "simulated tok/s", _leaderboard_flags)
def cmd_leaderboard(args):
    from experiments.compute_profile import load_compute
    from experiments.leaderboard import BUILTIN, FIELD, run, table
    split = lambda v: [x for x in v.split(",") if x]
    designs = (split(args.designs) if args.designs else list(BUILTIN + FIELD)) + args.design
    res = run(args.traces, designs, split(args.budgets), split(args.devices),
              compute=load_compute(args.compute) if args.compute else None, model=args.model, tokens=args.tokens,
              prompt=args.prompt_tokens, skip=args.skip, engine=args.engine,
              progress=None if args.json else print)
    if args.out:
        import json
        import sys
        from workbench.atomic import atomic_write
        command = "python -m workbench " + " ".join(sys.argv[1:])
        res["command"] = command
        atomic_write(Path(args.out).with_suffix(".json"), json.dumps(res, indent=1, default=str))
        atomic_write(Path(args.out), f"# The leaderboard\n\n`{command}` ({res['seconds']:.0f} s)\n\n{table(res)}")
    emit(args, res, table(res))


def _simulate_flags(p):
    p.add_argument("--trace", default=None, help="the routing trace to replay (--calibrate: default the demo's)")
    flags("preset", "budget", "device", "tokens", "engine", "model", preset="les",
          device={"help": "the device profile that times the reads (default: this-machine; --calibrate: "
                          "this-machine,ufs22-phone, emulated in the measured runs)"},
          engine={"help": "the engine whose compute is measured, and whose expert cache the budget sizes (default: "
                          "packed: engines.default_engine; a --compute profile names its own)"},
          model={"default": None, "help": "measure the compute profile on this model (default: the trace's); a "
                                          "GGUF's experts are read as they lie, in its own blocks"})(p)
    flags("prompt_tokens", "skip", "set", "design")(p)
    p.add_argument("--shape", default=None, help="a real model's expert shape (make-model's shapes)")
    p.add_argument("--workers", type=int, default=None, help="reader threads (default: the profile's queue depth)")
    p.add_argument("--compute", default=None, help="a compute profile JSON instead of measuring one")
    p.add_argument("--predictor", default=None, help="prefetch with this recorded predictor instead of the preset's "
                                                    "(e.g. prerouter, where the trace recorded Edge0's heads)")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--here", action="store_true",
                   help="predict the run on this machine with the device emulated (as bench --device measures it), "
                        "reads at least this machine's: what simulate --calibrate checks (this-machine: always)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's compute profiles and runs of each design against the simulator "
                        "(A / measured per design, budget and device), stored in the profiles cache: simulated "
                        "numbers are then labelled calibrated here (within X%%)")
    p.add_argument("--designs", default=None, help="--calibrate: the designs (default: on_demand,les,smol,oracle,"
                                                   "resident)")
    p.add_argument("--budgets", default="0.1,0.25,0.5", help="--calibrate: the budgets (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="--calibrate: alternating rounds (default: %(default)s)")


@command("simulate", "a design over a routing trace on a virtual clock (no model run); marked simulated", _simulate_flags)
def cmd_simulate(args):
    from experiments.compute_profile import load_compute
    from experiments.simulate import run
    if args.calibrate:
        return _calibrate(args)
    if not args.trace:
        raise WorkbenchError("simulate: --trace FILE is needed (or --calibrate)")
    from workbench.presets import get_preset
    res = run(args.trace, get_preset(one_design(args)).with_(**knobs_of(args.set)), args.budget,
              args.device or "this-machine", shape=args.shape, tokens=args.tokens, prompt=args.prompt_tokens,
              skip=args.skip, compute=load_compute(args.compute) if args.compute else None,
              workers=args.workers, model=args.model, record=not args.no_record, predictor=args.predictor,
              engine=args.engine, here=args.here or None)
    emit(args, res, f"SIMULATED {res['preset']} on {res['device']['label']} ({res['shape_note']}): "
                    f"{res['tok_s']:.2f} tok/s, hit {res['hit_rate']:.3f}; Belady bound: hit {res['belady_hit_rate']:.3f}, "
                    f"{res['belady_tok_s']:.2f} tok/s; {res['calibration']}"
                    + (f"; {res['routing_trace']['prediction']}" if res["routing_trace"].get("prediction") else ""))


def _calibrate(args):
    from experiments import calibration as C
    from experiments.calibrate import calibrate
    split = lambda v, default: tuple(x for x in (v or ",".join(default)).split(",") if x)
    res = calibrate(designs=split(args.designs, C.DESIGNS), budgets=split(args.budgets, C.BUDGETS),
                      devices=split(args.device, C.DEVICES), rounds=args.rounds, tokens=args.tokens,
                      trace=args.trace or C.TRACE, model=args.model or "demo", log=None if args.json else print)
    res["stored"] = str(C.store(res))
    emit(args, res, C.table(res) + f"\nstored in {res['stored']}")


def _peer_flags(p):
    from engines.llamacpp_engine import GGUF_TYPES
    flags("model", "budget", "tokens", "prompt", budget="0.25")(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--type", default="q4_k_m", choices=list(GGUF_TYPES), help="the GGUF llama.cpp runs")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))


@command("bench-peer", "workbench resident/les vs stock llama.cpp cold/warm; writes results/peer.*", _peer_flags)
def cmd_bench_peer(args):
    from experiments.peer import run_peer
    res = run_peer(model=args.model, budget=args.budget, tokens=args.tokens, rounds=args.rounds,
                   gguf_type=args.type, threads=args.threads, prompt=args.prompt, out=Path(args.out),
                   progress=None if args.json else print)
    emit(args, res, res["markdown"])


def _routing_stats_flags(p):
    p.add_argument("trace", help="a route_trace v1 .csv (its decode tokens), a workbench .parquet trace, or a model "
                                 "(a .gguf, or a model exported to one: its own routing of TinyStories in llama.cpp)")
    p.add_argument("--tokens", type=int, default=128, help="the first tokens counted (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads, for a .gguf")


@command("routing-stats", "a routing's reuse, LRU hits, hot experts and lookahead recall", _routing_stats_flags)
def cmd_routing_stats(args):
    from experiments.routing_stats import text, trace_stats
    if args.tokens < 2:
        raise WorkbenchError(f"--tokens {args.tokens}: at least 2")
    res = trace_stats(args.trace, args.tokens, threads=args.threads)
    emit(args, res, text(res))
