"""A Session: one model, one preset, one budget, wired up and ready to generate.

    with open_session("demo", "les", budget="0.25") as s:
        out = s.generate("Once upon a time", tokens=60)
        print(out["text"], s.summary()["tok_s"])
"""
from __future__ import annotations

import io
import json
import time

import numpy as np

from engines import engine_class
from engines.base import Hooks
from workbench.arena import SlotArena, slot_bytes
from workbench.atomic import atomic_write
from runtime.capture import RoutingCapture
from workbench.io import drop_page_cache, slot_readers
from workbench.devices import open_reader
from workbench.host import peak_rss_bytes
from workbench.designs import Setup, make_predictor
from workbench.presets import Predictor, Preset, Router, get_preset
from workbench.registry import cache_dir, tokenizer_for
from runtime.plan import Plan, plan
from workbench.routing import route
from workbench.shapes import random_label
from workbench.streamer import ExpertStreamer
from workbench.errors import WorkbenchError
from runtime.speculative import make_draft, modelled_acceptance, speculative_decode
from runtime.text import Text, run_text
from workbench.store.pack import Pack
from workbench.summary import Drafts, Memory, Reads, RunSummary, TimeSplit
from workbench.telemetry import Telemetry, TokenRecord


def trace_cannot_drive(p: Preset) -> str | None:
    """Why a routing trace cannot drive preset p (None when it can): a trace replays exact routing, a token at a
    time, or a verification batch over its next rows with a modelled acceptance (runtime.speculative)."""
    if p.routing.router is not Router.EXACT:
        return "changes routing; a trace replays exact routing"
    if p.execution.speculative and modelled_acceptance(p.execution.draft) is None:
        return (f"drafts with {p.execution.draft}, whose tokens a trace does not route: choose draft=modelled:A (a "
                f"modelled acceptance)")
    return None


class Session:
    def __init__(self, plan: Plan, *, direct: bool = True, workers: int | None = None, usage: dict | None = None,
                 trace: dict | None = None, weights: dict | None = None, deltas: dict | None = None,
                 device: str | None = None, drive=None, threads: int | None = None, text: Text | None = None):
        """The parts of a planned run (runtime.plan), wired together; open_session is the way in.
        usage: expert use per layer (`usage`) for a design that warm-starts or draws from the marginals.
        weights: replacements for some of the pack's non-expert weights (a merged adapter); deltas: projection
        deltas added to the preset's (an unmerged adapter). Both for experiments on adapters (Edge0's ladder).
        device: a device profile (data/devices) whose flash the reads emulate. drive: routing and predictions
        replayed from outside, drive(spec, predictor text, recall=lookahead_recall) -> route, predictor(), usage,
        source (a routing trace: experiments.routing_trace.TraceDrive). text: what the run decodes (runtime.text:
        free, or forced text: open_session chooses it; generate_text decodes it)."""
        self.plan, self.preset, self.model, self.pack = plan, plan.preset, plan.model, plan.pack
        self.text = text or Text("free")
        p = self.preset
        if p.prefetch.predictor is Predictor.ORACLE and trace is None and drive is None:
            raise WorkbenchError(f"preset {p.name}: the oracle replays the true routing of the tokens it will decode; "
                                 f"give it that trace (runtime.session.oracle_trace) or a routing trace to drive it")
        s = self.spec = self.pack.spec
        self.tokenizer = tokenizer_for(self.pack)
        cls = engine_class(plan.engine)
        self.cache = plan.cache.cache()
        self.reader = open_reader(self.pack.data_paths, device, direct=direct, # device: emulated flash
                                  workers=workers or (slot_readers() if cls.slot_arena and not device else None))
        self.device = getattr(self.reader, "profile", None)
        src = self.pack.header.get("source", {}).get("path")
        self.random_weights = random_label(src) if src else None
        self.tel = Telemetry(s.num_layers)
        if not cls.takes_hooks and (drive or deltas or p.prefetch.predictor or p.routing.router is not Router.EXACT):
            cls.refuse_hooks()                  # before building hooks from weights such an engine is not given
        w = {**cls.needed_weights(self.pack), **(weights or {})}
        self.drive = None
        self.low_tier = None                    # a router's resident low-precision copies (workbench.low_tier)
        if drive:
            if why := trace_cannot_drive(p):
                raise WorkbenchError(f"--routing-trace: preset {p.name} {why}")
            self.drive, self.lora = drive(s, str(p.prefetch) or None, recall=p.prefetch.recall,
                                          params=dict(p.params)), None
            usage = self.drive.usage
            predictor, router_hook, hook_deltas = self.drive.predictor(), self.drive.route, {}
        else:
            pack = self.pack
            setup = Setup(s, w, usage=usage, sample=lambda: heldout_routing(pack), trace=trace, pack=pack,
                          exact=lambda L, logits, bias=None: route(s, logits, w.get(f"layers.{L}.router_bias"), bias=bias))
            predictor = make_predictor(p.prefetch, setup, dict(p.params))
            router_hook, hook_deltas = self._routing(predictor, w, setup)
        # what the run starts with, decided once, before the arena takes the pools' sizes (a hot store re-divides them)
        self.start = None if plan.all_resident else plan.cache.start(self.cache, usage)
        self.arena = SlotArena(self.pack, self.cache) if cls.slot_arena else None
        self.streamer = ExpertStreamer(self.pack, self.cache, self.reader, self.tel, execution=p.execution.order.value,
                                       raw=cls.raw_experts, arena=self.arena)
        hooks = Hooks(predictor, router_hook, {**hook_deltas, **(deltas or {})}, self.low_tier)
        self.engine = cls(self.pack, self.streamer, self.tel, hooks, weights=w, **({"threads": threads} if threads else {}))
        self.draft = make_draft(p.execution.draft, self, open_session) if p.execution.speculative else None
        self.reader_bytes0 = 0
        if plan.all_resident:
            self.streamer.load_resident([(L, e) for L in s.moe_layers for e in range(s.num_experts)])
        elif self.start:
            self.warm_start()
        self.reader_bytes0 = self.reader.bytes_read

    # what records and callers read of the plan
    pack_path = property(lambda self: self.pack.path)
    slot_bytes = property(lambda self: self.plan.slot_bytes)
    budget_text = property(lambda self: self.plan.budget)
    budget_bytes = property(lambda self: self.plan.budget_bytes)
    all_expert_bytes = property(lambda self: self.plan.slot_bytes * self.plan.experts)

    # ------------------------------------------------------------ setup helpers

    def _routing(self, predictor, w, setup: Setup) -> tuple:
        """The preset's routing: (router hook or None, projection deltas)."""
        r = self.preset.routing
        self.lora = None                        # Edge0's recovery LoRA, when the routing serves it
        if r.router is Router.EXACT:
            return None, {}
        if r.router is not Router.PREROUTER:    # a Router of workbench.designs: smol_bias's, or a design's own
            from workbench.designs import router_class
            params = {**({"beta": r.beta} if r.router is Router.CACHE_BIAS else {}), **dict(self.preset.params)}
            cls = router_class(str(r))
            router = cls(setup, self.cache, **{k: v for k, v in params.items() if k in cls.params})
            if router.low:
                self.low_tier = self._low_tier(router)
            return router.route, {}
        from workbench.edge0.serve import prerouter_routing     # Edge0: the head's prediction is the routing
        hook, self.lora = prerouter_routing(predictor, r.lora, self.spec, w, self.pack)
        return hook, self.lora.deltas() if self.lora else {}

    def _low_tier(self, router):
        """The router's low tier: its experts' copies at its precision, from the checkpoint's pack at it (written
        once), read into memory now; refused in one line where the machine cannot hold it beside the run."""
        from workbench.low_tier import LowTier, fits, low_pack
        keys = router.low_experts()
        if not keys:
            return None
        pack = low_pack(self.model, self.preset.storage, router.low, self.plan.engine)
        fits(self.plan.memory["needed_bytes"] + len(keys) * slot_bytes(pack), f"{pack.path} ({router.low} copies of "
             f"{len(keys)} experts)")
        return LowTier(pack, keys)

    def warm_start(self):
        """What the design starts with (self.start: workbench.cache.start_set): its pinned hot store, and each
        layer's pool (or the global cache, evenly) filled with its most-used experts."""
        pinned, warm = self.start
        self.streamer.load_resident(pinned, pin=True)
        self.streamer.load_resident(warm, pin=False)

    def cold_start(self) -> str:
        """Make the next run start cold: no expert in memory but what the design itself keeps (every expert when
        all-resident, the warm set of a design that warm-starts), its predictor as built, and the model's file out of
        the page cache. Returns how the page cache was dropped."""
        self.streamer.empty()
        if (reset := getattr(self.engine.predictor, "reset", None)) is not None:
            reset()                             # what it learned in the warm-up is not the measured run's
        if self.start:
            self.warm_start()
        self.reader_bytes0 = self.reader.bytes_read
        return [drop_page_cache(p) for p in self.pack.data_paths][0]

    # ------------------------------------------------------------ running

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise WorkbenchError(f"{self.pack_path}: the model has no tokenizer; pass token ids")
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids))) if self.tokenizer else " ".join(map(str, ids))

    def step(self, ids, phase: str, draft_s: float = 0.0) -> np.ndarray:
        """One prefill or decode of `ids`; appends a TokenRecord whose time split adds up to its wall time.
        draft_s: the time the draft took proposing ids[1:] (a speculative step's), counted in its wall time."""
        e, tel = self.engine, self.tel
        n_ev, dense0, bytes0 = len(tel.events), e.dense_compute_s, self.reader.bytes_read
        t0 = time.perf_counter()
        logits = e.prefill(ids) if phase == "prefill" else e.decode(ids)
        wall = time.perf_counter() - t0 + draft_s
        evs = tel.events[n_ev:]
        compute = (e.dense_compute_s - dense0) + sum(v.compute_s for v in evs)
        tel.add_token(TokenRecord.of(evs, wall, compute, draft_s, token=e.token_index, phase=phase, n_tokens=len(ids),
                                     bytes_read=self.reader.bytes_read - bytes0, cache_bytes=self.cache.bytes))
        self.logits = logits        # the last step's: what an on_token callback's token was chosen from
        return logits

    def generate_text(self, prompt, tokens: int, on_token=None) -> dict:
        """Decode the run's text (self.text): forced, its prompt and tokens; free, greedy after `prompt`."""
        t = self.text
        if t.forced is None:
            return self.generate(prompt, tokens, on_token=on_token)
        return self.generate(t.prompt, tokens, on_token=on_token, forced=t.forced)

    def generate(self, prompt, tokens: int = 32, stop_at_eos: bool = False, on_token=None,
                 forced: list | None = None) -> dict:
        """Greedy decoding. prompt: text or token ids. on_token(session, token_id, text_so_far) after each token.
        forced: the tokens fed instead of the argmax, one a step (forced text: runtime.text); the logits and the
        routing are the model's at every step all the same, and `agreement` says how often its argmax was the
        token fed."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise WorkbenchError("empty prompt")
        if forced is not None and len(forced) < tokens:
            raise WorkbenchError(f"forced text: {len(forced)} tokens to feed, {tokens} asked")
        self.engine.reset()
        logits = self.step(ids, "prefill")
        stop = self.spec.eos_token_id if stop_at_eos else None
        if self.preset.execution.speculative and tokens > 1:
            first = int(np.argmax(logits[-1])) if forced is None else int(forced[0])
            if on_token:
                on_token(self, first, self.decode([first]))
            out = speculative_decode(self, self.draft, first, ids, tokens, self.preset.execution.speculative, on_token, stop,
                                     forced=forced)
            return {"text": self.decode(out), "tokens": out, "prompt_tokens": len(ids),
                    "tok_s": self.tel.summary()["tok_s"], "forced": forced is not None}
        out, agree = [], 0
        for i in range(tokens):
            nxt = int(np.argmax(logits[-1]))
            if forced is not None:
                agree += nxt == forced[i]
                nxt = int(forced[i])
            out.append(nxt)
            if on_token:
                self.tel.tokens[-1].text = self.decode(out)
                on_token(self, nxt, self.tel.tokens[-1].text)
            if (stop_at_eos and nxt == self.spec.eos_token_id) or i == tokens - 1:
                break
            logits = self.step([nxt], "decode")
        text = self.decode(out)
        return {"text": text, "tokens": out, "prompt_tokens": len(ids), "tok_s": self.tel.summary()["tok_s"],
                "forced": forced is not None, **({"agreement": agree / max(1, len(out))} if forced is not None else {})}

    def reset_telemetry(self):
        self.tel.clear()

    def run_summary(self, tel: Telemetry | None = None, measured: dict | None = None) -> RunSummary:
        """The run's typed record (workbench.summary), from its telemetry or from `tel` (a copy taken under the
        telemetry's lock); measured: that telemetry's summary() where the caller has it already."""
        tel = tel or self.tel
        m = measured or tel.summary()
        return RunSummary("measured", m["decode_steps"], m["produced"], Reads.of(tel, m["decode_bytes_read"]),
                          Memory(self.budget_bytes, self.cache.slots, min(self.cache.capacity.values()),
                                 self.pack.mean_expert_bytes, self.slot_bytes),
                          TimeSplit(m["decode_s"], m["flash_wait_s"], m["compute_s"], m["router_s"], m["dequant_s"],
                                    m["other_s"], m["draft_s"]),
                          Drafts(self.draft.name, tel.spec_steps, tel.spec_proposed, tel.spec_accepted,
                                 tel.union_growth(), getattr(self.draft, "acceptance", None))
                          if self.draft and tel.spec_steps else None)

    def summary(self, tel: Telemetry | None = None) -> dict:
        """The run record's numbers: run_summary's, what the clock measured beside them, and the run's labels."""
        tel = tel or self.tel
        m = tel.summary()
        return {**m, **self.run_summary(tel, m).record(), "cache_bytes": self.cache.bytes,
                "cache_peak_bytes": self.cache.peak_bytes, "peak_rss_bytes": peak_rss_bytes(),
                "reader_mode": self.reader.mode, "reader_workers": self.reader.workers,
                "read_retries": self.reader.retries, "threads": self.engine.threads,
                "low_tier_bytes": self.low_tier.nbytes if self.low_tier else 0, **self.labels()}

    def config(self) -> dict:
        return {"model": self.model, "pack": str(self.pack_path), "pack_id": self.pack.content_id(),
                "engine": self.engine.name, "preset": self.preset.to_dict(), "budget": self.budget_text,
                "budget_bytes": self.budget_bytes, "reader_mode": self.reader.mode, "spec": self.spec.to_dict(),
                **self.labels()}

    def labels(self) -> dict:
        """What goes wherever a number goes: emulated flash (the device profile), random weights (make-model),
        routing replayed from a trace, and whether the preset's routing changes the model's output (a lossy lever,
        smol's bias, Edge0's prerouter: its quality is the teacher's to judge)."""
        return {"device": self.device.describe() if self.device else None, "emulated": self.device is not None,
                "changes_output": not self.preset.exact,
                "random_weights": self.random_weights, "routing_trace": self.drive.source if self.drive else None,
                "text": self.text.label}

    def close(self):
        """Release what the session holds outside itself: the reader's threads and files and the slot arena's memory.
        Its record (telemetry, summary, the cache's bookkeeping) stays readable; nothing in it refers back to the
        session, so the rest goes when the session does, without waiting for a full garbage collection."""
        self.reader.close()
        if self.draft is not None:
            self.draft.close()
        if self.arena is not None:
            self.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def open_session(model: str = "demo", preset: str | Preset = "on_demand", budget=None, *,
                 prompt="Once upon a time", tokens: int = 64, drive=None, engine: str | None = None,
                 progress: bool = False, text: str | None = None, direct: bool = True, workers: int | None = None,
                 device: str | None = None, threads: int | None = None, weights: dict | None = None,
                 deltas: dict | None = None, trace: dict | None = None, **knobs) -> Session:
    """The way to open a Session: every verb, bench, the evaluations, sweep cells and dashboard workers. Its plan
    (runtime.plan) first, then what the design needs ahead: the usage profile it warms from, the oracle's trace
    captured from what it will decode (`tokens` greedy tokens after `prompt`), unless `drive` routes and predicts
    (a routing trace: experiments.routing_trace.drive). prompt None: no decoding known ahead (an evaluation's
    prefills, a server's requests): the oracle has no future to replay and names nothing.
    text: what the run decodes (runtime.text.run_text: None, forced text on a made checkpoint and free otherwise;
    "free"; a corpus or file): the session's `text`, which generate_text decodes and the oracle's trace follows.
    direct ... trace: the Session's. knobs: preset knobs by their flat names, which Preset.with_ checks."""
    pl = plan(model, preset, budget, engine, progress, **knobs)
    p = pl.preset
    run = None
    if prompt is not None:
        src = pl.pack.header.get("source", {}).get("path")
        run = run_text(text, random_label(src) if src else None, tokenizer_for(pl.pack), prompt, tokens, pl.pack.path)
    if p.prefetch.predictor is Predictor.ORACLE and drive is None and trace is None:
        trace = {} if prompt is None else oracle_trace(model, p, prompt, tokens, budget, run)
    use = usage(pl.pack) if drive is None and (p.cache.warm or p.cache.hot or p.prefetch.predictor is
                                               Predictor.SHUFFLED) else None
    return Session(pl, direct=direct, workers=workers, usage=use, trace=trace, weights=weights, deltas=deltas,
                   device=device, drive=drive, threads=threads, text=run)


def usage(pack: Pack) -> dict:
    """Expert use per layer on held-out text (TinyStories validation), cached per pack."""
    path = cache_dir() / "profiles" / f"{pack.content_id()}.json"
    if path.exists():
        return {int(k): v for k, v in json.loads(path.read_text()).items()}
    counts = {L: np.bincount(idx.reshape(-1), minlength=pack.spec.num_experts).tolist()
              for L, idx in heldout_routing(pack).items()}       # the one prefill of the held-out text
    atomic_write(path, json.dumps(counts))
    return counts


def heldout_routing(pack: Pack) -> dict:
    """{layer: (T, k) experts routed} on held-out text (TinyStories validation, as `usage` counts), cached per pack:
    the statistics a predictor learns before a run (workbench.designs.Setup.sample)."""
    path = cache_dir() / "profiles" / f"{pack.content_id()}.routing.npz"
    if path.exists():
        with np.load(path) as z:
            return {int(k): z[k] for k in z.files}
    from workbench.textdata import heldout_ids
    [got] = prefills(pack, [heldout_ids(tokenizer_for(pack), "tinystories", min(512, pack.spec.max_position_embeddings))])
    idx = {L: np.asarray(a).reshape(-1, pack.spec.top_k) for L, a in got["idx"].items()}
    buf = io.BytesIO()
    np.savez(buf, **{str(L): a for L, a in idx.items()})
    atomic_write(path, buf.getvalue())
    return idx


def oracle_trace(model: str, preset: str | Preset, prompt, tokens: int, budget=None,
                 text: Text | None = None) -> dict | None:
    """The oracle's trace: the true routing {(token index, layer): experts} of the run's text (`text`: greedy
    decoding of `tokens` tokens after `prompt` unless forced) on this preset's pack (exact routing, at the run's
    budget: the routing does not depend on it, and a model bigger than memory cannot hold every expert); None for a
    preset that is not the oracle."""
    p = preset if isinstance(preset, Preset) else get_preset(preset)
    if p.prefetch.predictor is not Predictor.ORACLE:
        return None
    with Session(plan(model, p.with_(predictor=None, routing="exact"), budget), text=text) as s, \
            RoutingCapture(s) as cap:
        s.generate_text(prompt, tokens)
        records = cap.records
    return {(r["token"], r["layer"]): sorted(set(r["idx"].reshape(-1).tolist())) for r in records if r["phase"] == "decode"}


def prefills(pack: Pack, windows, keep: tuple[str, ...] = ()):
    """Each window prefilled from position 0 with exact routing, yielding its RoutingCapture records ({layer:
    (T, ...)} of `keep` and "idx"). The experts stream through one layer's worth of slots (a prefill reads each
    layer's routed experts once whatever the cache holds): a model bigger than memory is captured too, in little
    memory."""
    budget = f"{min(1.0, 1 / len(pack.spec.moe_layers)):.6f}"
    with Session(plan(str(pack.path), "on_demand", budget)) as s, RoutingCapture(s, keep) as cap:
        for ids in windows:
            s.engine.reset()
            s.step(list(map(int, ids)), "prefill")
            yield cap.take_all(("idx", *keep))
