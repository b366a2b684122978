"""The blocks vLLM's worker zeroes before use (``SchedulerOutput.new_block_ids_to_zero``),
as vLLM 0.33's managers record them.

vLLM zeroes new blocks when its ``KVCacheConfig.needs_kv_cache_zeroing`` (Mamba layers,
whose state is read before it is written, or a cache of mixed precisions, where a block
reused across groups would decode stale bytes as NaN), in the attention groups only
(not Mamba's, nor a ring buffer's: ``CircularBufferSpec``): every block a request
takes, but the blocks of a connector's async load in the groups the load writes
(``skip_zeroing_group_ids``: zeroing would race it), and again the blocks from a
position on that a failed load left unwritten (``record_blocks_for_zeroing``). The
scheduler drains them each step (``take_new_block_ids``), group by group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixkv.core.block import blocks_for

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["Zeroing"]


class Zeroing:
    """The new block ids to zero, per group, in vLLM's ids (``offset`` past prefixkv's)."""

    def __init__(self, kv_cache_config: Any, specs: Sequence[Any], offset: int) -> None:
        from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

        on = bool(kv_cache_config.needs_kv_cache_zeroing)
        self.groups = tuple(on and isinstance(s, AttentionSpec) and not isinstance(s, CircularBufferSpec)
                            for s in specs)
        self.active = any(self.groups)
        self._ids: list[list[int]] = [[] for _ in specs]
        self._offset = offset

    def note(self, new: Sequence[Sequence[int]]) -> None:
        """Record a live request's new blocks (vLLM ids per group)."""
        for g, (ids, on) in enumerate(zip(new, self.groups, strict=True)):
            if on:
                self._ids[g] += ids

    def note_admitted(self, m: KVCacheManager, key: int, hit: int, loaded: int, skip: Sequence[int]) -> None:
        """Record the blocks the admission of the request ``key`` (prefixkv's id) on
        ``m`` took, with a hit of ``hit`` tokens and KV up to ``loaded`` (a load's from
        the hit on): in each group, its entries past the hit's (an uncached window's:
        past its null entries, the hit's part included), but, in the groups ``skip``
        names, those a load writes (below ``loaded``: vLLM's external blocks)."""
        k, null = self._offset, getattr(m.core, "null_block_id", None)
        for g, (row, on, b, c) in enumerate(zip(m._ids(key), self.groups, m.group_sizes, m.cached_groups,
                                                strict=True)):
            if on:
                first = max(hit // b if c else 0, blocks_for(loaded, b) if g in skip else 0)
                self._ids[g] += [i + k for i in row[first:] if i != null]

    def note_from(self, rows: Sequence[Sequence[int]], start_token: int, sizes: Sequence[int]) -> None:
        """Record again a request's blocks from ``start_token`` on, null entries included,
        as vLLM's ``record_blocks_for_zeroing`` (``start_token`` on a block boundary)."""
        k = self._offset
        for g, (row, on, b) in enumerate(zip(rows, self.groups, sizes, strict=True)):
            if on:
                self._ids[g] += [i + k for i in row[start_token // b:]]

    def take(self) -> list[int]:
        """The ids recorded since the last call, group by group; forgets them."""
        out = [i for ids in self._ids for i in ids]
        self._ids = [[] for _ in self._ids]
        return out
