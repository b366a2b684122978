"""The cached tier of the free queue: an intrusive doubly linked list in LRU order.

    head <-> b_lru <-> ... <-> b_mru <-> tail        (head/tail are sentinels)

O(1) append at the tail, pop at the head and removal from the middle (a cache hit takes a
free block back). The links live in the blocks themselves: a ``collections.deque`` cannot
remove from the middle in O(1), and an ``OrderedDict`` would keep a second hash table of
every free block beside the index, paying a dict operation on every release and hit.
The queue only keeps order; the order in which blocks are appended is the pool's
eviction policy. A block's links mean something only while it is in the queue: the bulk
operations (the pool's eviction and its unlink of cache hits, inlined with ``head``,
``ends`` and ``forget``) leave them stale rather than spend two writes a block clearing them.
"""

from __future__ import annotations

from collections.abc import Iterator

from .block import UNLINKED, Block


class FreeBlockQueue:
    """The cached tier (module doc). ``head``: the head sentinel, read by the pool's
    eviction, which inlines ``popleft`` (``head.next`` is the least recently used block
    unless it is the tail); ``size``: the blocks in the queue, read and written there."""

    __slots__ = ("head", "_tail", "size")

    def __init__(self) -> None:
        self.head = Block(-1)
        self._tail = Block(-1)
        self.head.next = self._tail
        self._tail.prev = self.head
        self.size = 0

    def __len__(self) -> int:
        return self.size  # (``size`` is read directly on hot paths: no Python call)

    def append(self, block: Block) -> None:
        """Insert ``block`` as the most recently used. It must not be in the queue."""
        last = self._tail.prev
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.size += 1

    def extend(self, blocks: list[Block]) -> None:
        """Append ``blocks`` in order, each as the new most recently used."""
        last = self._tail.prev
        for b in blocks:
            last.next = b
            b.prev = last
            last = b
        last.next = self._tail
        self._tail.prev = last
        self.size += len(blocks)

    def remove_all(self, blocks: list[Block]) -> None:
        """Unlink each of ``blocks``, which must all be in the queue."""
        for b in blocks:
            prev, nxt = b.prev, b.next
            prev.next = nxt
            nxt.prev = prev
            b.prev = b.next = UNLINKED
        self.size -= len(blocks)

    def ends(self) -> tuple[Block, Block]:
        """The head and tail sentinels, for a hot loop that inlines ``popleft`` (the least
        recently used block is ``head.next`` unless that is ``tail``; it unlinks it from
        the head and counts what it took with ``forget``)."""
        return self.head, self._tail

    def forget(self, n: int) -> None:
        """Account for ``n`` blocks the caller unlinked itself (a hot loop that inlines
        ``remove``)."""
        self.size -= n

    def remove(self, block: Block) -> None:
        """Unlink ``block``, which must be in the queue."""
        prev, nxt = block.prev, block.next
        assert prev is not UNLINKED and nxt is not UNLINKED, block
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = UNLINKED
        self.size -= 1

    def popleft(self) -> Block | None:
        """Unlink and return the least recently used block; None when the queue is empty."""
        head = self.head
        block = head.next
        if block is self._tail:
            return None
        nxt = block.next
        head.next = nxt
        nxt.prev = head
        block.prev = block.next = UNLINKED
        self.size -= 1
        return block

    def contains(self, block: Block) -> bool:
        """Whether ``block`` is linked into this queue, for blocks that left it through
        ``remove`` or ``popleft`` (which clear its links)."""
        return block.prev is not UNLINKED

    def __iter__(self) -> Iterator[Block]:
        node = self.head.next
        while node is not self._tail:
            yield node
            node = node.next

    def broken_link(self) -> str | None:
        """A description of the first inconsistent link or count, None when sound."""
        prev, count = self.head, 0
        for b in self:
            if b.prev is not prev:
                return f"broken prev link at block {b.block_id}"
            prev, count = b, count + 1
        if self._tail.prev is not prev:
            return "tail sentinel does not point at the last block"
        if count != self.size:
            return f"cached tier length {self.size} != {count} linked"
        return None
