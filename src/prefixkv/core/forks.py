"""Forks: a child request sharing its parent's full blocks, the partial last block copied
on write (``copies.py``). The public contract is ``KVCacheManager.fork``."""

from __future__ import annotations

from collections.abc import Hashable
from operator import attrgetter
from typing import TYPE_CHECKING

from ..errors import RequestError, check_new_request
from ..results import Fork

if TYPE_CHECKING:
    from .manager import KVCacheManager

_ID = attrgetter("block_id")


def fork(self: KVCacheManager, parent_id: Hashable, child_id: Hashable) -> Fork | None:
    """Create ``child_id`` sharing the parent's full blocks (parallel sampling, beam
    search). The parent's partial last block is copied on write: the child gets a new
    block, and the copy is in ``copies`` and in ``take_kv_ops()``. The copy runs
    before this step's forward pass: fork once the parent's scheduled tokens were
    computed (after their step ran, as an engine forks after sampling).
    Returns None when that block cannot be had (nothing changed). Raises RequestError
    (unknown parent, child id in use: live, or waiting on the store; parent's prefill
    not fully scheduled)."""
    parent = self._get(parent_id)
    check_new_request(self._requests, child_id)
    if self._waits is not None and child_id in self._waits.waiting:  # (its ``free``
        # would end the wait and leave the child live)
        raise RequestError(f"request {child_id!r} is waiting on the store (StoreWait)")
    if parent.num_scheduled != len(parent.tokens):
        raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
    full = parent.num_scheduled // self.block_size
    shared = parent.blocks[:full]
    if not self._pool.can_acquire(shared, len(parent.blocks) - full):
        return None
    child = parent.fork(child_id, self.block_size)
    child.blocks = self._pool.acquire(shared, len(parent.blocks) - full)
    copies = self._copies.add(parent.blocks[full:], child.blocks[full:])
    self._requests[child_id] = child
    return Fork(child_id, tuple(map(_ID, child.blocks)), copies)
