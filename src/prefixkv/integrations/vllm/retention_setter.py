"""vLLM's ``coordinator.retention_interval`` set after construction (vLLM's tests set it
on a manager just built; vLLM's coordinator reads the attribute at each call).

prefixkv reads ``prefix_cache_retention_interval`` into its layout once (retention.py:
the windows' and Mamba groups' ``retention``, and what the groups derive from it). A
new interval set on the coordinator is followed by building the manager again, with a
copy of its ``KVCacheConfig`` that holds the new interval and the arguments it was
built with: only while the manager holds nothing (no request's blocks, popped or
copied ones, nor a cached block), where a new build loses nothing vLLM's keeps. Set
while it holds something, it is refused by name (``UnsupportedByPrefixKV``), nothing
changed; an interval vLLM's construction refuses, or prefixkv does not apply at that
layout, is refused as at construction (``read_retention``), nothing changed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .layout import UnsupportedByPrefixKV

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["set_retention_interval"]


def set_retention_interval(m: KVCacheManager, interval: int | None) -> None:
    """Make ``interval`` the manager's ``retention_interval`` (module docstring): nothing
    when it is the one in force, else a new build of ``m`` with it. Raises
    UnsupportedByPrefixKV while ``m`` holds a block or a cached one, ConfigError (or
    UnsupportedByPrefixKV) as construction does for the interval; nothing changed."""
    if type(interval) is type(m.retention_interval) and interval == m.retention_interval:
        return
    pool = m.block_pool
    held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    if m.live_request_ids() or held or m.core.num_cached_blocks:
        raise UnsupportedByPrefixKV(
            f"prefixkv follows a retention_interval set after construction ({m.retention_interval!r} "
            f"to {interval!r}) only on a manager holding no block nor cached one (it builds its "
            f"layout again); this one holds {held} blocks, {len(m.live_request_ids())} requests and "
            f"{m.core.num_cached_blocks} cached contents")
    args, kwargs = m._built_with
    config = replace(m.kv_cache_config, prefix_cache_retention_interval=interval)
    if args:
        args = (config, *args[1:])
    else:
        kwargs = {**kwargs, "kv_cache_config": config}
    hands_off = m.hands_off_events  # (set by prefixkv's Scheduler after construction)
    # (its first step reads the settings, which raise before any attribute is set)
    type(m).__init__(m, *args, **kwargs)
    m._built_with = (args, kwargs)
    m.hands_off_events = hands_off
