"""The unpinned state of a device block, as vLLM 0.33's ``BlockPool.unpin_blocks`` has it
(HiSparse's resident rows use it): a holder lets go of it while it keeps reading it.
Once no one holds it, the block counts as free and joins the cached tier's tail (the last
free block reused, after the empty tier and after any cached content freed before it);
the index finds nothing in it. ``hold`` takes a reference on it again, free or not. When
the pool hands it out again (``take``'s eviction, ``take_one``) or drops all content
(``reset``), its watcher is told, once, with the block: the reader must stop reading it.
``forget`` drops a watcher whose reader is gone; the block stays free where it is.

``UnpinPool`` is the pool of a layout that unpins; every other pool is a plain
``BlockPool``, whose paths never look for unpinned blocks. Its overrides fall through to
``BlockPool``'s at once while no block is unpinned. It records no shared runs (``Run``):
a group pool's index records none.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..errors import RequestError
from .block import Block
from .pool import BlockPool, PoolIndex
from .pool_check import check_pool

__all__ = ["UnpinPool", "Watcher"]

Watcher = Callable[[Block], None]


def _nobody(block: Block) -> None:
    """The watcher of an unpinned block no one reads any more (``forget``)."""


class UnpinPool(BlockPool):
    """A ``BlockPool`` whose held blocks may be unpinned (module doc)."""

    def __init__(self, num_blocks: int, index: PoolIndex) -> None:
        super().__init__(num_blocks, index)
        self._watchers: dict[int, Watcher] = {}  # unpinned block id -> its watcher

    @property
    def unpinned(self) -> Collection[int]:
        """The ids of the unpinned blocks (read or forgotten), in the order unpinned."""
        return self._watchers.keys()

    def unpin(self, blocks: Sequence[Block], watcher: Watcher) -> None:
        """Let go of one reference on each of ``blocks``: each held, holding no content.
        ``watcher(block)`` is told when the pool reuses it. Those no one holds any more
        become free, at the cached tier's tail in the order given, still readable until
        reused; one still held by another reader stays held, its watcher waiting (vLLM's
        ``unpin_blocks``: a block two rows read). RequestError, with nothing changed, for
        any other block."""
        ids = set()
        for b in blocks:
            if (not isinstance(b, Block) or b.block_id in ids or not 0 <= b.block_id < len(self.blocks)
                    or self.blocks[b.block_id] is not b):
                raise RequestError(f"unpin: {b!r} is not one of this pool's blocks, or is repeated")
            if b.refs < 1 or b.counted is not None or b.key is not None:
                raise RequestError(f"unpin: {b!r} must be held, and hold no content")
            ids.add(b.block_id)
        watchers = self._watchers
        for b in blocks:
            b.refs -= 1
            watchers[b.block_id] = watcher
        self._cached.extend([b for b in blocks if not b.refs])

    def forget(self, block: Block) -> None:
        """Drop ``block``'s watcher: its reader no longer reads it. The block stays
        unpinned, free where it is, until the pool reuses it, telling no one (vLLM keeps
        the watcher, which ignores a page no longer its request's). RequestError, with
        nothing changed, unless it is unpinned."""
        if not isinstance(block, Block) or self._watchers.get(block.block_id, _nobody) is _nobody \
                or self.blocks[block.block_id] is not block:
            raise RequestError(f"forget: {block!r} is not an unpinned block of this pool that a "
                               "reader still reads")
        self._watchers[block.block_id] = _nobody

    def hold(self, block: Block) -> None:
        """One more reference on ``block``, unpinned (its watcher kept) or held (vLLM's
        ``touch``: a free one leaves the free queue): a reader adopts it. RequestError, with nothing
        changed, unless it is an unpinned or held block of this pool."""
        if not isinstance(block, Block) or not 0 <= block.block_id < len(self.blocks) \
                or self.blocks[block.block_id] is not block \
                or not (block.refs or block.block_id in self._watchers):
            raise RequestError(f"hold: {block!r} is not an unpinned or held block of this pool")
        if not block.refs:
            self._cached.remove(block)
        block.refs += 1

    def _reused(self, blocks: list[Block]) -> None:
        """Tell each of ``blocks``' watchers, once, in order (their pages are lost)."""
        watchers = self._watchers
        for b in blocks:
            watchers.pop(b.block_id)(b)

    def _evict(self, n: int, stale: bool = False) -> list[Block]:
        """``BlockPool._evict``; the unpinned blocks among the ``n`` are reused (their
        watchers told) and not dropped from the index, which holds nothing of them."""
        watchers = self._watchers
        if not watchers:
            return BlockPool._evict(self, n, stale)
        assert 0 <= n <= self._cached.size and not self.runs.free, (n, self._cached.size)
        head = self._cached.head
        b = head.next
        blocks: list[Block] = []
        held: list[Block] = []  # those with content
        reused: list[Block] = []
        for _ in range(n):
            blocks.append(b)
            (reused if b.block_id in watchers else held).append(b)
            b.refs = 1
            b.starts = None
            b = b.next
        head.next, b.prev = b, head
        self._cached.size -= n
        if held:
            self.index.drop(held)
        self._reused(reused)
        return blocks

    def take_one(self) -> Block | None:
        """``BlockPool.take_one``; an unpinned block handed out is reused (its watcher
        told)."""
        if self._watchers and self._lo == len(self._empty):
            b = self._cached.head.next  # (the tail sentinel's id, -1, is no one's)
            if b.block_id in self._watchers:
                self._cached.popleft()
                b.refs = 1
                b.starts = None
                self._reused([b])
                return b
        return BlockPool.take_one(self)

    def reset(self) -> bool:
        """``BlockPool.reset``; when it drops the content, every unpinned block is reused
        (as vLLM's ``reset_prefix_cache`` tells its watchers, in the order unpinned) and
        stays free in the empty tier."""
        if not BlockPool.reset(self):
            return False
        reused = [self.blocks[i] for i in self._watchers]
        self._reused(reused)
        return True

    def check(self, expected_refs: dict[int, int]) -> str | None:
        """``BlockPool.check``, an unpinned block sound in the cached tier without
        content; and each unpinned block holds no content, free in the cached tier unless
        another reader holds it."""
        cached = {b.block_id for b in self._cached}
        for i in self._watchers:
            b = self.blocks[i]
            if (i in cached) == bool(b.refs) or b.counted is not None or b.key is not None:
                return f"unpinned block {b!r} is not free without content in the cached tier, nor held"
        return check_pool(self.blocks, self._empty[self._lo:], self._cached, self.num_free,
                          self.index, expected_refs, self._watchers)
