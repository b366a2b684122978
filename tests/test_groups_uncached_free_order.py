"""Beside an uncached window, the cached groups' blocks join the free queue in the order
they would alone (groups/free_order.py ``_cached_order``: the request's prefix and cuts
carried to the cached groups' view): a block of the cached window that no hit can read
goes ahead of full attention's. Each freed block is named by its (group, table index);
the same request in a manager without the uncached window gives the order to match."""

import pytest

from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BS = 4


def _order(specs, names, n):
    m = HybridKVCacheManager([s() for s in specs], 80, BS)
    m.add_request("a", list(range(n)))
    where = {b: (names[g], j) for g, t in enumerate(m.get_block_ids("a"))
             for j, b in enumerate(t) if b != m.null_block_id}
    m.free("a")
    m.check_invariants()
    return [where[b] for b in m.free_block_order() if b in where and where[b][0] != "uncached"]


@pytest.mark.parametrize("n", range(5, 40, 3))
@pytest.mark.parametrize("window", [6, 8])
def test_the_cached_groups_blocks_go_in_their_own_order_beside_an_uncached_window(n, window):
    alone = _order([full_attention, lambda: sliding_window(window)], ["full", "window"], n)
    beside = _order([lambda: sliding_window(3, cached=False), full_attention, lambda: sliding_window(window)],
                    ["uncached", "full", "window"], n)
    assert beside == alone
