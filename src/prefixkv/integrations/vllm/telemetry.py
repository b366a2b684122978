"""What vLLM's scheduler reads from its KV cache manager besides blocks: the prefix-cache
stats (``log_stats``), the metrics collector's per-block notes (``metrics_collector``),
and KV events as vLLM's objects (``enable_kv_cache_events``).

One ``Telemetry`` per ``manager.KVCacheManager``, which forwards vLLM's calls here. It
holds no blocks and changes none: it reads prefixkv's events and the block table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import KVCacheSpec, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

from prefixkv.events import BlockRemoved

from .events import to_vllm_events
from .handoff import PendingVllmEvents
from .pool import Blocks

__all__ = ["Telemetry"]


class Telemetry:
    """Stats, metrics notes and events of one manager over ``core`` (prefixkv's manager,
    built with events on when ``enable_kv_cache_events`` or a ``metrics_collector`` needs
    them) and ``blocks`` (vLLM's block objects of that pool)."""

    def __init__(self, core: Any, blocks: Blocks, block_size: int, specs: Sequence[KVCacheSpec], *,
                 log_stats: bool, metrics_collector: Any, enable_kv_cache_events: bool) -> None:
        self.core, self._blocks, self.block_size = core, blocks, block_size
        self.metrics_collector, self.enable_kv_cache_events = metrics_collector, enable_kv_cache_events
        # None throughout without log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self._spec_of_group = tuple((get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s))
                                    for s in specs)

    # ---- metrics collector ---------------------------------------------------------------

    def on_accessed(self, blocks: KVCacheBlocks) -> None:
        """Note the first group's blocks of a hit as accessed (vLLM's null block left out)."""
        if self.metrics_collector is not None:
            for b in blocks.blocks[0]:
                if not b.is_null:
                    self.metrics_collector.on_block_accessed(b)

    def on_allocated(self, ids: Iterable[Iterable[int]]) -> None:
        """Note prefixkv's block ids (per group) as allocated."""
        if self.metrics_collector is not None:
            table, k = self._blocks.table, self._blocks.offset
            for g in ids:
                for i in g:
                    self.metrics_collector.on_block_allocated(table[i + k])

    def on_reset(self) -> None:
        """The prefix cache was dropped: reset the collector, flag the stats."""
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True

    # ---- prefix-cache stats --------------------------------------------------------------

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count the request's lookup (the caller checked that it read the cache)."""
        if self.prefix_cache_stats is None:
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's PrefixCacheStats since the previous call; None without ``log_stats``."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # ---- events ------------------------------------------------------------------------

    def take_events(self, hands_off: bool) -> list[Any]:
        """KV events since the previous call as vLLM's ``KVCacheEvent`` objects (empty
        unless ``enable_kv_cache_events``). With ``hands_off`` (and no
        ``metrics_collector`` needing them now), a ``PendingVllmEvents`` that the
        publisher's thread builds: the chain hashes are not computed here."""
        if hands_off and self.enable_kv_cache_events and self.metrics_collector is None:
            pending = self.core.take_pending_events()
            if pending.empty:  # (a step that recorded nothing, most decode steps: the
                return []  # scheduler publishes nothing, or its connector's events alone)
            return PendingVllmEvents(pending, self.block_size, self._spec_of_group)
        return self.built_events()

    def built_events(self) -> list[Any]:
        """``take_events(False)``: the events built here (what ``block_pool.take_events()``
        returns); evictions are noted to the metrics collector first."""
        core = self.core.take_events()
        if self.metrics_collector is not None:
            self._note_evictions(core)
        if not self.enable_kv_cache_events:
            return []
        return to_vllm_events(core, self.block_size, self._spec_of_group)

    def _note_evictions(self, events: list[Any]) -> None:
        table, k = self._blocks.table, self._blocks.offset
        for e in events:
            if isinstance(e, BlockRemoved):
                for i in e.block_ids:
                    self.metrics_collector.on_block_evicted(table[i + k])
