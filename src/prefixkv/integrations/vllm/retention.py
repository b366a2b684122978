"""vLLM's ``prefix_cache_retention_interval`` (``KVCacheConfig``), checked as vLLM checks it.

vLLM 0.33 keeps a sliding-window or Mamba group's blocks cached sparsely by it
(``SlidingWindowManager.reachable_block_mask``, ``MambaManager``'s): ``None`` caches every
block a hit can read (dense), ``0`` only the tails at the prompt's replay boundary and at
a shared-prefix junction, ``R > 0`` those and one tail per ``R``-token segment. Full
attention caches every block whatever the interval. vLLM's coordinator checks the
interval at construction (``_validate_prefix_cache_retention_interval``):

    no window nor Mamba group   0 or None taken; anything else refused ("no sliding-window
                                or Mamba ... group")
    a window or Mamba group     None, or an int >= 0 that is a multiple of
                                ``scheduler_block_size``; anything else refused

prefixkv's groups cache densely (vLLM's ``None``). ``read_retention`` refuses, before
anything is built, what vLLM refuses (``ConfigError``, a ValueError, with vLLM's words),
and a positive interval beside a window or Mamba group, which prefixkv does not apply
(``UnsupportedByPrefixKV``). It takes ``0`` there, vLLM's ``CacheConfig`` default, which
every engine passes: prefixkv then caches more blocks than vLLM, each holding the KV vLLM
would find (docs/integration.md, "prefix_cache_retention_interval").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec

from prefixkv.errors import ConfigError

from .layout import UnsupportedByPrefixKV

__all__ = ["read_retention"]


def read_retention(kv_cache_config: KVCacheConfig, specs: Sequence[Any],
                   scheduler_block_size: int) -> int | None:
    """``kv_cache_config.prefix_cache_retention_interval`` for groups of vLLM specs
    ``specs`` (the config's, in order), checked (module docstring). Raises ConfigError
    where vLLM raises (with vLLM's words: "no sliding-window or Mamba KV cache group",
    "must be non-negative and a multiple of scheduler_block_size") and for an interval
    that is not an int nor None; UnsupportedByPrefixKV for a positive interval beside a
    window or Mamba group. Changes nothing."""
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is None:
        return None
    if type(interval) is not int:
        raise ConfigError(f"prefix_cache_retention_interval must be an int or None, got {interval!r}"[:200])
    # (vLLM's isinstance: the window's subclasses, MLA's included, count as windows)
    if not any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in specs):
        if interval == 0:
            return 0
        raise ConfigError(f"prefix_cache_retention_interval ({interval}) is set but this model has no "
                          f"sliding-window or Mamba KV cache group, so retention has no effect; set it "
                          f"to 0 (it only applies to sliding-window and Mamba attention)")
    if interval < 0 or interval % scheduler_block_size:
        raise ConfigError(f"prefix_cache_retention_interval ({interval}) must be non-negative and a "
                          f"multiple of scheduler_block_size ({scheduler_block_size})")
    if interval:
        raise UnsupportedByPrefixKV(f"prefixkv does not apply prefix_cache_retention_interval={interval} "
                                    f"(vLLM's sparse retention of sliding-window and Mamba blocks): its "
                                    f"groups cache every block a hit can read, as vLLM's None; 0 and "
                                    f"None are taken (docs/integration.md)")
    return 0
