"""The vLLM manager's arguments besides its ``KVCacheConfig``, checked against the layout
read from it (layout.py): ``check_options`` refuses, naming it, what prefixkv does not
offer, before anything is built; ``eagle_layout`` says which groups match one block past
an EAGLE hit, or refuses a layout on which prefixkv does not find EAGLE's hits as vLLM does.
"""

from __future__ import annotations

from typing import Any

from prefixkv.errors import ConfigError

from .layout import FULL_SPECS, Layout, UnsupportedByPrefixKV

__all__ = ["check_options", "eagle_layout", "lookahead_beside_mamba", "lookahead_retention"]


def check_options(layout: Layout, *, use_eagle: bool, num_hash_lookahead_tokens: int,
                  watermark: float, num_prefill_lookahead: int = 0, enable_caching: bool = True) -> None:
    """Raises UnsupportedByPrefixKV for the manager's arguments prefixkv does not offer:
    EAGLE's shortened hits (``use_eagle``) but with full-attention and sliding-window
    groups of at most two specs, full attention one of them when two, and Mamba groups
    (vLLM's one-pass hit: ``eagle_layout``), lookahead hashing (``num_hash_lookahead_tokens`` > 0) with
    caching on but on one full-attention group whose block is the hash block (2 tokens or
    more) or beside Mamba (``lookahead_beside_mamba``), without ``use_eagle`` (vLLM's
    scheduler passes it off: lookahead.py),
    multi-module MTP's re-prefillable tokens with caching on (``num_prefill_lookahead``
    > 1: vLLM leaves the last ``num_prefill_lookahead - 1`` computed tokens uncached, as
    the drafter may prefill them again) but on one full-attention group (as vLLM,
    ConfigError beside EAGLE when a block is shorter: docs/lookahead.md), a negative
    ``watermark``."""
    if use_eagle:
        eagle_layout(layout)  # (its refusals)
    mamba = lookahead_beside_mamba(layout, use_eagle)
    if enable_caching and num_prefill_lookahead > 1 and layout.hybrid and not (
            mamba and num_hash_lookahead_tokens):  # (then P changes no caching: settings.py)
        raise UnsupportedByPrefixKV(f"prefixkv does not offer multi-module MTP's re-prefillable "
                                    f"tokens (num_prefill_lookahead={num_prefill_lookahead}: vLLM "
                                    f"caches the last {num_prefill_lookahead - 1} computed tokens "
                                    f"late) but on one full-attention group")
    drafted = use_eagle or any(layout.eagle_flags)  # (vLLM's eagle_group_ids)
    if enable_caching and drafted and layout.block_size < num_prefill_lookahead:
        raise ConfigError(f"multi-module MTP with prefix caching needs block_size "
                          f"({layout.block_size}) >= num_prefill_lookahead ({num_prefill_lookahead})")

    if num_hash_lookahead_tokens and enable_caching and not mamba and (
            layout.hybrid or use_eagle or layout.sizes.hash_size != layout.block_size
            or layout.block_size < 2):  # (1: the one token an admission schedules keys a block)
        raise UnsupportedByPrefixKV(f"prefixkv offers lookahead hashing (num_hash_lookahead_tokens="
                                    f"{num_hash_lookahead_tokens}) on one full-attention group whose "
                                    f"block is the hash block, of 2 tokens or more, or beside Mamba "
                                    f"groups with vLLM's fine-grained partial hits or at one block "
                                    f"size (Mamba and full-attention groups only), without use_eagle, "
                                    f"only")
    if watermark < 0:
        raise UnsupportedByPrefixKV(f"watermark must be >= 0, got {watermark}")


def lookahead_beside_mamba(layout: Layout, use_eagle: bool) -> bool:
    """Whether prefixkv serves lookahead hashing on ``layout`` beside Mamba groups
    (lookahead.py): full-attention groups (the hash block's size, of 2 tokens or more, or
    larger: their partial tail entry moves up as the request's tokens after its prompt
    become known, groups/partial_full.py) and Mamba groups only, with vLLM's fine-grained
    partial hits (a Mamba block larger than the hash block) or every group at one block
    size, the hash block's (the sized calls: groups/checkpoints.py ``_inside``), without
    ``use_eagle``.
    vLLM's hybrid coordinator then leaves multi-module MTP's re-prefillable tokens to
    EAGLE's dropping groups, none: they change no caching."""
    s, kinds = layout.sizes, {g.kind for g in layout.groups}
    return (not use_eagle and (s.partial or s.one_size and "mamba" in kinds) and s.hash_size >= 2
            and kinds <= {"mamba", "full_attention"})


def lookahead_retention(layout: Layout) -> None:
    """Raises UnsupportedByPrefixKV for lookahead hashing beside Mamba at one block size
    with a retention interval (``layout`` read with its groups' ``retention``): vLLM then
    keeps the state where a step ends at the prompt's boundary ``(p - L) // b * b``
    unless the step checkpoints (its ``_cache_partial_tail_block``), which prefixkv's
    marks do not follow (docs/lookahead.md, "At one block size")."""
    if not layout.sizes.partial and any(g.retention is not None for g in layout.groups):
        raise UnsupportedByPrefixKV("prefixkv does not offer lookahead hashing (num_hash_lookahead_tokens) "
                                    "beside Mamba at one block size with prefix_cache_retention_interval "
                                    "set (vLLM keeps the state at the prompt's lookahead boundary)")


def eagle_layout(layout: Layout) -> tuple[bool, ...]:
    """The groups that match one block past an EAGLE hit (vLLM 0.33: the groups flagged
    ``is_eagle_group``, its draft model's, and those of the same spec; every group when
    none is flagged), never a Mamba group (vLLM's Mamba lookup drops nothing). Raises
    UnsupportedByPrefixKV unless prefixkv finds EAGLE's shortened hits on ``layout`` as
    vLLM does: every group full attention, sliding window or Mamba (vLLM's chunked local
    attention refuses EAGLE), beside Mamba every group at one block size (with Mamba's
    checkpoint blocks too: ``BlockSizes.eagle`` then moves them to EAGLE's replay
    boundary, groups/checkpoints.py), or vLLM's fine-grained partial hits with full
    attention of one block size (the hash block's or larger: groups/partial_eagle.py;
    vLLM moves Mamba's partial entries and checkpoints to EAGLE's replay boundary:
    ``BlockSizes.eagle``), and at most two distinct
    specs, one of them full attention when two (vLLM's hit is then one pass; with more it applies
    the dropped block once per candidate, and a group that already dropped it is checked
    again without: ``kv_cache_coordinator``)."""
    kinds = {g.kind for g in layout.groups}
    sizes = layout.sizes
    if "mamba" in kinds and not sizes.one_size and not (
            sizes.partial and len(
                {b for g, b in zip(layout.groups, sizes.sizes, strict=True) if not g.sparse}) == 1):
        raise UnsupportedByPrefixKV(f"prefixkv offers EAGLE's shortened hits (use_eagle) beside a Mamba "
                                    f"group at one block size, or with vLLM's fine-grained partial hits "
                                    f"beside full attention of one block size, only, got {sizes}")
    if not all(g.cached for g in layout.groups):
        raise UnsupportedByPrefixKV("prefixkv does not offer EAGLE's shortened hits (use_eagle) "
                                    "beside SWA bounded replay (an uncached window)")
    if not kinds <= {"full_attention", "sliding_window", "mamba"}:
        raise UnsupportedByPrefixKV(f"prefixkv offers EAGLE's shortened hits (use_eagle) on "
                                    f"full-attention, sliding-window and Mamba groups only, got "
                                    f"{sorted(kinds)}")
    distinct: list[Any] = []
    for spec in layout.specs:
        if spec not in distinct:
            distinct.append(spec)
    if len(distinct) > 2 or (len(distinct) == 2 and not any(type(s) in FULL_SPECS for s in distinct)):
        raise UnsupportedByPrefixKV(f"prefixkv offers EAGLE's shortened hits (use_eagle) beside "
                                    f"one other group spec at most, a full-attention one of the "
                                    f"two, got {len(distinct)} specs")
    flags = layout.eagle_flags if any(layout.eagle_flags) else (True,) * len(layout.specs)
    return tuple(not g.sparse and any(f for s, f in zip(layout.specs, flags, strict=True) if s == spec)
                 for g, spec in zip(layout.groups, layout.specs, strict=True))
