"""Mine: the next layer's most-used experts read ahead, second-chance eviction (on les's storage, execution)."""
import numpy as np

from workbench.designs import Design, Policy, Predictor


class Popular(Predictor):
    params = {"width": 1.0}                     # experts named, in multiples of top-k (--set width=2)
    def __init__(self, setup, **params):
        super().__init__(setup, **params)
        self.next = dict(zip(self.spec.moe_layers, self.spec.moe_layers[1:]))
        self.counts = {L: np.zeros(self.spec.num_experts) for L in self.spec.moe_layers}

    def predict(self, layer, ctx):              # after `layer` routes: {later layer: experts, best first}
        np.add.at(self.counts[layer], np.asarray(ctx["routed"]).ravel(), 1)
        if ctx["phase"] != "decode" or layer not in self.next:
            return {}
        top = np.argsort(-self.counts[self.next[layer]], kind="stable")
        return {self.next[layer]: top[:int(self.width * self.spec.top_k)].tolist()}


class SecondChance(Policy):                     # an expert asked for again is passed over once
    def __init__(self, capacity, layers, **params):
        super().__init__(capacity, layers, **params)
        self.asked = set()

    def hit(self, key, step):
        self.asked.add(key)

    def victim(self, evictable, step):          # evictable: least recently used first
        for key in evictable:
            if key not in self.asked:
                return key
            self.asked.discard(key)
        return next(iter(evictable), None)


class Mine(Design):
    base, predictor, policy = "les_no_prefetch", Popular, SecondChance
