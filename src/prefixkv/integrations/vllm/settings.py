"""vLLM's ``KVCacheManager`` arguments read into what manager.py's ``KVCacheManager`` runs
by: the layout (layout.py), checked with the other arguments (options.py) and vLLM's
retention interval (retention.py), and the settings derived from them (``Settings``),
which the manager copies into its attributes (its calls read them there, one attribute
load each). Refuses, before anything is built, what prefixkv does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import KVCacheConfig

from .layout import Layout, read_layout
from .options import check_options, eagle_layout, lookahead_retention
from .retention import read_retention

__all__ = ["Settings", "read_settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """What the manager's calls read of its layout and arguments (each the manager's
    attribute of the same name, a leading ``_`` on the last five)."""

    retention_interval: int | None
    """vLLM's ``prefix_cache_retention_interval``, checked (retention.py)."""
    block_size: int
    """The block size vLLM's scheduler sees (``scheduler_block_size``)."""
    hash_block_size: int
    """The hashes' block size (extra keys of prompt embeddings are cut at it): the groups'
    one size, or the gcd-like size vLLM hashes at beside groups of different sizes."""
    group_sizes: tuple[int, ...]
    """Each group's own block size."""
    cache_unit: int
    """The alignment of hits and caching: the scheduler's block, or with vLLM's
    fine-grained partial hits the hash block (groups/partial.py)."""
    hit_group: int
    """The group whose hit entries count the hit's tokens (a Mamba group's may not, an
    uncached window's hold none)."""
    eagle_groups: tuple[bool, ...]
    """The groups that match one block past an EAGLE hit (``options.eagle_layout``);
    none without EAGLE."""
    watermark_blocks: int
    """vLLM's ``watermark`` in blocks, kept free when a waiting request is admitted."""
    replay_tokens: int
    """How many tokens vLLM's scheduler replays below a hit (SWA bounded replay: its
    uncached window is rebuilt), counting them not computed meanwhile (``sound_tokens``)."""
    reprefill_tokens: int
    """Multi-module MTP prefills a step's last tokens again: these are cached a step
    late (slots.py, growth.py)."""
    cached_groups: tuple[bool, ...]
    """The groups whose hits are looked up (vLLM's empty slot for the others)."""
    retains: bool
    """Whether admission passes vLLM's junction (slots.admit): a window keeps blocks below
    its reach (vLLM's retention), or Mamba's checkpoints cache one there (checkpoints.py)."""
    junctions: bool
    """Whether a hit has a shared-prefix boundary: retention or a Mamba group (mamba.junction)."""
    uncached: bool
    """Whether a group is not looked up (an uncached window)."""
    odd_hit: bool
    """Whether a hit is found otherwise than by every group (EAGLE's, or beside an
    uncached window: hits.lookup)."""
    hybrid: bool
    """Whether the layout runs on the hybrid manager (``Layout.hybrid``)."""


def read_settings(kv_cache_config: KVCacheConfig, *, scheduler_block_size: int, hash_block_size: int,
                  dcp_world_size: int, pcp_world_size: int, use_eagle: bool, num_hash_lookahead_tokens: int,
                  num_prefill_lookahead: int, watermark: float, enable_caching: bool
                  ) -> tuple[Layout, Settings]:
    """The layout of ``kv_cache_config`` (its windows' retention where applied) and the
    settings, from vLLM's manager arguments of these names. Raises what ``read_layout``,
    ``check_options`` and ``read_retention`` raise, in that order."""
    layout = read_layout(kv_cache_config, scheduler_block_size=scheduler_block_size,
                         hash_block_size=hash_block_size, dcp_world_size=dcp_world_size,
                         pcp_world_size=pcp_world_size, enable_caching=enable_caching)
    check_options(layout, use_eagle=use_eagle, num_hash_lookahead_tokens=num_hash_lookahead_tokens,
                  watermark=watermark, num_prefill_lookahead=num_prefill_lookahead,
                  enable_caching=enable_caching)
    interval, layout = read_retention(kv_cache_config, layout, scheduler_block_size, use_eagle)
    if num_hash_lookahead_tokens and enable_caching:
        lookahead_retention(layout)
    retains = any(g.retention is not None for g in layout.groups) or layout.sizes.checkpoints
    cached = tuple(g.cached for g in layout.groups)
    return layout, Settings(
        retention_interval=interval, block_size=layout.block_size, hash_block_size=layout.sizes.hash_size,
        group_sizes=layout.sizes.sizes, cache_unit=layout.sizes.unit,
        hit_group=next((g for g, s in enumerate(layout.groups) if not s.sparse and s.cached), 0),
        eagle_groups=eagle_layout(layout) if use_eagle else (),
        watermark_blocks=int(watermark * kv_cache_config.num_blocks),
        replay_tokens=max(s.prefix_replay_tokens for s in layout.specs),
        # (vLLM's hybrid coordinator applies them to EAGLE's dropping groups only: options.py)
        reprefill_tokens=max(0, num_prefill_lookahead - 1) if enable_caching and not layout.hybrid else 0,
        cached_groups=cached, retains=retains, junctions=retains or any(g.sparse for g in layout.groups),
        uncached=not all(cached), odd_hit=use_eagle or not all(cached), hybrid=layout.hybrid)
