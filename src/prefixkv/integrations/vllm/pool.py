"""vLLM's view of prefixkv's blocks: ``KVCacheBlock`` objects, ``KVCacheBlocks`` results,
and the ``block_pool`` attribute vLLM's scheduler and connectors read.

Block ids are vLLM's: block 0 is the null block (``is_null``, never handed to a
request), ``1 .. num_blocks - 1`` are the blocks requests get. prefixkv's pool holds
those (``offset`` maps: vLLM id = prefixkv id + offset; 0 when prefixkv's hybrid manager
keeps its own null block at 0, 1 otherwise). One ``KVCacheBlock`` per id is made once
and handed out in every result: a ``PoolBlock`` (block_objects.py) whose ``ref_cnt`` reads
prefixkv's count and whose ``block_hash`` reads vLLM's hash of what it holds
(block_hash_view.py) when asked; the free queue lives in prefixkv, not in these objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from prefixkv.errors import RequestError, check_count

from .block_hashes import CachedBlocks, HashLookups
from .block_objects import HashSource, PoolBlock, RefCount
from .free_links import FreeLinks
from .layout import UnsupportedByPrefixKV

__all__ = ["BlockPoolView", "Blocks"]

Ids = Sequence[Sequence[int]]


class Blocks:
    """The ``KVCacheBlock`` of every vLLM block id, and ``KVCacheBlocks`` built of them."""

    def __init__(self, num_blocks: int, num_groups: int, offset: int, refs: RefCount) -> None:
        self.offset, self._refs = offset, refs
        self.hashes: HashSource | None = None  # (the pool view's, set once it is built)
        self.links: FreeLinks | None = None  # (the free queue view's: free_links.py)
        self.table: list[KVCacheBlock] = [self.fresh(i) for i in range(num_blocks)]
        # the object of prefixkv block id i is ``at(i)`` (``table[i + offset]``; the table
        # is never changed): ``of`` maps a group's ids in one C pass, not bytecodes an id
        self._at: Callable[[int], KVCacheBlock] = self.table[offset:].__getitem__
        self.null_block = self.table[0]
        self.empty = KVCacheBlocks(tuple(() for _ in range(num_groups)))

    def fresh(self, block_id: int) -> KVCacheBlock:
        """A new object for vLLM block id ``block_id``: vLLM's null block (0, ``is_null``,
        count 0), else a ``PoolBlock`` reading prefixkv's count of it."""
        if not block_id:
            return KVCacheBlock(0, is_null=True)
        return PoolBlock(block_id, self._refs, block_id - self.offset, self)

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        """``hashes.hash_entry`` (block_objects.py's ``HashSource``); None before it is set."""
        h = self.hashes
        return None if h is None else h.hash_entry(core_id)

    def gone(self, request: Any, ids: Sequence[Sequence[int]]) -> None:
        """``hashes.gone`` (block_objects.py's ``HashSource``); nothing before it is set."""
        h = self.hashes
        if h is not None:
            h.gone(request, ids)

    def keeping(self) -> bool:
        """``hashes.keeping``; False before it is set."""
        h = self.hashes
        return h is not None and h.keeping()

    def free_neighbours(self, core_id: int) -> tuple[KVCacheBlock | None, KVCacheBlock | None]:
        """``links.neighbours`` (free_links.py); (None, None) before it is set."""
        links = self.links
        return (None, None) if links is None else links.neighbours(core_id)

    def of(self, ids: Ids) -> KVCacheBlocks:
        """``KVCacheBlocks`` of prefixkv block ids per group (the shared empty one when
        every group is empty, as vLLM's manager returns it)."""
        if not any(ids):
            return self.empty
        at = self._at
        return KVCacheBlocks(tuple([*map(at, g)] for g in ids))

    def core_ids(self, block_ids: Iterable[int]) -> set[int]:
        """prefixkv's block ids of vLLM block ids (vLLM's null block, and any below the
        offset, left out). Raises RequestError for ids that are not vLLM block ids."""
        k, top = self.offset, len(self.table) - 1
        try:
            ids = [check_count("block id", i, 0, top) for i in block_ids]
        except TypeError:
            raise RequestError(f"block_ids must be an iterable of block ids, got {block_ids!r}") from None
        return {i - k for i in ids if i >= k}

    def vllm_ids(self, ids: Ids) -> tuple[list[int], ...]:
        """vLLM's block ids of prefixkv block ids per group."""
        k = self.offset
        return tuple([i + k for i in g] for g in ids)


class _FreeQueueView:
    """vLLM's free block queue: ``num_free_blocks`` (prefixkv's free count; a write
    reserves blocks: free_count.py),
    ``get_all_free_blocks`` (prefixkv's free blocks in the order it reuses them) and the
    same order as vLLM's linked list: ``fake_free_list_head`` / ``fake_free_list_tail``
    and the blocks' ``next_free_block`` / ``prev_free_block`` (free_links.py)."""

    def __init__(self, count: Callable[[], int], blocks: Blocks, order: Callable[[], list[int]],
                 write: Callable[[int], None] | None = None) -> None:
        self._count, self._blocks, self._order, self._write = count, blocks, order, write
        blocks.links = links = FreeLinks(order, blocks.table, blocks.offset)
        self.fake_free_list_head, self.fake_free_list_tail = links.head, links.tail

    @property
    def num_free_blocks(self) -> int:
        return self._count()

    @num_free_blocks.setter
    def num_free_blocks(self, n: int) -> None:
        if self._write is None:
            raise UnsupportedByPrefixKV("free_block_queue.num_free_blocks: this manager's count is read-only")
        self._write(n)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks (empty, then cached ones least recently used first), in the
        order the pool hands them out, as vLLM's queue lists them (null block left out)."""
        table, k = self._blocks.table, self._blocks.offset
        return [table[i + k] for i in self._order()]


class _EventQueueView:
    """vLLM's ``kv_event_queue`` (events recorded, not yet taken), read while it is
    empty: ``len`` 0, nothing to iterate. prefixkv builds vLLM's events only as they
    are taken (``take_events``), so a queue holding some raises UnsupportedByPrefixKV,
    as does any write (``append``...)."""

    def __init__(self, pending: Callable[[], bool]) -> None:
        self._pending = pending

    def __len__(self) -> int:
        if self._pending():
            raise UnsupportedByPrefixKV("kv_event_queue: prefixkv builds vLLM's events as they are taken "
                                        "(take_events); it shows the queue only while it is empty")
        return 0

    def __iter__(self) -> Iterator[Any]:
        len(self)  # (raises while events are pending)
        return iter(())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedByPrefixKV(f"kv_event_queue.{name}: prefixkv's pool is not vLLM's; its view "
                                    f"is read-only")


class BlockPoolView:
    """What vLLM's scheduler and connectors use of its ``BlockPool``, over prefixkv.

    ``free_blocks`` takes back the blocks ``KVCacheManager.pop_blocks_for_free`` handed
    out (the scheduler's deferred frees), whole requests at a time; ``evict_blocks``
    makes blocks unfindable. Counts and usage are prefixkv's (``num_gpu_blocks - 1``
    blocks, the null block left out, as vLLM counts them). ``get_cached_block``,
    ``cached_block_hash_to_block`` (read-only), the free queue's ``get_all_free_blocks``
    and an empty ``kv_event_queue`` answer from prefixkv's state.
    """

    def __init__(self, blocks: Blocks, num_gpu_blocks: int, hash_block_size: int,
                 enable_caching: bool, free_fn: Callable[[Iterable[KVCacheBlock]], None],
                 evict_fn: Callable[[set[int]], None], free_count: Callable[[], int],
                 events_fn: Callable[[], list[Any]], free_order: Callable[[], list[int]],
                 hashes: HashLookups, pending_events: Callable[[], bool],
                 write_free_count: Callable[[int], None] | None = None) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.null_block = blocks.null_block
        self.blocks = blocks.table
        self._free, self._evict, self._count, self._events = free_fn, evict_fn, free_count, events_fn
        self.free_block_queue = _FreeQueueView(free_count, blocks, free_order, write_free_count)
        self._hashes = hashes
        blocks.hashes = hashes.block_view  # (the block objects' hash: block_hash_view.py)
        self.cached_block_hash_to_block = CachedBlocks(hashes)
        self.kv_event_queue = _EventQueueView(pending_events)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """The block of each group in ``kv_cache_group_ids`` holding the prefix that
        ``block_hash`` (one of a request's ``block_hashes``) names, None when one of them
        holds none, as vLLM's; found by content (block_hashes.py says how, and what it
        refuses with UnsupportedByPrefixKV). Changes nothing."""
        if not self.enable_caching:  # (vLLM's map stays empty)
            return None if kv_cache_group_ids else []
        return self._hashes.get_cached_block(block_hash, kv_cache_group_ids)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Return blocks from ``pop_blocks_for_free`` to the pool (any order: prefixkv
        releases a request's blocks tail first). Raises RequestError for other blocks."""
        self._free(ordered_blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """vLLM's ``touch`` takes a reference on blocks (a connector keeping them while it
        copies them: SimpleCPUOffload's stores): prefixkv's counts are changed by its
        manager alone, so this raises UnsupportedByPrefixKV."""
        raise UnsupportedByPrefixKV("block_pool.touch: prefixkv's pool keeps the reference counts; only "
                                    "its manager's calls change them (a connector that holds blocks of "
                                    "vLLM's pool while it copies them is not served)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Make the content of these vLLM block ids unfindable (e.g. KV a connector
        failed to load); blocks in use stay with their requests."""
        self._evict(block_ids)

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (empty or cached and evictable)."""
        return self._count()

    def get_usage(self) -> float:
        """Fraction of the usable blocks (null block left out) requests hold."""
        return 1.0 - self._count() / (self.num_gpu_blocks - 1)

    def take_events(self) -> list[Any]:
        """The manager's pending KV events (vLLM's ``KVCacheEvent`` objects)."""
        return self._events()
