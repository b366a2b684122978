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


def fork_request(m: KVCacheManager, parent_id: Hashable, child_id: Hashable) -> Fork | None:
    """``KVCacheManager.fork``: None, with nothing changed, when the copy's block cannot be
    had."""
    parent = m._get(parent_id)
    check_new_request(m._requests, child_id)
    if m._waits is not None and child_id in m._waits.waiting:  # (its ``free``
        # would end the wait and leave the child live)
        raise RequestError(f"request {child_id!r} is waiting on the store (StoreWait)")
    if parent.num_scheduled != len(parent.tokens):
        raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
    full = parent.num_scheduled // m.block_size
    shared = parent.blocks[:full]
    if not m._pool.can_acquire(shared, len(parent.blocks) - full):
        return None
    child = parent.fork(child_id, m.block_size)
    child.blocks = m._pool.acquire(shared, len(parent.blocks) - full)
    copies = m._copies.add(parent.blocks[full:], child.blocks[full:])
    m._requests[child_id] = child
    return Fork(child_id, tuple(map(_ID, child.blocks)), copies)
