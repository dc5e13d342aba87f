"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023): a small FIFO takes new
experts, a main FIFO keeps those asked for again while in the small one, and a ghost queue (keys only) sends an
expert evicted from the small queue straight to the main one when it comes back."""
from __future__ import annotations

from collections import OrderedDict

from workbench.designs.base import Policy


class S3FIFO(Policy):
    params = {"small": 0.1, "promote": 1}      # the small queue's share of the pool; hits that move it to main

    def __init__(self, capacity: int, layers: int, **params):
        super().__init__(capacity, layers, **params)
        self.small_cap = max(1, int(capacity * self.small))
        self.S: OrderedDict = OrderedDict()     # oldest first
        self.M: OrderedDict = OrderedDict()
        self.G: OrderedDict = OrderedDict()
        self.freq: dict = {}

    def hit(self, key, step: int):
        self.freq[key] = min(3, self.freq.get(key, 0) + 1)

    def inserted(self, key, step: int):
        if self.G.pop(key, False) is None:      # seen recently: to main
            self.M[key] = None
        else:
            self.S[key] = None
        self.freq[key] = 0

    def removed(self, key):
        self.freq.pop(key, None)
        if self.S.pop(key, False) is None:
            self.G[key] = None
            while len(self.G) > self.capacity:
                self.G.popitem(last=False)
        else:
            self.M.pop(key, None)

    def demoted(self, key):
        self.freq[key] = 0

    def victim(self, evictable, step: int):
        # the paper's loop over the queues' tails, passing over experts that may not go now
        for _ in range(4 * (len(self.S) + len(self.M)) + 1):
            k = None
            if self.S and (len(self.S) >= self.small_cap or not self._any(self.M, evictable)):
                k = next((k for k in self.S if k in evictable), None)
                if k is not None and self.freq.get(k, 0) >= self.promote:
                    del self.S[k]
                    self.M[k] = None
                    self.freq[k] = 0
                    continue
                if k is not None:
                    return k
            k = next((k for k in self.M if k in evictable), None)
            if k is None:
                return next((k for k in self.S if k in evictable), None)
            if self.freq.get(k, 0) > 0:
                self.freq[k] -= 1
                self.M.move_to_end(k)
                continue
            return k
        return next(iter(evictable), None)

    @staticmethod
    def _any(q, evictable) -> bool:
        return any(k in evictable for k in q)
