"""vLLM 0.33's count of the blocks a HiSparse request needs, group by group, when the
caller passes hit blocks (``new_computed_blocks``) or computed tokens of a new request: a
read-only query that changes nothing (the scheduler's and its connectors' capacity
checks; an allocation with a hit is hisparse_cache.py's). The counts are vLLM's
``HiSparseSourceManager``, ``FullAttentionManager`` (the indexer),
``HiSparseResidentManager`` and ``HiSparseHotManager`` ``get_num_blocks_to_allocate``:

- the source group on the host pool: the pages past the hit and the request's blocks,
  the free hit blocks it would take, one more when the hit ends inside a page (its
  copy); none of the device pool's, unless the host pool cannot give them (then more
  than the device pool holds);
- the indexer: the same on the device pool;
- the resident row: an import's (``Imports.row_need``) when the computed tokens
  include external ones, else the pages past the row and the host hit (capped at the
  admission window when asked);
- the hot region: for an import, a new request resuming a host prefix, or one asked to
  take it.

Blocks that are not the manager's, or hits in the resident or hot groups, raise
RequestError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixkv.core.block import blocks_for
from prefixkv.errors import RequestError, check_count
from prefixkv.groups.hisparse.imports import Imports

from .hisparse_groups import HOST, HOT, INDEXER, RESIDENT

if TYPE_CHECKING:
    from .hisparse_manager import HiSparseKVCacheManager

__all__ = ["group_need", "need"]


def _hit(manager: HiSparseKVCacheManager, group: int, blocks: Sequence[Any]) -> list[Any]:
    """``blocks`` checked as the manager's own of ``group`` (RequestError otherwise)."""
    pool = manager._host if group == HOST else manager._device
    given = list(blocks)
    if (group in (RESIDENT, HOT) and given) or any(
            b.__class__ is int or not 0 <= b.block_id < len(pool) or pool[b.block_id] is not b
            for b in given):
        raise RequestError(f"hit blocks {given!r} of group {group} are not this manager's "
                           "(only the source and indexer groups hit)")
    return given


def group_need(manager: HiSparseKVCacheManager, group: int, request_id: str, num_tokens: int,
               hit: Sequence[Any], total_computed_tokens: int, num_local_computed_tokens: int,
               apply_admission_cap: bool = False) -> int:
    """vLLM's count of group ``group`` (module doc) for ``request_id`` (new or holding
    blocks) to cover ``num_tokens`` tokens with the hit blocks ``hit``."""
    state, bs = manager.state, manager.block_size
    for name, count in (("num_tokens", num_tokens), ("total_computed_tokens", total_computed_tokens),
                        ("num_local_computed_tokens", num_local_computed_tokens)):
        check_count(name, count, 0, None)
    hit = _hit(manager, group, hit)
    held = state.holds(request_id)
    host, indexer, row, hot, required_hot = state.request(request_id) if held else ([], [], [], [], False)
    pages = blocks_for(num_tokens, bs)
    if group in (HOST, INDEXER):
        if held and hit:
            raise RequestError(f"a hit for {request_id!r}, which holds blocks")
        own = host if group == HOST else indexer
        n = max(pages - len(own) - len(hit), 0) + sum(int(b.ref_cnt == 0 and not b.is_null) for b in hit)
        n += int(bool(hit) and num_local_computed_tokens % bs != 0)  # (a partial hit's copy)
        if group == INDEXER:
            return n
        return len(manager._device) + 1 if n > state.host.num_free else 0
    if group == RESIDENT:
        if total_computed_tokens > num_local_computed_tokens:
            blocks = [b or None for b in row]  # (0: read from host)
            return Imports.row_need(blocks, pages, total_computed_tokens, bs)
        cap = min(pages, state.window) if apply_admission_cap else pages
        return max(cap - max(len(row), blocks_for(num_local_computed_tokens, bs)), 0)
    if total_computed_tokens > num_local_computed_tokens or (num_local_computed_tokens and not held) \
            or required_hot:
        return state.hot_blocks - len(hot)
    return 0


def need(manager: HiSparseKVCacheManager, request_id: str, num_tokens: int, new_computed_blocks: Any,
         total_computed_tokens: int, num_local_computed_tokens: int, apply_admission_cap: bool = False
         ) -> int:
    """vLLM's coordinator count: the four groups' ``group_need`` summed."""
    return sum(group_need(manager, g, request_id, num_tokens, new_computed_blocks[g], total_computed_tokens,
                          num_local_computed_tokens, apply_admission_cap) for g in range(4))
