"""Least-Stale (SpecMD, Hoang et al., arXiv 2602.03921): evict a stale expert (not used in the current token's pass)
first, the one used longest ago; only when every candidate was used this pass, the one whose layer comes round
again last (the layer just run). Our reading of the rule: the paper's section was not available here, see
docs/designs.md."""
from __future__ import annotations

from workbench.designs.base import Policy


class LeastStale(Policy):
    def __init__(self, capacity: int, layers: int, **params):
        super().__init__(capacity, layers, **params)
        self.last: dict = {}                # key -> token of its last use

    def hit(self, key, step: int):
        self.last[key] = self.token_of(step)

    def inserted(self, key, step: int):
        self.last[key] = self.token_of(step)

    def removed(self, key):
        self.last.pop(key, None)

    def victim(self, evictable, step: int):
        now = self.token_of(step)
        oldest = next(iter(evictable), None)        # the pool is in recency order: its oldest is the stalest
        if oldest is None or self.last.get(oldest, -1) < now:
            return oldest
        return next(evictable.newest(), None)       # all used this pass: the most recent is needed again last
