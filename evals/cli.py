"""The eval verbs of `python -m workbench`: `eval ppl|teacher|lm|compare|report` and `serve`
(registered in workbench.commands). Progress bars go to stderr.
"""
from __future__ import annotations

from workbench.commands import command, emit, flags, flash, group, running

group("eval", "quality: perplexity, teacher comparison, lm-eval, comparisons, report")


def _record_flags(p):
    p.add_argument("--no-record", action="store_true", help="do not write a run record")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _text_flags(chunks_default):
    def flags(p):
        p.add_argument("--data", default="wikitext2", help="tinystories, wikitext2 or a text file")
        p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (window)")
        p.add_argument("--chunks", type=int, default=chunks_default,
                       help="at most this many chunks (default: %(default)s)")
        p.add_argument("--stride", type=int, default=None, help="sliding windows every STRIDE tokens instead of "
                                                                "llama.cpp's non-overlapping chunks")
    return flags


def _bos_flag(p):
    p.add_argument("--bos", action="store_true", help="BOS at the start of every chunk (llama.cpp add_bos)")


@command("eval ppl", "perplexity (llama.cpp's method or strided)", running, flash, _text_flags(None), _record_flags,
         _bos_flag)
def cmd_ppl(args):
    from evals.common import emulated
    from evals.ppl import run
    r = run(args.model, args.preset, args.budget, args.data, args.ctx, args.chunks, args.stride, args.bos,
            progress=not args.quiet, record=not args.no_record, engine=args.engine, direct=not args.page_cache,
            device=args.device)
    emit(args, r, f"{emulated(r)}{r['preset']} {r['data']}: PPL = {r['ppl']:.4f} +/- {r['ppl_stderr']:.5f} "
                  f"({r['tokens']} tokens, {r['chunks']} chunks of {r['ctx']}, {r['method']})")


def _teacher_flags(p):
    p.add_argument("--teacher-budget", default=None, help="the teacher's expert cache (default: every expert); a "
                                                         "teacher bigger than memory streams at a smaller one, with "
                                                         "the same logits (it routes exactly)")
    p.add_argument("--teacher-model", default=None, help="the teacher's checkpoint (default: --model), e.g. the bf16 "
                                                        "directory a GGUF --model was made from")


def _decode_flag(p):
    p.add_argument("--decode", action="store_true", help="the student decodes each window a token a step, as "
                   "decoding does (a lever that acts while decoding, drop_misses, acts only so)")


@command("eval teacher", "KL, top-1, ppl and routing agreement against the teacher preset", running, flash,
         _text_flags(4), _record_flags, _teacher_flags, _decode_flag, flags("set"))
def cmd_teacher(args):
    from evals.common import emulated
    from evals.teacher import run
    from experiments.cli import knobs_of
    from workbench.presets import get_preset
    preset = get_preset(args.preset).with_(**knobs_of(args.set)) if args.set else args.preset
    r = run(args.model, preset, args.budget, args.data, args.ctx, args.chunks, args.stride,
            progress=not args.quiet, record=not args.no_record, engine=args.engine, direct=not args.page_cache,
            device=args.device, teacher_budget=args.teacher_budget, teacher_model=args.teacher_model,
            decode=args.decode)
    ra = " ".join(f"{a:.3f}" for a in r["routing_agreement"])
    emit(args, r, f"{emulated(r)}{r['preset']} vs teacher on {r['data']} ({r['tokens']} tokens):\n"
                  f"  KL {r['kl']:.6f} +/- {r['kl_stderr']:.6f}  top-1 {r['top1']:.4f}\n"
                  f"  ppl {r['ppl']:.4f} (teacher {r['ppl_teacher']:.4f}, ratio {r['ppl_ratio']:.4f})\n"
                  f"  routing agreement per layer: {ra}")


def _lm_flags(p):
    p.add_argument("--tasks", default="lambada_openai,arc_easy,piqa",
                   help="comma list among tinystories_ending, tinystories_cloze, lambada_openai, hellaswag, arc_easy, "
                        "arc_challenge, piqa, winogrande, boolq (the benchmarks run as their *_local tasks)")
    p.add_argument("--limit", type=float, default=None, help="first N items per task (or a fraction < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None, help="context tokens (default: the model's)")


@command("eval lm", "lm-eval on local benchmark copies (evals/tasks)", running, flash, _record_flags, _lm_flags)
def cmd_lm(args):
    from evals.common import emulated
    from evals.lm import run
    limit = args.limit
    if limit is not None and float(limit).is_integer():
        limit = int(limit)
    r = run(args.model, args.preset, args.budget, args.tasks, limit, args.num_fewshot, record=not args.no_record,
            engine=args.engine, direct=not args.page_cache, progress=not args.quiet, max_length=args.max_length,
            device=args.device)
    lines = [emulated(r).rstrip(": ")] if r.get("emulated") else []
    for task, m in r["results"].items():
        vals = "  ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float) and "stderr" not in k)
        lines.append(f"{task:24s} {vals}  (n={m.get('samples')})")
    emit(args, r, "\n".join(lines))


def _compare_flags(p):
    flags("model", model={"default": None, "help": "only this model"})(p)


@command("eval compare", "eval run records side by side against the teacher", _compare_flags)
def cmd_compare(args):
    from evals.compare import eval_runs, render, table
    t = table(eval_runs(model=args.model))
    emit(args, t, render(t))


def _report_flags(p):
    from evals.common import PRESET_ORDER
    flags("model", "budget", "engine", "page_cache",
          budget={"help": "for every preset but the teacher (default: each preset's own)"})(p)
    p.add_argument("--out", default="results/quality.md")
    p.add_argument("--presets", default=",".join(PRESET_ORDER))
    p.add_argument("--data", default="tinystories", help="held-out text for ppl/KL (tinystories, wikitext2, a file)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--tasks", default="tinystories_ending,tinystories_cloze")
    p.add_argument("--limit", type=int, default=None, help="first N items per lm-eval task (default: all)")


@command("eval report", "teacher vs presets: ppl, KL, top-1, lm-eval accuracy; writes results/quality.md and .json",
         _record_flags, _report_flags)
def cmd_report(args):
    import sys

    from evals.report import build, write
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    rep = build(args.model, presets, args.budget, args.data, args.ctx, args.chunks, args.tasks.split(","), args.limit,
                record=not args.no_record, progress=not args.quiet, engine=args.engine, direct=not args.page_cache,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    rep["command"] = _report_command(args)
    md, js = write(rep, args.out)
    emit(args, {"markdown": str(md), "json": str(js), **rep}, f"wrote {md} and {js}\n\n" + md.read_text())


def _report_command(args) -> str:
    """The command line that makes this report: --model, --out and the options that differ from their defaults."""
    import argparse
    import shlex
    p = argparse.ArgumentParser()
    _record_flags(p)
    _report_flags(p)
    default = vars(p.parse_args([]))
    given = {k: v for k, v in vars(args).items()
             if k in default and k != "quiet" and (v != default[k] or k in ("model", "out"))}
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}") for k, v in given.items()]
    return " ".join(["python -m workbench eval report", *flags])


def _serve_flags(p):
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY' (default: "
                                                   "$WORKBENCH_API_KEY, which keeps the key out of the process list)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model's name)")
    p.add_argument("--quiet", action="store_true", help="no request log")


@command("serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)", running, _serve_flags)
def cmd_serve(args):
    from evals.server import serve
    serve(args.model, args.preset, args.budget, args.host, args.port, args.served_model_name, args.engine,
          not args.page_cache, quiet=args.quiet, api_key=args.api_key)

