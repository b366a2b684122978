"""Requests leaving: ``free`` (finished, aborted), ``preempt`` (its tokens back to the
engine for a later re-admission) and ``reset_prefix_cache``. A request's blocks go back
tail of the chain first, so the block ending the longest prefix is evicted first."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..errors import RequestError, check_count, check_flag
from ..events import AllBlocksCleared
from ..index import ContentIndex

if TYPE_CHECKING:
    from .manager import KVCacheManager


def free(self: KVCacheManager, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
    """Release a finished, aborted or preempted request's blocks, tail of the chain
    first (so of these, the block ending the longest prefix is evicted first). Cached
    blocks keep their content and stay findable until evicted.

    ``num_computed_tokens``: pass it when the request is dropped before all its
    scheduled tokens were computed (aborted before its step ran): full blocks past it
    are made unfindable, so no later request hits KV that was never written. Default:
    every scheduled token was computed. (Requests that hit those blocks in the same
    step must not run without them either.) A request that waits on the store
    (``StoreWait``) is not live: its wait is forgotten (its fetch still lands, and
    gives back the device blocks it holds: at once if it landed, else then), and its
    ``num_computed_tokens`` can only be 0.
    Raises RequestError for an unknown or already freed id, or a count outside
    ``[0, num_scheduled_tokens]``.
    """
    if self._waits is not None and self._waits.leave(request_id, num_computed_tokens) is not None:
        return  # it waited on the store, holding nothing
    req = self._get(request_id)
    if num_computed_tokens is not None:
        check_count("num_computed_tokens", num_computed_tokens, 0, req.num_scheduled)
        bs = self.block_size
        first = max(num_computed_tokens, req.num_cached) // bs
        never = req.blocks[first:req.num_scheduled // bs]
        # their pending store writes go too: the write is matched to its block by the
        # content id, which the same content recorded again in the block at once may
        # take again (a host slot that keeps it lends its id), and would then go out in
        # this step's plan, before any forward pass computed it (storerisk-r19)
        self._drop_puts(never)
        self._pool.emptied(self._index.uncache(never))
    del self._requests[request_id]
    if req.num_scheduled < len(req.tokens):
        self._num_prefilling -= 1
    # a pending copy into a block going back to the pool must not run (the block may
    # be a load's target in this step); its source may go back then, ahead of these
    # blocks (it may hold content computed on them: copies.py)
    if self._copies.copies:
        unpinned = self._copies.settle(req.blocks, self._pool.blocks)
        if unpinned:
            self._pool.release(unpinned)
    self._pool.free(reversed(req.blocks), req.blocks)


def preempt(self: KVCacheManager,
            request_id: Hashable, *, num_computed_tokens: int | None = None) -> tuple[int, ...]:
    """Free a running request (as ``free``, same ``num_computed_tokens``) and return
    all its known token ids (prompt and generated), to pass to ``add_request(...,
    resumed=True)`` when it is re-admitted; it will hit whatever is still cached.
    A request waiting on the store (``StoreWait``) stops waiting, as in ``free``, and
    its prompt is returned (its re-admission hits what its fetch landed meanwhile).
    Raises as ``free``."""
    waits = self._waits
    waited = waits.leave(request_id, num_computed_tokens) if waits is not None else None
    if waited is not None:
        return tuple(waited.tokens)
    tokens = tuple(self._get(request_id).tokens)
    self.free(request_id, num_computed_tokens=num_computed_tokens)
    return tokens


def reset_prefix_cache(self: KVCacheManager, *, keep_store: bool = False) -> bool:
    """Drop all cached content, only when no block is in use (a store fetch's held
    blocks included), no store fetch is under way and no plan's copies run
    (``take_kv_ops(pending=True)``). Returns whether it did.

    With a shared store, a reset is taken to follow a change of the weights (an RL
    trainer's in-place update, around which vLLM resets its connector): from then on the
    store's keys carry a tag of the first root and the count of resets
    (``store.link.reset_root``, the vLLM connector's rule), so nothing saved
    before is found; the contents computed before whose writes were not planned yet
    are never written; managers that reset as often share again. Writes planned
    before (``StorePut``) keep their old keys: run late, they land where nothing
    looks. ``keep_store=True``: the weights did not change, only this process's device
    and host caches are dropped (a cold start); the store's blocks are found as before.
    Raises RequestError, before anything changes, when ``keep_store`` is not a bool."""
    check_flag("keep_store", keep_store, RequestError)
    if self._ops_pending or self._waits is not None and self._waits.in_flight \
            or not self._pool.reset():
        return False
    if self._host is not None:
        self._host.clear()
    if self._store is not None:
        # contents recorded before the reset, written next step under the namespace
        # it is in then: with the weights changed, old KV under the new names
        self._computing = []
        if isinstance(self._index, ContentIndex) and self._index.fresh is not None:
            self._index.fresh = []
        if not keep_store:
            self._store.reset(self._hasher.fn)
    self._events.append(AllBlocksCleared())
    return True
