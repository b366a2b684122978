"""Encoder-decoder models (Whisper): vLLM 0.33's cross-attention groups over prefixkv.

What vLLM does with a ``CrossAttentionSpec`` group (its ``CrossAttentionManager`` and its
coordinator): the ``allocate_slots`` call that schedules a request's encoder inputs
passes ``num_encoder_tokens``, and the group's table then covers that many positions,
``ceil(num_encoder_tokens / block_size)`` blocks from the one pool (the other calls pass
0 and take nothing); the blocks are counted with the decoder's in every check of the
pool (``full_sequence_must_fit``, ``reserved_blocks``, the watermark), taken after the
groups before it, never hashed, cached nor hit, and go back with the request's other
blocks when it is freed, group by group in vLLM's group order. vLLM runs these models
with prefix caching off (``SchedulerConfig(is_encoder_decoder=True)``); with it on, its
``CrossAttentionManager`` refuses the lookup.

Here the decoder's groups run on the plug-in's manager as before, built over the config
without the cross-attention groups; each cross-attention group's table of a request is
a request of its own in the same prefixkv manager (key ``("cross", group, request id)``,
a one-token placeholder prompt and lookahead slots for the rest: with caching off no
block of it is hashed, indexed or found), so the pool, its free order and
``check_invariants`` count it. Served: cross-attention groups after every decoder group,
at the scheduler's block size, beside one full-attention decoder group, caching off, no
metrics collector; refused with UnsupportedByPrefixKV otherwise, and for
``pop_blocks_for_free`` of a request holding cross-attention blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheConfig
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import blocks_for
from prefixkv.errors import check_count

from .coordinator import CoordinatorView, GroupView
from .layout import UnsupportedByPrefixKV, read_layout
from .manager import KVCacheManager
from .prepared import PreparedPrompts
from .requests import core_tokens

__all__ = ["CrossAttentionKVCacheManager", "cross_groups"]


def cross_groups(kv_cache_config: Any) -> tuple[int, ...]:
    """The indices of the cross-attention groups of ``kv_cache_config`` (by exact type)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return tuple(g for g, spec in enumerate(groups) if type(spec.kv_cache_spec) is CrossAttentionSpec)


class CrossGroupView(GroupView, CrossAttentionManager):
    """A cross-attention group as vLLM's ``CrossAttentionManager`` shows it (the
    ``GroupView`` snapshots: ``req_to_blocks``, ``num_cached_block``, always 0 here);
    nothing of vLLM's class runs (its ``__init__`` is not called)."""


class DecoderPrompts(PreparedPrompts):
    """The decoder's prompts: its token ids alone. A request's multimodal inputs are the
    encoder's (their positions are the encoder's, not the decoder prompt's), and with
    caching off no block is hashed (vLLM's requests then have no block hasher)."""

    def note(self, request: Any) -> None:
        """Nothing to prepare ahead."""

    def prompt_of(self, request: Any) -> Any:
        """The request's token ids, prepared without extra keys."""
        self.taken += 1
        return self._prepare(core_tokens(request))


class CrossCoordinatorView(CoordinatorView):
    """The coordinator of an encoder-decoder layout: the decoder's (``CoordinatorView``,
    whose growth checks the plug-in's calls use) and the cross-attention groups'."""

    def __init__(self, manager: CrossAttentionKVCacheManager, decoder: Any, specs: Sequence[Any]) -> None:
        super().__init__(manager, decoder)
        self._cross_manager = manager
        self.single_type_managers = (*self.single_type_managers,
                                     *(CrossGroupView(manager, g, s.block_size, s)
                                       for g, s in enumerate(specs) if g >= len(decoder.groups)))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[Any]], num_encoder_tokens: int,
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """The decoder groups' blocks (``CoordinatorView``) and, per cross-attention
        group, those that covering ``num_encoder_tokens`` positions takes beyond what
        the request holds (vLLM's coordinator)."""
        m = self._cross_manager
        dec = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[:m.num_decoder_groups], num_encoder_tokens,
            total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
            apply_admission_cap, prefill_end)
        return dec + m.cross_need(request_id, num_encoder_tokens) * len(m.cross)


class CrossAttentionKVCacheManager(KVCacheManager):
    """``KVCacheManager`` for a layout with cross-attention groups (module docstring):
    what it serves, and the UnsupportedByPrefixKV it raises at construction for the
    rest. ``num_decoder_groups``: the groups before the cross-attention ones;
    ``num_kv_cache_groups`` counts every group."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, *args: Any, **kwargs: Any) -> None:
        cross = cross_groups(kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        specs = tuple(g.kv_cache_spec for g in groups)
        # (the base's arguments after hash_block_size, by position or by name)
        caching = kwargs.get("enable_caching", args[1] if len(args) > 1 else True)
        collector = kwargs.get("metrics_collector", args[9] if len(args) > 9 else None)
        refusal = _refusal(cross, specs, scheduler_block_size, caching, collector)
        if refusal:
            raise UnsupportedByPrefixKV(f"prefixkv serves encoder-decoder cross-attention caches "
                                        f"{refusal}")
        decoder = dataclasses.replace(kv_cache_config, kv_cache_groups=groups[:cross[0]])
        super().__init__(decoder, max_model_len, scheduler_block_size, hash_block_size, *args, **kwargs)
        layout = read_layout(decoder, scheduler_block_size=scheduler_block_size,
                             hash_block_size=hash_block_size, enable_caching=bool(caching))
        if layout.hybrid:
            raise UnsupportedByPrefixKV("prefixkv serves encoder-decoder cross-attention caches "
                                        "beside one full-attention decoder group only (its hybrid "
                                        "manager has no caching switch)")
        self.kv_cache_config = kv_cache_config
        self.num_decoder_groups = cross[0]
        self.num_kv_cache_groups = len(groups)
        self.cross = cross
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        self.prepared_prompts = DecoderPrompts(self.core.prepare, self.hash_block_size)
        self._encoder: dict[str, int] = {}  # request id -> encoder positions its tables cover
        self.coordinator = CrossCoordinatorView(self, layout, specs)

    # ---- the cross-attention tables -------------------------------------------------------

    def cross_need(self, request_id: str, num_encoder_tokens: int) -> int:
        """Blocks one cross-attention group takes to cover ``num_encoder_tokens``
        positions of the request, beyond those it holds."""
        held = blocks_for(self._encoder.get(request_id, 0), self.block_size)
        return max(0, blocks_for(num_encoder_tokens, self.block_size) - held)

    def _cross_ids(self, request_id: str) -> list[tuple[int, ...]]:
        """The request's prefixkv block ids in each cross-attention group."""
        if request_id not in self._encoder:
            return [() for _ in self.cross]
        return [self.core.get_block_ids(("cross", g, request_id)) for g in self.cross]

    def _take_cross(self, request_id: str, num_encoder_tokens: int) -> list[tuple[int, ...]]:
        """Make each cross-attention table of the request cover ``num_encoder_tokens``
        positions, group by group; the blocks added per group (the pool was checked)."""
        held = self._encoder.get(request_id, 0)
        added: list[tuple[int, ...]] = []
        for g in self.cross:
            key = ("cross", g, request_id)
            if held:
                got = self.core.reserve(key, num_encoder_tokens - 1)
            else:
                adm = self.core.add_request(key, [0], num_new_tokens=1, read_cache=False,
                                            num_lookahead_tokens=num_encoder_tokens - 1)
                got = None if adm is None else adm.block_ids
            assert got is not None, "cross-attention blocks short after the pool was checked"
            added.append(tuple(got))
        self._encoder[request_id] = num_encoder_tokens
        return added

    def _wide(self, blocks: KVCacheBlocks, cross: Sequence[Sequence[int]]) -> KVCacheBlocks:
        """``blocks`` of the decoder groups with the cross-attention groups' after them."""
        table, k = self._blocks.table, self._blocks.offset
        groups = (*blocks.blocks[:self.num_decoder_groups], *([table[i + k] for i in g] for g in cross))
        return KVCacheBlocks(groups) if any(groups) else self.empty_kv_cache_blocks

    # ---- vLLM's calls -----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None
                            ) -> tuple[KVCacheBlocks, int, int]:
        """No hit (caching is off): empty blocks in every group, 0, 0."""
        _, n, junction = super().get_computed_blocks(request, max_cache_hit_length)
        return self.empty_kv_cache_blocks, n, junction

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = (),
                       ) -> KVCacheBlocks | None:
        """``KVCacheManager.allocate_slots`` for the decoder groups, and each
        cross-attention table made to cover ``num_encoder_tokens`` positions, every
        block counted in each check of the pool; the new blocks of every group, or None
        (nothing changed). Raises as ``KVCacheManager.allocate_slots`` (RequestError
        also for ``num_encoder_tokens`` not an int >= 0)."""
        check_count("num_encoder_tokens", num_encoder_tokens, 0, None)
        cross = self.cross_need(request.request_id, num_encoder_tokens) * len(self.cross)
        if cross and full_sequence_must_fit:  # (vLLM: the whole sequence's, watermark included)
            full = min(request.num_tokens, self.max_model_len)
            key = self.key_of(request.request_id)
            need = (self.coordinator.blocks_to_grow(key, full) if key is not None
                    else blocks_for(full, self.block_size)) + cross
            watermark = self.watermark_blocks if has_scheduled_reqs and request.status in (
                RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
            if need + watermark > self.core.num_free_blocks:
                return None
        narrow = None if new_computed_blocks is None else KVCacheBlocks(
            new_computed_blocks.blocks[:self.num_decoder_groups])
        out = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, narrow,
                                     num_lookahead_tokens, num_external_computed_tokens,
                                     delay_cache_blocks, 0, full_sequence_must_fit,
                                     reserved_blocks + cross, has_scheduled_reqs, skip_zeroing_group_ids)
        if out is None:
            return None
        if not cross:
            return self._wide(out, [() for _ in self.cross])
        return self._wide(out, self._take_cross(request.request_id, num_encoder_tokens))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group, the cross-attention groups' included."""
        return self._wide(super().get_blocks(request_id), self._cross_ids(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """vLLM's block ids of the request per group, the cross-attention groups' included."""
        return (*super().get_block_ids(request_id)[:self.num_decoder_groups],
                *self._blocks.vllm_ids(self._cross_ids(request_id)))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """The decoder groups' ids clipped to ``num_computed_tokens``; the
        cross-attention groups' whole (vLLM's)."""
        check_count("num_computed_tokens", num_computed_tokens, 0, None)
        ids = self.get_block_ids(request_id)
        cut = blocks_for(num_computed_tokens, self.block_size)
        return (*(g[:cut] for g in ids[:self.num_decoder_groups]), *ids[self.num_decoder_groups:])

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """``blocks`` cut to the first ``num_computed_tokens`` in every group."""
        cut = num_computed_tokens // self.block_size
        return KVCacheBlocks(tuple(list(g[:cut]) for g in blocks.blocks))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """0 per group, as vLLM's."""
        return [0] * self.num_kv_cache_groups

    def free(self, request: Request) -> None:
        """``KVCacheManager.free``, then each cross-attention table's blocks (vLLM's group
        order), tail first."""
        super().free(request)
        if self._encoder.pop(request.request_id, None) is not None:
            for g in self.cross:
                self.core.free(("cross", g, request.request_id))

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """``KVCacheManager.pop_blocks_for_free``. Raises UnsupportedByPrefixKV for a
        request holding cross-attention blocks (nothing changed)."""
        if request.request_id in self._encoder:
            raise UnsupportedByPrefixKV("prefixkv does not offer pop_blocks_for_free for a request "
                                        "holding cross-attention blocks")
        return super().pop_blocks_for_free(request)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Nothing is cached (caching is off): the ids are checked, nothing changes.
        Raises RequestError for ids that are not vLLM block ids."""
        self._blocks.core_ids(block_ids)


def _refusal(cross: tuple[int, ...], specs: tuple[Any, ...], block_size: int, enable_caching: Any,
             metrics_collector: Any) -> str:
    """Why the layout or options are not served ('' when they are)."""
    if not cross or cross[0] == 0 or cross != tuple(range(cross[0], len(specs))):
        return f"after every decoder group only, got them at groups {list(cross)} of {len(specs)}"
    if any(specs[g].block_size != block_size for g in cross):
        return (f"at the scheduler's block size {block_size} only, got "
                f"{[specs[g].block_size for g in cross]}")
    if enable_caching:
        return ("with prefix caching off only, as vLLM 0.33 runs encoder-decoder models (its "
                "CrossAttentionManager refuses lookups)")
    if metrics_collector is not None:
        return "without a KV cache metrics collector only"
    return ""
