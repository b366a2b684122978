"""Forks in a hybrid manager: a child sharing its parent's full blocks in every group, each
group's partial last block copied on write. The contract is ``HybridKVCacheManager.fork``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..core.block import Block
from ..errors import ConfigError, RequestError, check_new_request
from .request import GroupRequest
from .results import GroupBlockCopy, GroupFork

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def fork(self: HybridKVCacheManager, parent_id: Hashable, child_id: Hashable) -> GroupFork | None:
    """Create ``child_id`` sharing the parent's full blocks in every group (and its
    released entries); each group's partial last block (and any reserved block) is
    copied on write (the copies are in the result and in ``take_kv_ops()``). Returns
    None when those blocks cannot be had (nothing changed). Raises RequestError (unknown parent, child
    id in use, parent's prefill not fully scheduled), ConfigError when a group is
    sparse (Mamba: a fork would need its state block copied, not offered)."""
    parent = self._get(parent_id)
    if any(s.sparse for s in self.groups):
        raise ConfigError("fork is not offered for a model with a Mamba (sparse) group")
    check_new_request(self._requests, child_id)
    if parent.num_scheduled != len(parent.tokens):
        raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
    full = parent.num_scheduled // self.block_size
    held: list[Block] = [b for t in parent.tables for b in t[:full] if b is not None]
    # the entries from ``full`` on are copied on write; a released one (None) stays
    # released: a rewind can take a request back before blocks its windows released
    need = sum(b is not None for t in parent.tables for b in t[full:])
    if not self._pool.can_acquire(held, need):
        return None
    fresh = iter(self._pool.acquire(held, need)[len(held):])
    child = GroupRequest(child_id, parent.tokens[:], parent.keys, len(self.groups))
    copies = []
    for g, table in enumerate(parent.tables):
        new = [None if b is None else next(fresh) for b in table[full:]]
        self._index.own(g, [b for b in new if b is not None])
        child.tables[g] = table[:full] + new
        copies += [GroupBlockCopy(a.block_id, b.block_id, g)
                   for a, b in zip(table[full:], new, strict=True) if a is not None and b is not None]
    child.cut = parent.cut[:]
    child.num_reserved = parent.num_reserved
    child.next_release = parent.next_release
    child.nodes = parent.nodes[:]
    self._table.hold(child.nodes[-1] if child.nodes else None)
    child.num_scheduled, child.step_start = parent.num_scheduled, parent.step_start
    child.sound_from = parent.sound_from
    child.num_cached = full * self.block_size
    child.tainted_from, child.losses = parent.tainted_from, parent.losses  # (the
    # parent's KV, found as the parent's is)
    self._kv_ops += copies
    self._requests[child_id] = child
    return GroupFork(child_id, tuple(map(tuple, self._ids(child))), tuple(copies))
