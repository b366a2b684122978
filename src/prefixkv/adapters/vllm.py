"""vLLM v1 ``KVCacheManager``-shaped calls on top of ``prefixkv.KVCacheManager``.

A vLLM-style scheduler calls, per step::

    blocks, n_hit = m.get_computed_blocks(req)                       # waiting request
    new = m.allocate_slots(req, n_new, n_hit, blocks)                 # None: stop admitting
    new = m.allocate_slots(req, n_new)                                # running: None -> preempt
    m.free(req); m.get_block_ids(req_id); m.usage
    m.make_prefix_cache_stats(); m.take_events(); m.reset_prefix_cache()

Requests are read, never kept or changed: ``request_id``, ``all_token_ids`` (prompt then
outputs, the sampled token included), ``num_computed_tokens``, and optionally
``cache_salt``, ``lora_request.lora_name``, ``mm_features`` (``identifier`` and
``mm_position.offset/.length``), ``num_preemptions``; or ``extra_keys`` (an ExtraKeys).

Semantic differences from vLLM (each one has a test in tests/test_adapter_vllm.py):

1. Atomic lookup + allocate. prefixkv finds the hit and takes its blocks in one call
   (``add_request``), so ``get_computed_blocks`` is advisory: it returns the hit length
   and a ``ComputedBlocks`` holding no block ids (they are known only after
   ``allocate_slots``; read them with ``get_block_ids``). ``allocate_slots`` repeats the
   lookup; if the cache changed in between so that the hit differs from the
   ``num_new_computed_tokens`` passed in, it releases what it took and raises
   RequestError (a shorter hit would otherwise make the runner skip uncached KV).
2. Block ids are plain ints; prefixkv has one KV-cache group and no null block: block
   0 is a real block, all ``num_blocks`` count for ``usage``. The vLLM shapes are kept at
   the boundary: ``get_block_ids`` returns ``([ids],)`` and results offer
   ``get_block_ids()``.
3. Stats count successful admissions only: a request whose ``allocate_slots`` returned
   None is not counted (vLLM counts the lookup). A re-admission of a request with
   ``num_preemptions > 0`` goes to the ``preempted_*`` fields, as in vLLM.
4. Events are converted from prefixkv's one-block ``BlockStored`` to vLLM's shape:
   consecutive stores of one chain become one ``VllmBlockStored`` with several hashes;
   hashes are bytes (``hash_mode="sha256"`` makes them stable across processes);
   ``lora_id`` is always None (names only), ``medium`` is ``"GPU"``, and cache salts
   and multimodal keys are not carried (vLLM's optional ``extra_keys`` field).
5. ``free`` and ``get_block_ids`` accept unknown ids (no-op / ``([],)``) as vLLM does;
   prefixkv's own ``free`` raises RequestError for them.
6. Not supported, rejected with PrefixKVError before any change: lookahead slots
   (speculative decoding), external (connector) tokens, encoder tokens, delayed
   caching, and a running request asked to grow past its known tokens while part of its
   prompt is still unscheduled. ``get_num_common_prefix_blocks`` is not offered.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from prefixkv.errors import PrefixKVError, RequestError
from prefixkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.extra_keys import ExtraKeys, MultiModalInput
from prefixkv.core.manager import KVCacheManager

from .vllm_types import (
    BlockIds, ComputedBlocks, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, VllmEvent,
    VllmPrefixCacheStats,
)

__all__ = [
    "BlockIds", "ComputedBlocks", "VllmAllBlocksCleared", "VllmBlockRemoved", "VllmBlockStored",
    "VllmEvent", "VllmKVCacheManager", "VllmPrefixCacheStats", "VllmRequest", "extra_keys_of",
]


class VllmRequest(Protocol):
    """The attributes of a vLLM ``Request`` the adapter reads (others are optional)."""

    request_id: Hashable
    all_token_ids: Sequence[int]
    num_computed_tokens: int


def extra_keys_of(request: Any) -> ExtraKeys | None:
    """The request's ExtraKeys: its ``extra_keys`` if set, else built from ``cache_salt``,
    ``lora_request.lora_name`` and ``mm_features``. Raises ExtraKeysError when malformed."""
    given = getattr(request, "extra_keys", None)
    if given is not None:
        return given
    lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
    salt = getattr(request, "cache_salt", None)
    mm = tuple(MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
               for f in getattr(request, "mm_features", None) or ())
    if lora is None and salt is None and not mm:
        return None
    return ExtraKeys(lora=lora, cache_salt=salt, mm=mm)


class VllmKVCacheManager:
    """vLLM v1 ``KVCacheManager`` methods over ``manager`` (see the module docstring).

    ``log_stats``: ``make_prefix_cache_stats`` returns None when False, as in vLLM.
    Create ``manager`` with ``enable_events=True`` for ``take_events`` to see anything.
    The adapter must see every call for the requests it serves (it tracks how many of
    each request's tokens the manager knows).
    """

    def __init__(self, manager: KVCacheManager, *, log_stats: bool = True) -> None:
        self.manager = manager
        self.log_stats = log_stats
        self.empty_kv_cache_blocks = BlockIds()
        self._known: dict[Hashable, int] = {}  # request id -> tokens the manager holds
        self._reset = False

    @property
    def block_size(self) -> int:
        """The wrapped manager's tokens per block."""
        return self.manager.block_size

    @property
    def usage(self) -> float:
        """Fraction of all ``num_blocks`` held by live requests (no null block)."""
        return self.manager.usage

    def get_computed_blocks(self, request: VllmRequest) -> tuple[ComputedBlocks, int]:
        """The cached prefix a new (or preempted) request would reuse now: at most
        ``len(all_token_ids) - 1`` tokens, a multiple of block_size. Changes nothing."""
        n = self.manager.lookup(request.all_token_ids, extra=extra_keys_of(request))
        return ComputedBlocks(n), n

    def allocate_slots(self, request: VllmRequest, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: ComputedBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       **_ignored: Any) -> BlockIds | None:
        """Slots for ``num_new_tokens`` tokens after the request's computed ones (and,
        for a request not yet admitted, after its ``num_new_computed_tokens`` cache hit).
        Returns the newly allocated blocks, or None on shortage (nothing changed).
        Raises PrefixKVError for unsupported arguments, RequestError when the hit
        changed since ``get_computed_blocks`` (nothing changed but the stats), and as
        ``KVCacheManager`` for bad tokens or counts."""
        if num_lookahead_tokens or num_external_computed_tokens or num_encoder_tokens or delay_cache_blocks:
            raise PrefixKVError(
                "lookahead, external, encoder tokens and delayed caching are not supported "
                f"(got {num_lookahead_tokens}, {num_external_computed_tokens}, "
                f"{num_encoder_tokens}, {delay_cache_blocks})")
        rid, tokens = request.request_id, request.all_token_ids
        if rid not in self._known:
            return self._admit(request, num_new_tokens, num_new_computed_tokens)
        known = self._known[rid]
        target = request.num_computed_tokens + num_new_tokens
        scheduled = self.manager.num_scheduled_tokens(rid)
        if target <= known:
            if target <= scheduled:
                return self.empty_kv_cache_blocks
            new = self.manager.extend(rid, target - scheduled)
        elif scheduled < known:
            raise PrefixKVError(
                f"request {rid!r}: {known - scheduled} prompt tokens are unscheduled, so it "
                f"cannot grow to {target} tokens past its {known} known ones in one call")
        else:
            new = self.manager.append_tokens(rid, tokens[known:target])
            if new is not None:
                self._known[rid] = target
        return None if new is None else BlockIds(new)

    def _admit(self, request: VllmRequest, num_new_tokens: int, expected_hit: int) -> BlockIds | None:
        rid, tokens = request.request_id, request.all_token_ids
        if request.num_computed_tokens:
            raise PrefixKVError(f"request {rid!r} is not allocated but has "
                                f"{request.num_computed_tokens} computed tokens")
        adm = self.manager.add_request(rid, tokens, extra=extra_keys_of(request),
                                       num_new_tokens=num_new_tokens,
                                       resumed=getattr(request, "num_preemptions", 0) > 0)
        if adm is None:
            return None
        if adm.num_cached_tokens != expected_hit:
            self.manager.free(rid)
            raise RequestError(
                f"request {rid!r}: the cache now holds {adm.num_cached_tokens} of its tokens, "
                f"not the {expected_hit} get_computed_blocks reported; call it again")
        self._known[rid] = len(tokens)
        return BlockIds(adm.block_ids[adm.num_cached_tokens // self.block_size:])

    def free(self, request: VllmRequest) -> None:
        """Release the request's blocks (tail first); a request holding none is a no-op."""
        rid = request.request_id
        if self._known.pop(rid, None) is not None:
            self.manager.free(rid)

    def get_block_ids(self, request_id: Hashable) -> tuple[list[int]]:
        """``([block ids in token order],)``; ``([],)`` for a request holding no blocks."""
        if request_id not in self._known:
            return ([],)
        return (list(self.manager.get_block_ids(request_id)),)

    def make_prefix_cache_stats(self) -> VllmPrefixCacheStats | None:
        """Stats since the previous call (get-and-reset), or None without ``log_stats``."""
        if not self.log_stats:
            return None
        t = self.manager.take_stats()
        out = VllmPrefixCacheStats(
            reset=self._reset, requests=t.requests, queries=t.queries, hits=t.hits,
            preempted_requests=t.preempted_requests, preempted_queries=t.preempted_queries,
            preempted_hits=t.preempted_hits)
        self._reset = False
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block when none is in use; returns whether it did."""
        done = self.manager.reset_prefix_cache()
        self._reset = self._reset or done
        return done

    def take_events(self) -> list[VllmEvent]:
        """The manager's events since the previous call, in vLLM's shape, oldest first."""
        out: list[VllmEvent] = []
        bs = self.block_size
        for e in self.manager.take_events():
            if isinstance(e, BlockStored):
                last = out[-1] if out else None
                lora = e.extra.lora if e.extra is not None else None
                if (isinstance(last, VllmBlockStored) and e.parent_block_hash == last.block_hashes[-1]
                        and last.lora_name == lora):
                    last.block_hashes.append(e.block_hash)
                    last.token_ids.extend(e.token_ids)
                else:
                    out.append(VllmBlockStored([e.block_hash], e.parent_block_hash,
                                               list(e.token_ids), bs, lora_name=lora))
            elif isinstance(e, BlockRemoved):
                out.append(VllmBlockRemoved([e.block_hash]))
            elif isinstance(e, AllBlocksCleared):
                out.append(VllmAllBlocksCleared())
        return out
