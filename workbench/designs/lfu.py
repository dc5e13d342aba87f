"""LFU and LFU with aging: evict the expert asked for least often (ties: the least recently used). The baselines
every replayer reports (colibri's policy replay, SpecMD); aging keeps a burst's experts from staying forever."""
from __future__ import annotations

from collections import Counter, OrderedDict

from workbench.designs.base import Policy


class LFU(Policy):
    """Counts every hit since the start, an evicted expert's included (its count is back if it returns). The pool's
    experts sit in buckets by count, each in the order they entered it (their last use): the first evictable expert
    of the lowest bucket goes."""

    def __init__(self, capacity: int, layers: int, **params):
        super().__init__(capacity, layers, **params)
        self.uses: Counter = Counter()
        self.buckets: dict[int, OrderedDict] = {}

    def _out(self, key) -> int:
        n = self.uses[key]
        b = self.buckets[n]
        del b[key]
        if not b:
            del self.buckets[n]
        return n

    def hit(self, key, step: int):
        self._out(key)
        self.uses[key] += 1
        self.buckets.setdefault(self.uses[key], OrderedDict())[key] = None

    def inserted(self, key, step: int):
        self.buckets.setdefault(self.uses[key], OrderedDict())[key] = None

    def removed(self, key):
        self._out(key)

    def demoted(self, key):
        self.buckets[self.uses[key]].move_to_end(key, last=False)

    def victim(self, evictable, step: int):
        for n in sorted(self.buckets):
            for k in self.buckets[n]:
                if k in evictable:
                    return k
        return None


class LFUAging(LFU):
    """LFU whose counts halve every `period` hits (0: the pool's capacity), so old popularity fades."""
    params = {"period": 0}

    def __init__(self, capacity: int, layers: int, **params):
        super().__init__(capacity, layers, **params)
        self.every, self.since = self.period or max(1, capacity), 0

    def hit(self, key, step: int):
        super().hit(key, step)
        self.since += 1
        if self.since >= self.every:
            self.since = 0
            order = sorted(((n, i, k) for n, b in self.buckets.items() for i, k in enumerate(b)))
            self.uses = Counter({k: n // 2 for k, n in self.uses.items() if n > 1})
            self.buckets = {}
            for _, _, k in order:           # each halved bucket keeps its order; merged ones by their old count
                self.buckets.setdefault(self.uses[k], OrderedDict())[k] = None
