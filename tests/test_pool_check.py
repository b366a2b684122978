"""``BlockPool.check`` (through ``check_invariants``) names each kind of broken count or
link, the first one found: the checker tested against states broken on purpose (a sound
state passes in every other test). The state: 8 blocks of size 4; "a" (13 tokens: blocks
0-3) freed, "b" (5 tokens: blocks 4, 5) live; free order [3, 6, 7 | 2, 1, 0]: the empty
tier (3, the partial block freed last, first), then the cached tier."""

from __future__ import annotations

import re

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import InvariantError


def pool_state() -> KVCacheManager:
    m = KVCacheManager(8, 4)
    m.add_request("a", list(range(13)))
    m.add_request("b", list(range(100, 105)))
    m.free("a")
    assert m.free_block_order() == [3, 6, 7, 2, 1, 0]
    m.check_invariants()
    return m


def broken(m: KVCacheManager, message: str) -> None:
    with pytest.raises(InvariantError, match=f"^{re.escape(message)}$"):
        m.check_invariants()


def test_an_empty_tier_block_held_keyed_or_repeated_is_named() -> None:
    m = pool_state()
    m._pool.blocks[6].refs = 1
    broken(m, "bad or repeated empty-tier block Block(id=6, ref=1, content=0)")
    m = pool_state()
    m._pool.blocks[7].key = m._pool.blocks[0].key
    broken(m, "bad or repeated empty-tier block Block(id=7, ref=0, content=0)")
    m = pool_state()
    m._pool._empty.append(m._pool.blocks[3])  # (3 twice: the empty tier is ``_empty[_lo:]``)
    broken(m, "bad or repeated empty-tier block Block(id=3, ref=0, content=0)")


def test_a_cached_tier_block_held_a_twin_or_keyless_is_named() -> None:
    m = pool_state()
    m._pool.blocks[1].ref_cnt = 1  # (its free run, 0-2, dissolved: each counted alone)
    broken(m, "bad or repeated cached-tier block Block(id=1, ref=1, content=2)")
    m = pool_state()
    m._pool.blocks[1].twin = True
    broken(m, f"bad or repeated cached-tier block {m._pool.blocks[1]!r}")
    m = pool_state()
    m._pool.blocks[2].counted.dissolve()  # (each counted alone: no pending run's)
    m._pool.blocks[2].key = None
    broken(m, f"bad or repeated cached-tier block {m._pool.blocks[2]!r}")


def test_a_broken_link_of_the_cached_tier_is_named() -> None:
    m = pool_state()
    m._pool.blocks[1].prev = m._pool.blocks[0]
    broken(m, "broken prev link at block 1")


def test_a_count_against_the_holders_is_named() -> None:
    m = pool_state()
    m._pool.blocks[5].refs = 2
    broken(m, "block 5: ref_cnt 2, held by 1 requests, not in the free queue")
    m = pool_state()
    m._pool._empty.remove(m._pool.blocks[6])  # (lost: held by none, in no tier)
    broken(m, "block 6: ref_cnt 0, held by 0 requests, not in the free queue")
    m = pool_state()  # (block 7 said held, free with its count 0: the pool's own answer)
    assert m._pool.check({4: 1, 5: 1, 7: 1}) == (
        "block 7: ref_cnt 0, held by 1 requests, in the free queue")
