"""Speculative batch verification (LES's DSpark step) with a prompt-lookup draft.

The draft needs no model: it finds the most recent earlier occurrence of the context's last
n-gram and proposes the tokens that followed it. The target verifies the whole draft in one
batched forward, which loads the union of the batch's experts once; the longest prefix that
greedy decoding would have produced is kept, plus the target's own next token, so the output
is exactly plain greedy decoding's.
"""
from __future__ import annotations

import numpy as np


def prompt_lookup_draft(context: list[int], n: int, max_ngram: int = 3) -> list[int]:
    for g in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-g:]
        for start in range(len(context) - g - 1, -1, -1):
            if context[start:start + g] == tail:
                return context[start + g:start + g + n]
    return []


def speculative_decode(session, first: int, context: list[int], tokens: int, n_draft: int, on_token=None,
                       stop_token: int | None = None, forced: list | None = None) -> list[int]:
    """Continue greedy decoding from `first` (already chosen) until `tokens` tokens; returns them. forced: the
    tokens to produce instead of greedy ones (forced text): a draft token is accepted while it is the next of them."""
    engine, tel = session.engine, session.tel
    out = [first]
    while len(out) < tokens and out[-1] != stop_token:
        draft = prompt_lookup_draft(context + out, min(n_draft, tokens - len(out)))
        pos = engine.pos
        logits = session.step([out[-1]] + draft, "decode")
        greedy = np.argmax(logits, -1) if forced is None else np.asarray(     # past the end: never used
            (list(forced[len(out):len(out) + len(draft) + 1]) + [-1] * (len(draft) + 1))[:len(draft) + 1])
        accepted = 0
        while accepted < len(draft) and draft[accepted] == greedy[accepted]:
            accepted += 1
        engine.truncate(pos + 1 + accepted)
        new = draft[:accepted] + [int(greedy[accepted])]
        tel.spec_steps += 1
        tel.spec_proposed += len(draft)
        tel.spec_accepted += accepted
        tel.tokens[-1].produced = len(new)
        for t in new[: tokens - len(out)]:
            out.append(t)
            if on_token:
                tel.tokens[-1].text = session.decode(out)
                on_token(session, t, tel.tokens[-1].text)
            if t == stop_token:
                break
    return out
