"""The KV cache layout vLLM hands its manager, read into prefixkv's terms, or refused.

vLLM describes a model's KV cache as a ``KVCacheConfig``: ``num_blocks`` blocks (block 0
is vLLM's null block) and one ``KVCacheGroupSpec`` per group of layers that share a
block table. ``read_layout`` maps each group's spec to a ``prefixkv.groups.GroupSpec``
(full attention, MLA included; sliding window; chunked local attention; Mamba in
``align`` mode, or in ``none`` mode with caching off) and refuses,
before anything is built, whatever prefixkv does not offer, naming it (the manager's
other arguments: options.py); ``build_core`` builds the prefixkv manager a layout runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.core.manager import KVCacheManager
from prefixkv.errors import ConfigError
from prefixkv.groups import (
    BlockSizes,
    GroupSpec,
    HybridKVCacheManager,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)

__all__ = ["FULL_SPECS", "VLLM_VERSION", "Layout", "UnsupportedByPrefixKV", "build_core", "read_layout"]

VLLM_VERSION = "0.33.0"
"""The vLLM release this integration is written against and tested with (pinned)."""


class UnsupportedByPrefixKV(ConfigError):
    """vLLM asked for something prefixkv does not offer; the message names it."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What the manager needs of a ``KVCacheConfig``: the groups in vLLM's order, the
    block size vLLM's scheduler sees (``scheduler_block_size``: the groups' one size, or
    the lcm of theirs), vLLM's ``num_blocks`` (null block included), vLLM's specs, each
    group's block size with the hash block size and the alignment of hits (``sizes``:
    ``hash_block_size`` and ``scheduler_block_size``), and which groups vLLM flags as
    EAGLE's (``is_eagle_group``: its draft model's layers)."""

    groups: tuple[GroupSpec, ...]
    block_size: int
    num_blocks: int
    specs: tuple[Any, ...]
    sizes: BlockSizes
    eagle_flags: tuple[bool, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Whether it takes ``prefixkv.groups.HybridKVCacheManager`` (several groups, or
        one that is not full attention) rather than ``prefixkv.KVCacheManager``."""
        return len(self.groups) > 1 or self.groups[0] != full_attention()


FULL_SPECS = (FullAttentionSpec, MLAAttentionSpec)
"""vLLM's full-attention specs, matched by exact type: a subclass may change what a block
holds (vLLM's RSWASpec, SinkFullAttentionSpec, HiddenStateCacheSpec, SlidingWindowMLASpec
are subclasses)."""


_HISPARSE = ("vLLM 0.33 runs it in its own managers' insides (a HiSparseCoordinator over its "
             "HiSparse single-type managers and BlockPool: unpinned pages, a primary host pool "
             "published late), which prefixkv's pool and groups do not have; "
             "docs/integration.md, \"HiSparse\"")


def _group_of(spec: Any, enable_caching: bool) -> GroupSpec:
    kind = type(spec)
    if kind in FULL_SPECS:
        return full_attention()
    if kind is SlidingWindowSpec or kind is SlidingWindowMLASpec:
        # ``extra_retained_tokens`` (multi-module speculative decoding): vLLM keeps that
        # many tokens below the window (``get_num_skipped_tokens``) but judges a hit by
        # the window alone (``_contiguous_blocks_for_hit``): GroupSpec's ``retained``.
        # The MLA one (vLLM's same SlidingWindowManager) with ``bounded_replay`` is not
        # ``prefix_cacheable``: an uncached window (its scheduler replays the window below
        # a hit, ``prefix_replay_tokens``)
        return sliding_window(spec.sliding_window, getattr(spec, "extra_retained_tokens", 0),
                              cached=bool(spec.prefix_cacheable))
    if kind is ChunkedLocalAttentionSpec:
        return chunked_local(spec.attention_chunk_size)
    if kind is MambaSpec:
        return _mamba_group(spec, enable_caching)
    what = {"CrossAttentionSpec": "encoder-decoder cross-attention caches",
            "EncoderOnlyAttentionSpec": "encoder-only attention caches"}.get(kind.__name__)
    if "HiSparse" in kind.__name__:
        raise UnsupportedByPrefixKV(f"prefixkv does not offer HiSparse caches ({kind.__name__}): "
                                    f"{_HISPARSE}")
    what = what or f"KV cache spec {kind.__name__}"
    raise UnsupportedByPrefixKV(f"prefixkv does not offer {what}; supported: full attention "
                                f"(MLA included), sliding window, chunked local attention, "
                                f"Mamba with mamba_cache_mode='align' (or 'none', caching off)")


def _mamba_group(spec: MambaSpec, enable_caching: bool) -> GroupSpec:
    """A Mamba group in vLLM's ``align`` mode, its ``num_speculative_blocks`` held past
    its state block (``mamba(ahead=S)``, groups/spec_states.py; its checkpoint blocks:
    checkpoints.py), or in its ``none`` mode with caching off: no state is
    cached, a request holds the block of its last computed token's state and those
    after it (vLLM's ``MambaManager`` there is its base manager, releasing the blocks
    below ``get_num_skipped_tokens(n) = n - 1``): a window of 2 tokens, the query's
    own and the one before (``groups.spec``: the same ``first_needed``), holding its
    ``num_speculative_blocks`` past the row's end (vLLM counts ``num_tokens +
    num_speculative_blocks * block_size`` there: ``GroupSpec.ahead``). Raises
    ConfigError for ``none`` with caching on (vLLM asserts it), UnsupportedByPrefixKV
    for the rest, naming what is missing."""
    if spec.mamba_cache_mode == "none":
        if enable_caching:
            raise ConfigError("Mamba layers with mamba_cache_mode='none' run with prefix caching "
                              "off (enable_caching=False), as vLLM asserts; caching needs 'align'")
        return sliding_window(2, ahead=spec.num_speculative_blocks)
    if spec.mamba_cache_mode != "align":
        raise UnsupportedByPrefixKV(f"prefixkv offers Mamba layers with mamba_cache_mode='align' "
                                    f"or 'none' only, got {spec.mamba_cache_mode!r}")
    return mamba(ahead=spec.num_speculative_blocks)


def read_layout(kv_cache_config: KVCacheConfig, *, scheduler_block_size: int, hash_block_size: int,
                dcp_world_size: int = 1, pcp_world_size: int = 1, enable_caching: bool = True) -> Layout:
    """The layout of ``kv_cache_config``. Raises UnsupportedByPrefixKV for what prefixkv
    does not offer: a group spec other than full / sliding-window / chunked-local
    attention, align-mode Mamba and, with ``enable_caching`` off, none-mode Mamba
    (none-mode Mamba with caching on: ConfigError as vLLM's assert, prefill-checkpoint
    blocks where ``checkpoints.read_checkpoints`` refuses them, HiSparse, encoder-only
    and cross-attention caches, ...), a HiSparse
    host pool, decode or prefill context parallelism (``dcp_world_size`` or
    ``pcp_world_size`` > 1), and where the block sizes of groups, scheduler and hashes
    are not one (``_check_sizes``; with ``enable_caching`` off the hash block is the
    groups' gcd where vLLM's is not a divisor of each: nothing is hashed): groups of
    sizes that are not multiples of ``hash_block_size`` or do not divide
    ``scheduler_block_size``, or beside chunked local attention, a single
    full-attention group of another size than the scheduler's or the hashes', and Mamba
    where vLLM turns its fine-grained partial hits on but beyond what prefixkv serves
    of them (``_check_partial_hits``; what it serves gets ``sizes.partial``)."""
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise UnsupportedByPrefixKV(
            f"prefixkv does not offer context parallelism (dcp_world_size={dcp_world_size}, "
            f"pcp_world_size={pcp_world_size}; both must be 1)")
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        raise UnsupportedByPrefixKV(f"prefixkv does not offer HiSparse (a host pool of "
                                    f"{kv_cache_config.hisparse_host_num_blocks} blocks): {_HISPARSE}")
    specs = tuple(g.kv_cache_spec for g in kv_cache_config.kv_cache_groups)
    if not specs:
        raise UnsupportedByPrefixKV("a KV cache config without groups (attention-free "
                                    "models) has no blocks for prefixkv to manage")
    groups = tuple(_group_of(s, enable_caching) for s in specs)
    if not any(g.cached for g in groups):
        raise UnsupportedByPrefixKV("a KV cache config whose groups are all uncached "
                                    "(prefix_cacheable False) has no hit to look up; vLLM "
                                    "asserts one cacheable group")
    sizes = tuple(s.block_size for s in specs)
    if not enable_caching and any(b % hash_block_size for b in sizes):
        # (caching off: vLLM passes its scheduler's block, the groups' lcm, as the hash
        # block, and hashes nothing; prefixkv's groups count in their gcd)
        hash_block_size = math.gcd(*sizes)
    partial = False
    if set(sizes) != {scheduler_block_size} or hash_block_size != scheduler_block_size:
        _check_sizes(groups, sizes, scheduler_block_size, hash_block_size)
        partial = _check_partial_hits(kv_cache_config, hash_block_size)
    if kv_cache_config.num_blocks < 2:
        raise UnsupportedByPrefixKV(f"num_blocks must leave a block beside vLLM's null "
                                    f"block, got {kv_cache_config.num_blocks}")
    flags = tuple(bool(getattr(g, "is_eagle_group", False)) for g in kv_cache_config.kv_cache_groups)
    from .checkpoints import read_checkpoints  # (it imports this module)
    ck = read_checkpoints(kv_cache_config, partial,
                          set(sizes) == {scheduler_block_size} and hash_block_size == scheduler_block_size)
    return Layout(groups, scheduler_block_size, kv_cache_config.num_blocks, specs,
                  BlockSizes.of(sizes, hash_block_size, scheduler_block_size, partial=partial,
                                checkpoints=ck is not None, checkpoint_alignment=ck), flags)


def _check_sizes(groups: tuple[GroupSpec, ...], sizes: tuple[int, ...], scheduler: int, hashes: int) -> None:
    """Raises UnsupportedByPrefixKV unless prefixkv's hybrid manager is given the layout
    of ``groups`` at block ``sizes`` when the scheduler's block size or the hashes' is
    not the groups' one size (docs/groups.md): full-attention, sliding-window and Mamba
    groups, each of a size that is a multiple of ``hashes`` and divides ``scheduler``
    (vLLM's own asserts), and not a single full-attention group
    (``prefixkv.KVCacheManager``, which has one size)."""
    got = f"got groups {list(sizes)}, scheduler {scheduler}, hash {hashes}"
    kinds = {g.kind for g in groups}
    if len(groups) == 1 and kinds == {"full_attention"}:
        raise UnsupportedByPrefixKV(f"prefixkv needs one block size for a full-attention "
                                    f"model's group, scheduler and hashes, {got}")
    if not kinds <= {"full_attention", "sliding_window", "mamba"}:
        raise UnsupportedByPrefixKV(f"prefixkv offers groups of different block sizes (or a "
                                    f"scheduler or hash block size other than theirs) for "
                                    f"full-attention, sliding-window and Mamba groups only, got "
                                    f"{sorted(kinds)}; {got}")
    if any(b % hashes or scheduler % b for b in sizes):
        raise UnsupportedByPrefixKV(f"prefixkv offers groups of different block sizes each a "
                                    f"multiple of the hash block size and a divisor of the "
                                    f"scheduler's, {got}")


def _check_partial_hits(kv_cache_config: KVCacheConfig, hashes: int) -> bool:
    """Whether vLLM 0.33 turns on its fine-grained partial hits here
    (``partial_hash_hits_enabled``, asked with the managers vLLM makes for these
    groups: a Mamba group in align mode larger than the hash block, and every other
    group able to look up at the hash block): its hits may then end between the lcm's
    multiples, on a Mamba state cached inside a block (copied on write when the
    request goes on). prefixkv's hybrid manager serves them (``BlockSizes.partial``,
    docs/groups.md "Partial hits") with Mamba groups of one size and full-attention
    groups, at least one, all of one size, a multiple of the hash block (larger: vLLM
    then looks up inside its blocks too, groups/partial_full.py), or of two sizes, one
    the hash block's, each of one spec; raises UnsupportedByPrefixKV for the rest (full
    attention of two sizes larger than the hash block, or of several specs at a size; a
    window of the hash block's size; Mamba alone)."""
    from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    groups = kv_cache_config.kv_cache_groups
    if not any(type(g.kv_cache_spec) is MambaSpec for g in groups):
        return False
    managers = [KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec, g.role) for g in groups]
    if not partial_hash_hits_enabled(groups, hashes, 1, managers):
        return False
    mamba = {g.kv_cache_spec.block_size for g in groups if type(g.kv_cache_spec) is MambaSpec}
    rest = {(type(g.kv_cache_spec) in FULL_SPECS, g.kv_cache_spec.block_size)
            for g in groups if type(g.kv_cache_spec) is not MambaSpec}
    # (two sizes: one of the hash block's; vLLM looks each spec up once, in the order of its
    # first group, and prefixkv each size: one spec per size)
    two = len(rest) == 2 and min(b for _, b in rest) == hashes and len(
        {g.kv_cache_spec for g in groups if type(g.kv_cache_spec) is not MambaSpec}) == 2
    if len(mamba) != 1 or len(rest) != 1 and not two or any(not full or b % hashes for full, b in rest):
        raise UnsupportedByPrefixKV(
            f"prefixkv offers vLLM's fine-grained partial hits (a Mamba group of block size "
            f"{max(mamba)} beyond the hash block {hashes}, beside groups that all look up at "
            f"the hash block) with Mamba groups of one size beside full-attention groups of one "
            f"size, a multiple of the hash block, or of two, one the hash block's, each of one "
            f"spec, only, got {[type(g.kv_cache_spec).__name__ for g in groups]} of "
            f"{[g.kv_cache_spec.block_size for g in groups]}; docs/groups.md")
    return True


def build_core(layout: Layout, *, enable_caching: bool, enable_events: bool,
               peek: tuple[bool, ...] = (), lookahead: int = 0, eagle: bool = False,
               shared_prefix: bool = False) -> tuple[Any, int]:
    """prefixkv's manager for ``layout`` (sha256 hashes) and the offset from its block
    ids to vLLM's (``pool.Blocks``): ``prefixkv.KVCacheManager`` over the blocks past
    vLLM's null block (offset 1); when ``layout.hybrid``, the hybrid manager, over every
    block with its own null block at 0 when a group releases blocks (offset 0), else
    over the blocks past vLLM's (offset 1). ``enable_caching`` is passed to either
    (the hybrid manager's off records nothing: vLLM reuses the blocks first). ``peek``: EAGLE's groups
    (``options.eagle_layout``; none without EAGLE), which with different block sizes cache the
    block after each aligned end too (``BlockSizes.peek``); ``eagle``: vLLM's ``use_eagle``
    beside partial hits (``BlockSizes.eagle``); ``shared_prefix``: vLLM's Mamba
    shared-prefix checkpoints beside it (``BlockSizes.shared_prefix``). ``lookahead``: the
    manager's blocks keyed with that many tokens after them (``core.lookahead``,
    ``groups.lookahead``; not with ``enable_events`` beside other groups:
    UnsupportedByPrefixKV)."""
    if layout.hybrid:
        releasing = any(g.releases for g in layout.groups)
        s = layout.sizes
        # (one size: the one-size manager's int, but with checkpoints: the sized calls)
        sizes = layout.block_size if s.one_size and not s.checkpoints else BlockSizes.of(
            s.sizes, s.hash_size, s.align, peek, s.partial, s.checkpoints, s.checkpoint_alignment or None,
            eagle and (s.partial or s.checkpoints), shared_prefix and eagle and s.partial)
        if lookahead and enable_events:
            raise UnsupportedByPrefixKV("prefixkv does not offer KV events with lookahead hashing "
                                        "beside other groups")
        try:
            core: Any = HybridKVCacheManager(
                layout.groups, layout.num_blocks - (0 if releasing else 1), sizes,
                hash_mode="sha256", enable_events=enable_events, enable_caching=enable_caching,
                hash_lookahead_tokens=lookahead)
        except ConfigError as e:
            if layout.sizes.one_size:
                raise
            raise UnsupportedByPrefixKV(f"prefixkv's hybrid manager does not take this layout "
                                        f"of block sizes ({layout.sizes}): {e}") from e
        return core, 0 if releasing else 1
    if lookahead:
        core = LookaheadKVCacheManager(layout.num_blocks - 1, layout.block_size, hash_mode="sha256",
                                       enable_events=enable_events, hash_lookahead_tokens=lookahead)
        return core, 1
    core = KVCacheManager(layout.num_blocks - 1, layout.block_size, hash_mode="sha256",
                          enable_caching=enable_caching, enable_events=enable_events)
    return core, 1
