"""Requests leaving a hybrid manager (``free``, ``preempt``), content that turned out
invalid (``uncache_blocks``) and ``reset_prefix_cache``; the contracts are
``HybridKVCacheManager``'s."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from ..core.dependents import computed_on
from ..errors import check_block_ids, check_count
from ..events import AllBlocksCleared
from .free_order import free_order
from .free_runs import finder
from .request import GroupRequest

if TYPE_CHECKING:
    from ..core.block import Block
    from .manager import HybridKVCacheManager


def free(self: HybridKVCacheManager, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
    """Release a request's blocks in every group; cached ones stay findable in their
    group until evicted, which takes first those released first: vLLM's order (group
    by group, each group's tail first), but a block no hit of the request's prefix
    can use goes ahead as soon as it becomes so (free_order.py): however many of
    them are evicted, every hit of its prefix that vLLM's order keeps is kept.
    ``num_computed_tokens``: as ``KVCacheManager.free`` (full blocks past it were
    never computed and become unfindable); blocks a window already released are not
    reached, so pass at least the start of the last step scheduled (what an engine
    dropping a request before that step ran knows). Raises RequestError for an unknown or
    freed id, or a count outside ``[0, num_scheduled_tokens]``."""
    req = self._get(request_id)
    if num_computed_tokens is not None:
        check_count("num_computed_tokens", num_computed_tokens, 0, req.num_scheduled)
        first = max(num_computed_tokens, req.num_cached)
        for t, bs in zip(req.tables, self._group_sizes, strict=True):
            self._pool.emptied(self._index.uncache(
                [b for b in t[first // bs:req.num_scheduled // bs] if b is not None]))
    del self._requests[request_id]
    nodes = req.nodes
    # a longer prefix exists (a child, or another request ending here): a reference on
    # the last node beside its blocks' and the request's own
    longer = bool(nodes) and nodes[-1].refs > self._index.num_blocks_of(nodes[-1]) + 1
    self._pool.free_groups(self._free_order(req, longer), req.tables)
    self._table.unhold(req.nodes[-1] if req.nodes else None)


def _free_order(self: HybridKVCacheManager, req: GroupRequest, longer: bool) -> list[Block]:
    """The request's blocks in the order ``free`` releases them (``free_order``)."""
    return free_order(self.groups, self.block_size, req, finder(self._index, req), longer,
                      self._uncached)


def preempt(self: HybridKVCacheManager, request_id: Hashable, *,
            num_computed_tokens: int | None = None) -> tuple[int, ...]:
    """Free a running request (as ``free``) and return all its known token ids, for
    ``add_request(..., resumed=True)``. Raises as ``free``."""
    tokens = tuple(self._get(request_id).tokens)
    self.free(request_id, num_computed_tokens=num_computed_tokens)
    return tokens


def uncache_blocks(self: HybridKVCacheManager, block_ids: Iterable[int]) -> None:
    """As ``KVCacheManager.uncache_blocks``: make the content of these blocks
    unfindable in their group (their KV turned out invalid) while live requests hold
    them; a block no request holds is left as it is. Each live request holding one
    loses the content of its full blocks after it too, in every group (computed on
    top of it), and so on for a request holding one of those (it hit it, and
    computed its own after it: ``computed_on``). A prefix left in no block of a
    group goes from every group with its descendants (``GroupIndex.uncache``), and
    what a request fills after such a block is never found. Raises RequestError for
    an id outside the pool, or ``block_ids`` not an iterable (nothing changes)."""
    blocks = self._pool.blocks
    ids = check_block_ids(block_ids, len(blocks))
    going = [blocks[i] for i in ids if blocks[i].ref_cnt > 0]
    if going:  # (and what live requests computed on top of them, hits of it included)
        going = computed_on(((r.tables, len(r.nodes)) for r in self._requests.values()),
                            going, () if self._null is None else (self._null,))
    self._pool.emptied(self._index.uncache(going))


def reset_prefix_cache(self: HybridKVCacheManager) -> bool:
    """Drop all cached content in every group, only when no request holds a block
    (and the pending copies, whose blocks no request holds then) and no copy on write
    holds its blocks (``release_copies``: vLLM's blocks not freed yet). Returns whether
    it did."""
    if self._requests or self._held_copies:
        return False
    self._kv_ops.clear()  # every pending copy writes a block that no request holds
    if self._null is not None:
        self._pool.release([self._null])
    cleared = self._pool.reset()
    assert cleared, "no request is live, yet a block is held"
    if self._null is not None:
        self._null = self._pool.take(1)[0]
    # the events not taken yet stay ahead of the clear, as the core's and vLLM's pools
    # keep them: a consumer reading the stream sees each stored block, then the clear
    self._events.append(AllBlocksCleared())
    return True
