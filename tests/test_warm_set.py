"""The warm start (smolmaxxing's pools filled from each layer's most-used list) is one function that the Session,
the simulator and the trace replay all use."""
from workbench.cache import ExpertCache, warm_set

USAGE = {0: [5, 9, 1, 9, 0, 3], 2: [0, 0, 7, 1, 8, 2]}


def test_per_layer_pools_take_each_layers_most_used_experts_ties_in_id_order():
    cache = ExpertCache(slots=6, item_bytes=1, layers=[0, 2], scope="per_layer", min_slots_per_layer=2)
    assert warm_set(cache, USAGE) == [(0, 1), (0, 3), (0, 0), (2, 4), (2, 2), (2, 5)]


def test_a_global_pool_is_shared_evenly_between_layers():
    cache = ExpertCache(slots=5, item_bytes=1, layers=[0, 2], scope="global", min_slots_per_layer=2)
    assert warm_set(cache, USAGE) == [(0, 1), (0, 3), (2, 4), (2, 2)]

