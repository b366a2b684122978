"""A sized manager's requests leaving and checked (sized.py binds these on
``SizedHybridKVCacheManager``): the order blocks are released and freed in (vLLM's plain
order: group by group, each group's last block first), what ``check_invariants`` asks
of each request's blocks, and the calls not served with different block sizes yet
(``fork``, ``uncache_blocks``: ConfigError).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from itertools import chain
from typing import NoReturn

from ..core.block import Block
from ..errors import ConfigError
from . import checkpoints, partial
from .manager import HybridKVCacheManager
from .request import GroupRequest
from .results import GroupFork


def _release_order(self: HybridKVCacheManager, req: GroupRequest,
                   going: list[list[Block | None]]) -> list[Block]:
    """vLLM's plain order (``GroupRequest.release``): free_order.py and
    release_order.py reason about hits of whole blocks at one size."""
    return req.release(going)


def _free_order(self: HybridKVCacheManager, req: GroupRequest, longer: bool) -> list[Block]:
    """vLLM's plain order: group by group, each group's last block first."""
    if self._owners:
        partial.forget(self, req.request_id)
    if self._checkpoints:
        checkpoints.forget(self, req.request_id)
    return [b for b in chain.from_iterable(map(reversed, req.tables)) if b is not None]


def _check_request(self: HybridKVCacheManager, req: GroupRequest) -> str | None:
    """``GroupRequest.check``, and each group's block holding content only where it is
    recorded (below the scheduled tokens rounded down to ``align``, where
    ``BlockSizes.caches`` says, past its hit only in a window with a retention; in a
    sparse group only a block holding the state at its end), and there while its
    prefix id is not lost and no content was lost since its admission
    (``GroupIndex.losses``). After content was lost (a ``rewind``: it keeps the blocks
    below its point that were recorded at a later count), a block also holds content
    where the count the request reached (``num_reserved``) records it. In a window with a
    retention a block may hold content (its prefix's: ``GroupRequest.check``) that this
    request's count does not record: another request's count recorded it, live or gone,
    as for the blocks of its hit (a rewind into a block it shared lowers its hit below
    them, and the recompute, pinned to the same tokens, keeps them)."""
    sizes, n, sound, marks = self.sizes, req.num_scheduled, req.losses == self._index.losses, req.marks
    states, reached = req.states or (), max(n, req.num_reserved)
    marked = checkpoints.entries(self, req) if self._checkpoints else ()  # (the prompt's boundary)
    for g, (spec, table) in enumerate(zip(self.groups, req.tables, strict=True)):
        # (a window's retention: the hit's blocks hold what the requests that cached them chose)
        lo = req.cut[g] if spec.retention is None else max(req.cut[g], req.num_cached // sizes.sizes[g])
        keyed = len(req.nodes) * sizes.hash_size  # (under lookahead keys, n or less: groups/lookahead.py)
        for j in range(lo, min(len(table), n // sizes.sizes[g], keyed // sizes.sizes[g])):
            b, node = table[j], req.nodes[sizes.key_index(g, j)]
            want = (sizes.caches(spec, g, n, j, marks) and (not spec.sparse or (g, j) in states)
                    or (g, j) in marked)
            if b is not None and not node.lost and (b.key is not None or sound) and \
                    (b.key is not None) != want and (sound or not sizes.caches(spec, g, reached, j, marks)) \
                    and not (b.key is not None and spec.retention is not None):
                return (f"request {req.request_id!r} group {g}: block {j} "
                        f"{'holds' if b.key is not None else 'lacks'} content at {n} tokens")
    return req.check(self.groups, sizes, marked)


def _refuse(what: str) -> NoReturn:
    raise ConfigError(f"{what} is not served with groups of different block sizes yet "
                      f"(docs/groups.md)")


def fork(self: HybridKVCacheManager, parent_id: Hashable, child_id: Hashable) -> GroupFork | None:
    """Not served with different block sizes yet: raises ConfigError."""
    _refuse("fork")


def uncache_blocks(self: HybridKVCacheManager, block_ids: Iterable[int]) -> None:
    """Not served with different block sizes yet: raises ConfigError."""
    _refuse("uncache_blocks")
