"""``UnpinPool`` (core/pool_unpin.py), the pool's unpinned state, without vLLM: eviction
through cached content and unpinned blocks together (the index drops only the content,
the watchers hear of the others, in the pool's order), ``take_one``, ``reset``, the
check, and caller mistakes refused before any change. Its order against vLLM's own
``BlockPool``: tests/engines/test_vllm_unpin.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefixkv.core.block import Block
from prefixkv.core.keyless import Keyless
from prefixkv.core.pool import BlockPool
from prefixkv.core.pool_unpin import UnpinPool
from prefixkv.errors import RequestError
from prefixkv.index import NoIndex


class Recording:
    """An index that holds what ``hold`` gave a key, and records what the pool drops."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.dropped: list[int] = []

    def hold(self, b: Block) -> None:
        b.key = b"k%d" % b.block_id
        self.held.add(b.block_id)

    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None:
        assert not skip and keyless is None
        for b in blocks:
            self.drop_one(b)

    def drop_one(self, block: Block) -> None:
        assert block.key is not None, f"{block!r}: dropped without content"
        self.held.remove(block.block_id)
        self.dropped.append(block.block_id)
        block.key = None

    def release_spare(self, block: Block) -> Block | None:
        raise AssertionError("no spares here")

    def clear(self) -> None:
        self.held.clear()

    def check(self, blocks: Sequence[Block]) -> str | None:
        return None


def pool_of(n: int) -> tuple[UnpinPool, Recording, list[int]]:
    index = Recording()
    return UnpinPool(n, index), index, []


def test_eviction_drops_content_and_tells_the_watchers_of_unpinned_blocks() -> None:
    pool, index, heard = pool_of(8)
    held = pool.take(8)  # 0..7, the empty tier used up
    for b in held[1:6:2]:  # 1, 3, 5 hold content
        index.hold(b)
    pool.release([held[1]])
    pool.unpin([held[2], held[4]], lambda b: heard.append(b.block_id))
    pool.release([held[3], held[5]])
    pool.unpin([held[6]], lambda b: heard.append(-b.block_id))
    assert pool.free_order() == [1, 2, 4, 3, 5, 6] and pool.num_free == 6
    assert list(pool.unpinned) == [2, 4, 6]
    assert pool.check({0: 1, 7: 1}) is None
    got = pool.take(4)
    assert [b.block_id for b in got] == [1, 2, 4, 3]
    assert index.dropped == [1, 3] and heard == [2, 4]
    assert all(b.ref_cnt == 1 and b.key is None for b in got)
    assert pool.check({0: 1, 7: 1, 1: 1, 2: 1, 4: 1, 3: 1}) is None
    pool.free(got)  # no content now: the empty tier, the first given first
    assert pool.free_order() == [1, 2, 4, 3, 5, 6]
    assert pool.take_one().block_id == 1  # type: ignore[union-attr]
    pool.take(3)
    b5 = pool.take_one()
    assert b5 is not None and b5.block_id == 5 and index.dropped == [1, 3, 5]
    b6 = pool.take_one()
    assert b6 is not None and b6.block_id == 6 and heard == [2, 4, -6]
    assert pool.take_one() is None and not pool.unpinned


def test_forget_leaves_the_block_free_where_it_is_and_no_one_is_told() -> None:
    pool, _, heard = pool_of(6)
    held = pool.take(6)
    pool.unpin(held[2:5], lambda b: heard.append(b.block_id))
    pool.forget(held[3])
    assert pool.free_order() == [2, 3, 4] and list(pool.unpinned) == [2, 3, 4]
    assert pool.check({0: 1, 1: 1, 5: 1}) is None
    with pytest.raises(RequestError, match="forget"):
        pool.forget(held[3])  # (forgotten already)
    assert [b.block_id for b in pool.take(3)] == [2, 3, 4] and heard == [2, 4]
    assert not pool.unpinned


def test_reset_tells_every_watcher_in_the_order_unpinned() -> None:
    pool, _, heard = pool_of(5)
    held = pool.take(5)
    pool.unpin([held[3], held[1]], lambda b: heard.append(b.block_id))
    assert not pool.reset() and heard == []  # blocks 0, 2 and 4 are held
    pool.free([held[0], held[2], held[4]])
    assert pool.reset() and heard == [3, 1] and not pool.unpinned
    assert pool.free_order() == [0, 2, 4, 3, 1]
    assert pool.check({}) is None


def test_the_check_finds_an_unpinned_block_that_is_not_free() -> None:
    pool, _, _ = pool_of(4)
    held = pool.take(4)
    pool.unpin([held[1]], lambda b: None)
    pool._cached.remove(held[1])  # (a caller's mistake the pool cannot see: free, not queued)
    assert "unpinned block" in (pool.check({0: 1, 2: 1, 3: 1}) or "")


def test_a_plain_pool_finds_a_cached_block_without_content_unsound() -> None:
    pool = BlockPool(3, NoIndex())
    held = pool.take(3)
    held[1].refs = 0
    pool._cached.append(held[1])
    assert "bad or repeated cached-tier block" in (pool.check({0: 1, 2: 1}) or "")


@pytest.mark.parametrize("case", ["shared", "content", "repeated", "foreign", "again", "free"])
def test_unpin_refuses_what_it_cannot_let_go_with_nothing_changed(case: str) -> None:
    pool, index, _ = pool_of(6)
    held = pool.take(4)
    pool.unpin([held[3]], lambda b: None)
    before = (pool.free_order(), [b.ref_cnt for b in pool.blocks], list(pool.unpinned))
    if case == "shared":
        blocks = [held[1], held[2], held[2]]
    elif case == "content":
        index.hold(held[2])
        blocks = [held[1], held[2]]
    elif case == "repeated":
        blocks = [held[1], held[1]]
    elif case == "foreign":
        blocks = [held[1], Block(2)]
    elif case == "again":
        blocks = [held[1], held[3]]
    else:
        blocks = [held[1], pool.blocks[5]]
    with pytest.raises(RequestError, match="unpin"):
        pool.unpin(blocks, lambda b: None)
    after = (pool.free_order(), [b.ref_cnt for b in pool.blocks], list(pool.unpinned))
    assert after == before


def test_forget_refuses_a_block_that_is_not_unpinned() -> None:
    pool, _, _ = pool_of(4)
    held = pool.take(4)
    pool.unpin([held[1]], lambda b: None)
    for b in (held[2], Block(1), "x", Block(9)):
        with pytest.raises(RequestError, match="forget"):
            pool.forget(b)  # type: ignore[arg-type]
    assert list(pool.unpinned) == [1]


def test_a_block_two_readers_hold_is_free_once_both_let_go_and_held_again_by_hold() -> None:
    """vLLM's ``unpin_blocks`` on a block two rows hold: the first lets go (still held,
    its watcher waiting), the second frees it to the cached tier's tail; ``hold`` takes
    it back out (its watcher kept) and one more reference on a held block; the watcher
    hears of it once, when the pool reuses it."""
    pool, _, heard = pool_of(4)
    held = pool.take(4)
    held[2].refs = 2  # (two readers)
    pool.unpin([held[2]], lambda b: heard.append(b.block_id))
    assert held[2].ref_cnt == 1 and list(pool.unpinned) == [2] and pool.num_free == 0
    assert pool.check({0: 1, 1: 1, 2: 1, 3: 1}) is None
    pool.unpin([held[2]], lambda b: heard.append(b.block_id))
    assert pool.num_free == 1 and pool.check({0: 1, 1: 1, 3: 1}) is None
    pool.hold(held[2])
    pool.hold(held[2])
    assert held[2].ref_cnt == 2 and pool.num_free == 0 and list(pool.unpinned) == [2]
    assert pool.check({0: 1, 1: 1, 2: 2, 3: 1}) is None
    for b in (Block(1), Block(2), Block(4), pool.blocks[0]):  # (Block(4): past the pool)
        if b is pool.blocks[0]:
            pool.release([b])  # (free, never unpinned)
        with pytest.raises(RequestError, match="hold"):
            pool.hold(b)
    pool.unpin([held[2]], lambda b: heard.append(b.block_id))
    pool.unpin([held[2]], lambda b: heard.append(b.block_id))
    assert [b.block_id for b in pool.take(2)] == [0, 2] and heard == [2]  # (the empty tier first)
