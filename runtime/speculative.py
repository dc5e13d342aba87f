"""Speculative batch verification (LES's DSpark step): a draft proposes tokens, the target verifies them in one
batched forward, which loads the union of the batch's experts once; the longest prefix greedy decoding would have
produced is kept, plus the target's own next token, so the output is exactly plain greedy decoding's.

A draft is anything with `propose(context, n) -> tokens`, `accept(proposed, greedy) -> kept` and `close()`; the
preset's `draft` knob names it:
    lookup      prompt lookup: the most recent earlier occurrence of the context's last n-gram, and the tokens that
                followed it (no model)
    MODEL       a draft model with the target's tokenizer (a registered name, demo-draft; a directory, pack or
                GGUF), all of it in memory, decoding greedily from the same context; its time is the step's draft_s
    mtp         the checkpoint's own multi-token-prediction block (engines.mtp.MTPHead), chained: the target's last
                hidden states and the accepted tokens feed it, and each of its own states the next draft token
    modelled:A  (a run a routing trace drives, or one decoding forced text) the trace's or the text's next tokens,
                each accepted with probability A while every one before it was (modelled acceptance); the batch
                routes as the trace's next rows, or as the model routes the text's next tokens, so the union it reads
                is that routing's. Seeded: arms alternating in one run draw the same acceptances.
"""
from __future__ import annotations

import time

import numpy as np

from engines.mtp import MTPHead
from workbench.errors import WorkbenchError
from workbench.models.mtp import load_mtp
from workbench.registry import model_dir


def longest_prefix(proposed: list[int], greedy) -> int:
    """Draft tokens greedy decoding keeps: the longest prefix of `proposed` that is the target's own choices."""
    n = 0
    while n < len(proposed) and proposed[n] == greedy[n]:
        n += 1
    return n


class PromptLookup:
    name = "lookup"
    accept = staticmethod(longest_prefix)

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, context: list[int], n: int) -> list[int]:
        for g in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-g:]
            for start in range(len(context) - g - 1, -1, -1):
                if context[start:start + g] == tail:
                    return context[start + g:start + g + n]
        return []

    def close(self):
        pass


class DraftModel:
    """A smaller model of the same vocabulary, all-resident, drafting greedily. Its KV cache keeps the context it
    has seen: a step feeds only what is new since (the target's accepted tokens), after rolling back what was not
    accepted."""
    accept = staticmethod(longest_prefix)

    def __init__(self, model: str, target, open_session):
        """open_session: runtime.session's, which opens the draft's own Session (that module imports this one)."""
        self.name = model
        self.session = open_session(model, "resident", None, prompt=None, engine=target.engine.name,
                                    threads=target.engine.threads)
        try:
            same_vocabulary(self.session, target, model_dir(model), model_dir(target.model))
        except WorkbenchError:
            self.session.close()
            raise
        self.engine, self.seen = self.session.engine, []

    def propose(self, context: list[int], n: int) -> list[int]:
        if n <= 0:
            return []
        e, c = self.engine, 0
        while c < min(len(self.seen), len(context)) and self.seen[c] == context[c]:
            c += 1
        c = min(c, len(context) - 1)                   # at least the last token is fed: its logits draft the next
        if c == 0:
            e.reset()
            logits = e.prefill(context)
        else:
            e.truncate(c)
            logits = e.decode(context[c:])
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits[-1])))
            if i < n - 1:
                logits = e.decode(out[-1:])
        self.seen = context + out[:-1]
        self.session.tel.clear()                       # its own layers' events: not the run's, and unbounded
        return out

    def close(self):
        self.session.close()


class MTPDraft:
    """The target's MTP block drafting from the target's own hidden states. After each verification, the block's KV
    cache takes a row per position the target kept (the target's hidden state there and the next token) and forgets
    its chained rows; it then drafts by chaining from its last state."""
    name = "mtp"
    accept = staticmethod(longest_prefix)

    def __init__(self, target):
        e = target.engine
        if not hasattr(e, "hidden_start"):
            raise WorkbenchError(f"--engine {e.name} gives no hidden states to draft from: draft=mtp runs on the "
                                 f"packed, numpy or mlx engine")
        if target.spec.attention == "mla":
            raise WorkbenchError(f"{model_dir(target.model)}: draft=mtp computes an MTP block with grouped-query "
                                 f"attention (the demo's, Qwen3-Next's, Qwen3.5's); a {target.spec.family} block's latent "
                                 f"attention is not written here")
        w = load_mtp(model_dir(target.model), zero_centred=bool(target.spec.layer_types))
        self.engine = e
        self.head = MTPHead(target.spec, w, lambda ids: e.to_numpy(e.embed(ids)),
                            lambda x: e.to_numpy(e.linear(e.from_numpy(x), "lm_head")))

    def propose(self, context: list[int], n: int) -> list[int]:
        if n <= 0:
            return []
        e, head = self.engine, self.head
        start, kept = e.hidden_start, e.pos - e.hidden_start       # the last forward's rows the target kept
        if start == 0:
            head.reset()
        head.truncate(start + 1)
        x, logits = head.forward(e.to_numpy(e.hidden)[:kept], context[start + 1:e.pos + 1], start + 1)
        out = []
        for i in range(n):
            out.append(int(np.argmax(logits[-1])))
            if i < n - 1:
                x, logits = head.forward(x[-1:], out[-1:], e.pos + 1 + i)
        return out

    def close(self):
        pass


def same_vocabulary(draft, target, where, target_where):
    """Refuse a draft whose tokens are not the target's: one line naming the draft's file and the mismatch."""
    a, b = draft.spec.vocab_size, target.spec.vocab_size
    if a != b:
        raise WorkbenchError(f"{where}: the draft model's vocabulary has {a} tokens, the target's ({target_where}) "
                             f"{b}: a draft needs the target's tokenizer")
    ta, tb = draft.tokenizer, target.tokenizer
    if (ta is None) != (tb is None):
        raise WorkbenchError(f"{where}: the draft model has {'no' if ta is None else 'a'} tokenizer and the target "
                             f"({target_where}) {'has' if ta is None else 'has none'}: a draft needs the target's")
    if ta is not None and (va := ta.get_vocab()) != (vb := tb.get_vocab()):
        diff = sum(va.get(k) != i for k, i in vb.items())
        raise WorkbenchError(f"{where}: the draft model's tokenizer is not the target's ({target_where}): {diff} of "
                             f"{len(vb)} tokens differ")


class ModelledAcceptance:
    """Draft acceptance as a chain of coin flips: each draft token accepted with probability `acceptance` while
    every one before it was (the i.i.d. model of Leviathan et al.): a step of n drafts keeps j < n of them with
    probability a^j (1 - a), all n with a^n. Seeded, so two arms draw the same sequence."""

    def __init__(self, acceptance: float, seed: int = 0):
        self.acceptance, self.rng = acceptance, np.random.default_rng(seed)

    def draw(self, n: int) -> int:
        flips = self.rng.random(n) < self.acceptance
        return int(n if flips.all() else np.argmin(flips))


class ReplayedAcceptance:
    """A measured run's accepted drafts, step by step, replayed in order (from the start again where the replay
    runs longer): a prediction of that run takes its acceptance as it was, not drawn anew (experiments.simulate)."""

    def __init__(self, accepted: list[int]):
        if not accepted:
            raise ValueError("a replayed acceptance needs at least one step")
        self.accepted, self.step = list(accepted), 0

    def draw(self, n: int) -> int:
        a = self.accepted[self.step % len(self.accepted)]
        self.step += 1
        return min(n, a)


def modelled_acceptance(source: str) -> float | None:
    """A draft knob's modelled acceptance (modelled:A), None for a real draft; one line where A is not in (0, 1]."""
    if not source.startswith("modelled"):
        return None
    try:
        a = float(source.partition(":")[2])
    except ValueError:
        a = -1.0
    if not 0 < a <= 1:
        raise WorkbenchError(f"draft={source}: write modelled:A with the modelled acceptance A in (0, 1], e.g. "
                             f"modelled:0.5")
    return a


class ModelledDraft:
    """The run's own next tokens as the draft, accepted as ModelledAcceptance draws: no draft model runs. A routing
    trace's next tokens, the verification batch routing as its next rows (experiments.routing_trace.TraceDrive.rows);
    or forced text's, routed by the model. next_tokens(context, n): those tokens."""

    def __init__(self, acceptance: float, next_tokens):
        self.name, self.acceptance = f"modelled:{acceptance:g}", acceptance
        self.model, self.next_tokens = ModelledAcceptance(acceptance), next_tokens

    def propose(self, context: list[int], n: int) -> list[int]:
        return self.next_tokens(context, n)

    def accept(self, proposed: list[int], greedy) -> int:
        return self.model.draw(len(proposed))

    def close(self):
        pass


def draft_model(source: str) -> str | None:
    """The model a draft knob names (a draft model's name or path), or None where it names another kind of draft
    (lookup, mtp, modelled:A)."""
    return None if source in ("lookup", "mtp") or modelled_acceptance(source) is not None else source


def make_draft(source: str, target, open_session):
    """The draft the preset's `draft` knob names, for the target Session; one line where it cannot draft for it."""
    modelled, forced = modelled_acceptance(source), target.text.forced
    if modelled is None and target.drive is not None:
        raise WorkbenchError(f"draft={source}: a routing trace decides what the verification batch routes to, so its "
                             f"acceptance is modelled: choose draft=modelled:A")
    if modelled is not None and target.drive is None and forced is None:
        raise WorkbenchError(f"draft={source}: a modelled acceptance drafts a routing trace's or forced text's tokens: "
                             f"give --routing-trace or --text, or choose draft=lookup, mtp or a draft model")
    if modelled is not None:
        if target.drive is not None:
            return ModelledDraft(modelled, lambda context, n: target.drive.next_ids(target.engine, n))
        fed = len(target.text.prompt)           # forced: the text's tokens after the context's are the draft
        return ModelledDraft(modelled, lambda context, n: list(forced[len(context) - fed:len(context) - fed + n]))
    if source == "mtp":
        return MTPDraft(target)
    return DraftModel(source, target, open_session) if draft_model(source) else PromptLookup()


def speculative_decode(session, draft, first: int, context: list[int], tokens: int, n_draft: int, on_token=None,
                       stop_token: int | None = None, forced: list | None = None) -> list[int]:
    """Continue greedy decoding from `first` (already chosen) until `tokens` tokens; returns them. forced: the
    tokens to produce instead of greedy ones (forced text): a draft token is accepted while it is the next of them."""
    engine, tel = session.engine, session.tel
    out = [first]
    while len(out) < tokens and out[-1] != stop_token:
        t0 = time.perf_counter()
        proposed = draft.propose(context + out, min(n_draft, tokens - len(out)))
        draft_s = time.perf_counter() - t0
        pos = engine.pos
        logits = session.step([out[-1]] + proposed, "decode", draft_s=draft_s)
        greedy = np.argmax(logits, -1) if forced is None else np.asarray(     # past the end: never used
            (list(forced[len(out):len(out) + len(proposed) + 1]) + [-1] * (len(proposed) + 1))[:len(proposed) + 1])
        accepted = draft.accept(proposed, greedy)
        engine.truncate(pos + 1 + accepted)
        new = proposed[:accepted] + [int(greedy[accepted])]
        tel.spec_steps += 1
        tel.spec_proposed += len(proposed)
        tel.spec_accepted += accepted
        tel.tokens[-1].produced = len(new)
        tel.tokens[-1].drafted = len(proposed)
        for t in new[: tokens - len(out)]:
            out.append(t)
            if on_token:
                tel.tokens[-1].text = session.decode(out)
                on_token(session, t, tel.tokens[-1].text)
            if t == stop_token:
                break
    return out
