"""vLLM v1 ``KVCacheManager``-shaped calls on top of ``prefixkv.groups.HybridKVCacheManager``:
one block table per layer group (full attention, sliding window, chunked local), as
vLLM's hybrid coordinator keeps them.

The calls, their arguments and their semantics are ``VllmKVCacheManager``'s (see
``prefixkv.adapters.vllm``), and so are its differences 1 and 3 to 11 (2, its block ids,
is replaced by difference 1 below; 4 and 7 are extended by 5 and 3); results
name block ids per group: ``allocate_slots`` returns a ``GroupBlockIds`` and
``get_block_ids`` one list per group, in group order, as vLLM's
``KVCacheBlocks.get_block_ids()``. The hit is the longest prefix every group can serve
(``prefixkv.groups.hits``), the same length as vLLM's coordinator finds for the
scenarios of tests/test_vllm_conformance_groups.py. Where a windowed group's table holds
blocks no query reads, its entries are the null block, as in vLLM.

Differences from vLLM's manager beyond those of the one-group adapter, each asserted by a
``test_difference_<n>_*`` test in tests/test_adapter_vllm_hybrid.py:

1. Block ids: when some group releases blocks, block 0 is the null block (as in vLLM, so
the ids of vLLM's scenarios are the same) and ``usage`` leaves it out; with full
attention only there is no null block and block 0 is real (vLLM's ids are ours + 1).
2. A window moves when ``allocate_slots`` schedules known tokens, at the first one of
them: a call that returns None, or that only reserves slots for tokens not known yet
(asynchronous scheduling, lookahead), releases nothing, and a release lags until the
next call that schedules tokens. vLLM releases in every call, at the tokens processed
so far (``num_computed_tokens``, less those of steps in flight in its newest versions),
also in one that then returns None for lack of blocks.
3. ``full_sequence_must_fit`` asks for every group's blocks of the whole sequence and
the lookahead, windows not deducted (a conservative gate; vLLM counts what each group
would allocate).
4. A running request whose ``all_token_ids`` grew before its prompt was fully scheduled
raises RequestError before any change (the one-group adapter appends them; here their
step would start past queries of the same step that still read the window).
5. Events: each group caches its own block of a content, so a content is announced once
per group that caches it; vLLM's shapes carry no group index, so a consumer that must
tell the groups apart reads the manager's own ``take_events()`` (``GroupBlockStored``:
``group_idx`` and spec) instead of ``take_events`` here.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from prefixkv.errors import RequestError
from prefixkv.groups import GroupAdmission, HybridKVCacheManager

from .vllm import VllmKVCacheManager
from .vllm_types import GroupBlockIds

__all__ = ["GroupBlockIds", "VllmHybridKVCacheManager"]

Ids = tuple[tuple[int, ...], ...]


class VllmHybridKVCacheManager(VllmKVCacheManager):
    """vLLM v1 ``KVCacheManager`` methods over a ``HybridKVCacheManager`` (see the
    module docstring). ``log_stats``, events and the rule that the adapter sees every
    call: as ``VllmKVCacheManager``."""

    def __init__(self, manager: HybridKVCacheManager, *, log_stats: bool = True) -> None:
        self._none: Ids = ((),) * len(manager.groups)
        super().__init__(manager, log_stats=log_stats)  # type: ignore[arg-type]

    def _per_group(self, adm: GroupAdmission) -> Ids:  # type: ignore[override]
        return adm.group_block_ids

    def _ids_of(self, rid: Hashable) -> Ids:
        return self.manager.get_block_ids(rid)  # type: ignore[return-value]

    def _wrap(self, ids: Ids) -> GroupBlockIds:
        return GroupBlockIds(ids)

    def _taken(self, new: Any) -> Ids:
        assert new is not None, "growth was short of blocks after the pool was checked"
        return new

    def _need(self, rid: Hashable, slots: int, nblocks: int, schedules: bool) -> int:
        """Free blocks the growth takes: net of what its window release returns when
        it schedules known tokens (difference 2), every group's table otherwise."""
        if schedules:
            return self.manager.num_blocks_to_allocate(rid, slots)  # type: ignore[attr-defined]
        return max(0, -(-slots // self.block_size) - nblocks) * len(self._none)

    def _check_mid_prefill(self, rid: Hashable) -> None:
        raise RequestError(f"request {rid!r}: its tokens grew before its prompt was fully "
                           f"scheduled (difference 4 of prefixkv.adapters.vllm_hybrid)")
