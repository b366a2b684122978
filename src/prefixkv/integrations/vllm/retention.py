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

``read_retention`` refuses, before anything is built, what vLLM refuses (``ConfigError``,
a ValueError, with vLLM's words), and applies the interval where prefixkv's groups serve
vLLM's sparse retention: its windows' and Mamba groups' ``retention``
(``prefixkv.groups.sliding_window``, ``prefixkv.groups.mamba``; Mamba's chunk-end
checkpoints follow it: checkpoints.py), cached groups only, without EAGLE: with groups
of different block sizes, full attention among them; at one block size (a pure
sliding-window model too), a positive interval beside windows only. Elsewhere its groups
cache densely (vLLM's ``None``): it refuses a positive interval beside a window or Mamba
group there (``UnsupportedByPrefixKV``), and takes 0, vLLM's ``CacheConfig`` default,
which every engine passes: prefixkv then caches more blocks than vLLM, each holding the
KV vLLM would find (docs/integration.md, "prefix_cache_retention_interval").
"""

from __future__ import annotations

from dataclasses import replace

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, SlidingWindowSpec

from prefixkv.errors import ConfigError
from prefixkv.groups.spec import FULL, MAMBA, SLIDING

from .layout import Layout, UnsupportedByPrefixKV

__all__ = ["read_retention"]


def read_retention(kv_cache_config: KVCacheConfig, layout: Layout, scheduler_block_size: int,
                   use_eagle: bool) -> tuple[int | None, Layout]:
    """``kv_cache_config.prefix_cache_retention_interval``, checked (module docstring), and
    ``layout`` (read from that config) with its windows' ``retention`` where prefixkv
    applies it. Raises ConfigError where vLLM raises (with vLLM's words: "no
    sliding-window or Mamba KV cache group", "must be non-negative and a multiple of
    scheduler_block_size") and for an interval that is not an int nor None;
    UnsupportedByPrefixKV for a positive interval beside a window or Mamba group where
    prefixkv does not apply it. Changes nothing."""
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is None:
        return None, layout
    if type(interval) is not int:
        raise ConfigError(f"prefix_cache_retention_interval must be an int or None, got {interval!r}"[:200])
    # (vLLM's isinstance: the window's subclasses, MLA's included, count as windows)
    if not any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in layout.specs):
        if interval == 0:
            return 0, layout
        raise ConfigError(f"prefix_cache_retention_interval ({interval}) is set but this model has no "
                          f"sliding-window or Mamba KV cache group, so retention has no effect; set it "
                          f"to 0 (it only applies to sliding-window and Mamba attention)")
    if interval < 0 or interval % scheduler_block_size:
        raise ConfigError(f"prefix_cache_retention_interval ({interval}) must be non-negative and a "
                          f"multiple of scheduler_block_size ({scheduler_block_size})")
    if _applies(layout, interval, use_eagle):
        return interval, replace(layout, groups=tuple(
            replace(g, retention=interval) if g.kind in (SLIDING, MAMBA) else g  # (blocks ahead kept)
            for g in layout.groups))
    if interval:
        raise UnsupportedByPrefixKV(f"prefixkv does not apply prefix_cache_retention_interval={interval} "
                                    f"(vLLM's sparse retention of sliding-window and Mamba blocks) here: "
                                    f"it does with cached groups, without EAGLE: with groups of "
                                    f"different block sizes, full attention among them, or at one block "
                                    f"size beside windows only; 0 and None are "
                                    f"taken (docs/integration.md)")
    return 0, layout


def _applies(layout: Layout, interval: int, use_eagle: bool) -> bool:
    """Whether prefixkv applies ``interval`` (an int >= 0) to ``layout``'s windows and
    Mamba groups: cached groups, without EAGLE; with groups of different block sizes,
    full attention among them (Mamba too: ckret-r27); at one block size (the manager then
    serves the windows with its sized calls: docs/groups.md), beside windows only and a
    positive interval only (0, the default every engine passes, keeps the one-size
    manager's calls, dense: the sized ones refuse ``uncache_blocks``, which vLLM's failed
    loads call), or beside Mamba's checkpoint blocks and full attention (any interval:
    the sized calls serve them; checkpoints.py)."""
    kinds = {g.kind for g in layout.groups}
    if use_eagle:
        return _beside_eagle(layout, kinds)
    if not all(g.cached for g in layout.groups):
        return False
    if layout.sizes.one_size:  # (Mamba's checkpoint blocks: the sized calls, any interval)
        return bool(interval) and kinds <= {FULL, SLIDING} or layout.sizes.checkpoints and FULL in kinds \
            and kinds <= {FULL, MAMBA}
    return FULL in kinds and kinds <= {FULL, SLIDING, MAMBA}


def _beside_eagle(layout: Layout, kinds: set[str]) -> bool:
    """Whether prefixkv applies the interval beside EAGLE (``use_eagle``): Mamba groups
    beside full attention, with vLLM's fine-grained partial hits (groups of different
    block sizes or a smaller hash block: ``BlockSizes.eagle``), each Mamba group one of
    vLLM's EAGLE groups (none flagged ``is_eagle_group``, or it or a group of its spec:
    vLLM's Mamba manager then keeps the state one block below a junction too). vLLM
    keeps a Mamba state there at each segment's end, at EAGLE's replay boundaries, the
    prompt's checkpoint and the junction (groups/eagle_retention.py ``eagle_marks``)."""
    sizes = layout.sizes
    if sizes.one_size and not sizes.checkpoints or not all(g.cached for g in layout.groups):
        return False
    if kinds == {FULL, SLIDING}:  # (windows: their tails one block up where they peek: groups/sizes.py)
        return not sizes.partial
    flags = layout.eagle_flags
    flagged = {s for s, f in zip(layout.specs, flags, strict=True) if f}  # (vLLM: a spec's groups alike)
    return (sizes.partial or sizes.checkpoints) and kinds == {FULL, MAMBA} and (not flagged or all(
        s in flagged for g, s in zip(layout.groups, layout.specs, strict=True) if g.kind == MAMBA))
