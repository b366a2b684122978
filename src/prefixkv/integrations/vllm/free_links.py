"""vLLM's free block queue as the linked list its tests walk, read-only, over prefixkv's
free order.

vLLM's ``FreeKVCacheBlockQueue`` is an intrusive doubly linked list between two
sentinels, ``fake_free_list_head`` and ``fake_free_list_tail`` (``KVCacheBlock``s of id
-1); each free block's ``prev_free_block`` / ``next_free_block`` link it, a block in use
has None in both. Its tests walk it (``head.next_free_block`` ... to the tail) to find
the blocks the pool hands out next. prefixkv's pool keeps its own queue (empty blocks
first, then cached ones least recently used first: ``free_block_order``), so here:

- the view's ``fake_free_list_head`` and ``fake_free_list_tail`` are two ``FreeEnd``
  objects made once per pool (identity holds across reads, as vLLM's tests compare it);
- a ``PoolBlock``'s links (block_objects.py) and the ends' links are read from
  prefixkv's free order when asked: the walk from the head is ``get_all_free_blocks``,
  the order the pool hands blocks out, which is vLLM's wherever the two pools agree on
  what they reuse (tests/engines/test_vllm_free_links.py);
- writing a link raises UnsupportedByPrefixKV: the order is prefixkv's pool's.

Each read lists the free order (O(free blocks)): a view for tests and debugging, never
read by prefixkv's calls nor by vLLM's scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from .layout import UnsupportedByPrefixKV

__all__ = ["FreeEnd", "FreeLinks"]


class FreeLinks:
    """The links of vLLM's free list over prefixkv's free order: ``order()`` lists the
    free prefixkv block ids in the order the pool hands them out; ``table`` and
    ``offset`` map them to vLLM's block objects."""

    def __init__(self, order: Callable[[], list[int]], table: list[KVCacheBlock], offset: int) -> None:
        self._order, self._table, self._offset = order, table, offset
        self.head = FreeEnd(self, first=True)
        self.tail = FreeEnd(self, first=False)

    def neighbours(self, core_id: int) -> tuple[KVCacheBlock | None, KVCacheBlock | None]:
        """(previous, next) of prefixkv block ``core_id`` in the free list (an end where
        it is first or last); (None, None) while it is not free."""
        order = self._order()
        try:
            i = order.index(core_id)
        except ValueError:
            return None, None
        table, k = self._table, self._offset
        prev = table[order[i - 1] + k] if i else self.head
        nxt = table[order[i + 1] + k] if i + 1 < len(order) else self.tail
        return prev, nxt

    def first(self) -> KVCacheBlock:
        """The block the pool hands out next, the tail when none is free."""
        order = self._order()
        return self._table[order[0] + self._offset] if order else self.tail

    def last(self) -> KVCacheBlock:
        """The block the pool hands out last, the head when none is free."""
        order = self._order()
        return self._table[order[-1] + self._offset] if order else self.head


class FreeEnd(KVCacheBlock):
    """``fake_free_list_head`` (``first``) or ``fake_free_list_tail``: block id -1,
    linked to the first (last) free block, or to the other end when none is free."""

    __slots__ = ("_links", "_first")

    # vLLM's fields, read as its sentinels' (class attributes over vLLM's slots)
    pool = _block_hash = _block_hash_num_tokens = None
    is_null = False
    ref_cnt = 0

    def __init__(self, links: FreeLinks, first: bool) -> None:  # (not vLLM's: no hash, no count)
        self.block_id = -1  # type: ignore[misc]  # (vLLM's slot, unseen by mypy)
        self._links, self._first = links, first

    @property
    def next_free_block(self) -> KVCacheBlock | None:
        return self._links.first() if self._first else None

    @next_free_block.setter
    def next_free_block(self, value: Any) -> None:
        refuse_link(self, "next_free_block", value)

    @property
    def prev_free_block(self) -> KVCacheBlock | None:
        return None if self._first else self._links.last()

    @prev_free_block.setter
    def prev_free_block(self, value: Any) -> None:
        refuse_link(self, "prev_free_block", value)

    def __repr__(self) -> str:
        return f"FreeEnd({'head' if self._first else 'tail'})"


def refuse_link(block: KVCacheBlock, name: str, value: Any) -> None:
    """A write of a free-list link: refused, the order is prefixkv's pool's."""
    raise UnsupportedByPrefixKV(f"KVCacheBlock({block.block_id}).{name} = {value!r}: prefixkv's pool "
                                f"keeps its free order; its view of vLLM's free list is read-only")
