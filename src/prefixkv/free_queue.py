"""The cached tier of the free queue: an intrusive doubly linked list in LRU order.

    head <-> b_lru <-> ... <-> b_mru <-> tail        (head/tail are sentinels)

O(1) append at the tail, pop at the head and removal from the middle (a cache hit takes a
free block back). The queue only keeps order; the order in which blocks are appended is
the pool's eviction policy.
"""

from __future__ import annotations

from collections.abc import Iterator

from .block import Block


class FreeBlockQueue:
    __slots__ = ("_head", "_tail", "_len")

    def __init__(self) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        """Insert ``block`` as the most recently used. It must not be in the queue."""
        last = self._tail.prev
        assert last is not None and block.prev is None and block.next is None, block
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1

    def remove(self, block: Block) -> None:
        """Unlink ``block``, which must be in the queue."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, block
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        """Unlink and return the least recently used block. The queue must not be empty."""
        block = self._head.next
        assert block is not None and block is not self._tail, "pop from an empty free queue"
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def contains(self, block: Block) -> bool:
        return block.prev is not None
