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
from typing import Any

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

    def note(self, rows: Sequence[Sequence[int]], first: Sequence[int], loaded: Sequence[int] = (),
             skip: Sequence[int] = (), null: int | None = None) -> None:
        """Record the new blocks of a request's tables ``rows`` (prefixkv ids per group):
        in group g, the entries from ``first[g]`` on but ``null`` ones, and but those
        below ``loaded[g]`` (a load's blocks) in the groups ``skip`` names."""
        k = self._offset
        for g, (row, on) in enumerate(zip(rows, self.groups, strict=True)):
            if not on:
                continue
            below = loaded[g] if g in skip else 0
            self._ids[g] += [i + k for j, i in enumerate(row) if j >= first[g] and i != null and j >= below]

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
