"""``BlockPool``'s empty tier grows down in one list of ``num_blocks`` entries
(``_empty[_lo:]``, handed out from ``_lo`` up): ``take``, ``take_one`` and ``take_split``
move ``_lo`` and slice, never shrink or reverse the list (``del`` and ``reverse`` are C
paths of their own, cold after the forward pass: benchmarks/results/events-r23.md); the
releases write below ``_lo``. The order blocks are handed out in is the stack's as
before: the pool's free-order tests (tests/test_pool_free_order.py, the vLLM free-order
tests) state it; here, that it holds while the list stays one of ``num_blocks``."""

from __future__ import annotations

from prefixkv import KVCacheManager


def _tier(m: KVCacheManager) -> list[int]:
    pool = m._pool
    return [b.block_id for b in pool._empty[pool._lo:]]


def test_the_empty_tier_is_one_list_of_num_blocks_that_take_and_free_never_resize() -> None:
    m = KVCacheManager(12, 4, seed=0)
    pool = m._pool
    empty = pool._empty
    assert len(empty) == 12 and _tier(m) == list(range(12))
    m.add_request("a", list(range(1, 11)))  # 3 blocks: 0 1 2
    assert pool._empty is empty and len(empty) == 12 and _tier(m) == list(range(3, 12))
    m.add_request("b", [7] * 3)  # 1 block: 3 (``take_one``'s case or ``take(1)``)
    assert _tier(m) == list(range(4, 12))
    m.free("b")  # its partial block goes empty: the first handed out again
    assert _tier(m) == [3, *range(4, 12)]
    m.free("a")  # 2 (partial) empty, 0 1 cached: 2 is reused first
    assert _tier(m)[:2] == [2, 3] and pool._empty is empty and len(empty) == 12
    assert pool.free_order() == [2, 3, *range(4, 12), 1, 0]  # (a's tail first, as vLLM)
    split = pool.take_split(2, 3)  # a store start's: the empty tier's first 2, then 3
    assert [[b.block_id for b in part] for part in split] == [[2, 3], [4, 5, 6]]
    assert pool._empty is empty and len(empty) == 12
    pool.free([*split[1][::-1], *split[0][::-1]])  # (empty: reused in the order given)
    assert pool._empty is empty and len(empty) == 12 and _tier(m) == [6, 5, 4, 3, 2, *range(7, 12)]
    assert pool.reset() and len(pool._empty) == 12 and pool._lo == 0
