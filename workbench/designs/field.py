"""The field's designs as the leaderboard runs them: each a bundle of parts over a base preset (the parts are their
own files). A cache policy alone replaces on_demand's LRU, so it is compared with on_demand at the same storage; a
predictor alone runs over les_no_prefetch, as les's lookahead does."""
from __future__ import annotations

from workbench.designs.base import Design


class LFU(Design):
    """on_demand with LFU eviction (ties: least recently used)"""
    base, policy = "on_demand", "lfu"


class LFUAging(Design):
    """on_demand with LFU eviction whose counts halve every pool's worth of hits"""
    base, policy = "on_demand", "lfu_aging"


class S3FIFO(Design):
    """on_demand with S3-FIFO eviction (Yang et al., SOSP 2023)"""
    base, policy = "on_demand", "s3fifo"


class LeastStale(Design):
    """on_demand with Least-Stale eviction (SpecMD, arXiv 2602.03921; our reading of the rule)"""
    base, policy = "on_demand", "least_stale"


class HotStore(Design):
    """colibri's hot store: half the budget pinned to the most-used experts (held-out usage), per-layer LRU beside"""
    base, scope, hot = "on_demand", "per_layer", 0.5


class CoActivation(Design):
    """next layer's experts from this layer's by co-activation counts (mbolt's profiles), over les_no_prefetch"""
    base, predictor = "les_no_prefetch", "coactivation"


class LookaheadS3FIFO(Design):
    """les with S3-FIFO eviction in place of LRU"""
    base, policy = "les", "s3fifo"
