"""vLLM v1 ``KVCacheManager``-shaped calls on top of ``prefixkv.KVCacheManager``.

A vLLM-style scheduler calls, per step::

    blocks, n_hit = m.get_computed_blocks(req)                    # waiting request
    new = m.allocate_slots(req, n_new, n_hit, blocks)              # None: stop admitting
    new = m.allocate_slots(req, n_new, num_lookahead_tokens=k)     # running: None -> preempt
    m.free(req); m.get_block_ids(req_id); m.usage
    m.make_prefix_cache_stats(); m.take_events(); m.reset_prefix_cache()

``allocate_slots`` makes the blocks cover positions ``[0, num_computed_tokens +
num_new_tokens + num_lookahead_tokens)`` (for a request not yet admitted,
``num_new_computed_tokens`` is its hit and ``num_computed_tokens`` is 0). Positions whose
tokens are in ``all_token_ids`` are scheduled and cached as their blocks fill; the others
(the token a step still in flight will sample, under asynchronous scheduling; drafts;
lookahead) get reserved slots, and their tokens are appended when a later call finds
them in ``all_token_ids``. ``full_sequence_must_fit`` allocates only if blocks for all
known tokens and the lookahead are free now; ``has_scheduled_reqs`` only switches vLLM's
watermark, which prefixkv does not have (as vLLM with ``watermark=0``). A request's
``skip_reading_prefix_cache`` (prompt logprobs, pooling) makes it use no hit. What is
read from a request: ``prefixkv.adapters.vllm_request``.

Differences from vLLM's own manager, all listed here. Each is asserted by a
``test_difference_<n>_*`` test in tests/test_adapter_vllm.py, and where a replayed vLLM
scenario meets it, in tests/test_vllm_conformance.py:

1. Atomic lookup + allocate: ``get_computed_blocks`` is advisory (its ``ComputedBlocks``
names no block ids; read them with ``get_block_ids`` after ``allocate_slots``), and
``allocate_slots`` repeats the lookup, also when vLLM would skip it. If the hit is not
``num_new_computed_tokens``, it releases what it took, withdraws the blocks it
scheduled (not findable, announced by ``BlockRemoved``), leaves the stats unchanged
and raises RequestError; blocks evicted to make room stay evicted.
2. Block ids are plain ints; one KV-cache group, no null block: block 0 is real and all
``num_blocks`` count for ``usage`` (vLLM's ids are ours + 1). ``get_block_ids``
returns ``([ids],)`` and results offer ``get_block_ids()``, as in vLLM.
3. Stats count successful admissions only (a None from ``allocate_slots`` is not
counted); re-admissions (``num_preemptions > 0``) go to ``preempted_*`` and requests
that skip reading the cache are not counted, as in vLLM.
4. Events: a content is announced once, so a duplicate block (computed by a request that
skips reading the cache) is not announced again. Hashes are bytes (use
``hash_mode="sha256"`` for ids stable across processes); cache salts, multimodal keys
and vLLM's group and spec fields are not carried (see ``to_vllm_events``).
5. ``free`` and ``get_block_ids`` accept unknown ids (no-op / ``([],)``) as vLLM does;
prefixkv's own ``free`` raises RequestError for them.
6. ``free`` withdraws the full blocks past the request's ``num_computed_tokens`` (e.g.
a request preempted in the step that scheduled them); vLLM keeps them findable.
7. ``full_sequence_must_fit`` counts the lookahead slots too (vLLM: the tokens only).
8. ``get_computed_blocks`` returns two values; vLLM's newest adds a third,
``shared_prefix_boundary``, which is 0 without sparse-retention layer groups.
9. Rejected with PrefixKVError before any change: ``num_external_computed_tokens`` (KV
connectors), ``delay_cache_blocks``, ``num_encoder_tokens``, ``reserved_blocks``
other than their defaults, and unknown keywords. Not offered:
``get_num_common_prefix_blocks``, EAGLE's shortened hits. Several layer groups:
``prefixkv.adapters.vllm_hybrid.VllmHybridKVCacheManager`` (the same calls over a
``prefixkv.groups.HybridKVCacheManager``, with its own differences listed there).
10. Token ids must be ints in ``[0, 2**32)`` (below ``vocab_size`` if set): TokenError
otherwise (vLLM hashes any int).
11. A request the pool can never hold (its prompt, or the call's blocks with the
lookahead, need more blocks than the pool has) makes ``allocate_slots`` raise
PromptTooLongError before any change, where vLLM's manager returns None, which its
scheduler would meet at every step. vLLM refuses such a prompt before it reaches the
scheduler (past ``max_model_len``, which it checks at startup fits the KV cache); an
integration finishes the request with that error. A running request that outgrows the
pool gets None, and its re-admission after preemption raises.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from prefixkv.core.manager import KVCacheManager
from prefixkv.errors import PrefixKVError, RequestError, check_count, check_flag
from prefixkv.hashing import encode_tokens
from prefixkv.stats import PrefixCacheStats

from .vllm_events import to_vllm_events
from .vllm_request import VllmRequest, extra_keys_of, reads_cache, reject_unsupported
from .vllm_types import (
    BlockIds, ComputedBlocks, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, VllmEvent,
    VllmPrefixCacheStats,
)

__all__ = [
    "BlockIds", "ComputedBlocks", "VllmAllBlocksCleared", "VllmBlockRemoved", "VllmBlockStored",
    "VllmEvent", "VllmKVCacheManager", "VllmPrefixCacheStats", "VllmRequest", "extra_keys_of",
    "to_vllm_events",
]

class VllmKVCacheManager:
    """vLLM v1 ``KVCacheManager`` methods over ``manager`` (see the module docstring).

    ``log_stats``: ``make_prefix_cache_stats`` returns None when False, as in vLLM.
    Create ``manager`` with ``enable_events=True`` for ``take_events`` to see anything.
    The adapter must see every call for the requests it serves.
    """

    def __init__(self, manager: KVCacheManager, *, log_stats: bool = True) -> None:
        self.manager = manager
        self.log_stats = log_stats
        self.empty_kv_cache_blocks = self._wrap(self._none)
        self._blocks: dict[Hashable, int] = {}  # live request id -> blocks it holds
        self._uncounted = PrefixCacheStats()  # recorded by the core, not counted by vLLM
        self._reset = False

    @property
    def block_size(self) -> int:
        """The wrapped manager's tokens per block."""
        return self.manager.block_size

    @property
    def usage(self) -> float:
        """Fraction of the wrapped manager's usable blocks held by live requests (all
        ``num_blocks`` here: there is no null block)."""
        return self.manager.usage

    def get_computed_blocks(self, request: VllmRequest) -> tuple[ComputedBlocks, int]:
        """The cached prefix a new (or preempted) request would reuse now: at most
        ``len(all_token_ids) - 1`` tokens, a multiple of block_size; 0 for a request
        that skips reading the cache. Changes nothing. Raises as ``KVCacheManager.lookup``."""
        if not reads_cache(request):
            return ComputedBlocks(0, len(self._none)), 0
        n = self.manager.lookup(request.all_token_ids, extra=extra_keys_of(request))
        return ComputedBlocks(n, len(self._none)), n

    def allocate_slots(self, request: VllmRequest, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: ComputedBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, **unknown: Any) -> BlockIds | None:
        """Slots for ``num_new_tokens`` positions after the request's computed ones (and,
        for a request not yet admitted, after its ``num_new_computed_tokens`` cache hit),
        plus ``num_lookahead_tokens`` reserved ones (see the module docstring).
        Returns the newly allocated blocks, or None on shortage (nothing changed).
        Raises (before any change) PrefixKVError for unsupported arguments (difference
        9); RequestError for counts or flags out of range (``num_computed_tokens``
        included), a running request with fewer ``all_token_ids`` than the manager holds,
        and, after undoing itself, when the hit changed since ``get_computed_blocks``
        (difference 1); TokenError, ExtraKeysError, PromptTooLongError (difference 11)
        as ``KVCacheManager.add_request``."""
        if (unknown or num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens
                or reserved_blocks):
            reject_unsupported(unknown, num_external_computed_tokens=num_external_computed_tokens,
                               delay_cache_blocks=delay_cache_blocks,
                               num_encoder_tokens=num_encoder_tokens, reserved_blocks=reserved_blocks)
        if (type(num_new_tokens) is not int or num_new_tokens < 1
                or type(num_lookahead_tokens) is not int or num_lookahead_tokens):
            check_count("num_new_tokens", num_new_tokens, 1, None)
            check_count("num_lookahead_tokens", num_lookahead_tokens, 0, None)
        if full_sequence_must_fit is not False or has_scheduled_reqs is not True:
            check_flag("full_sequence_must_fit", full_sequence_must_fit, RequestError)
            check_flag("has_scheduled_reqs", has_scheduled_reqs, RequestError)
        nblocks = self._held(request.request_id)
        if nblocks is None:
            return self._admit(request, num_new_tokens, num_new_computed_tokens,
                               num_lookahead_tokens, full_sequence_must_fit)
        return self._grow(request, nblocks, num_new_tokens, num_lookahead_tokens,
                          full_sequence_must_fit)

    def _admit(self, request: VllmRequest, num_new_tokens: int, expected_hit: int,
               lookahead: int, full_fit: bool) -> BlockIds | None:
        rid, tokens, mgr = request.request_id, request.all_token_ids, self.manager
        if request.num_computed_tokens:
            raise PrefixKVError(f"request {rid!r} is not allocated but has "
                                f"{request.num_computed_tokens} computed tokens")
        read = reads_cache(request)
        check_count("num_new_computed_tokens", expected_hit, 0, None if read else 0)
        resumed = getattr(request, "num_preemptions", 0) > 0
        past = max(0, expected_hit + num_new_tokens - len(tokens))  # positions past the prompt
        adm = mgr.add_request(rid, tokens, extra=extra_keys_of(request),
                              num_new_tokens=num_new_tokens, resumed=resumed, read_cache=read,
                              num_lookahead_tokens=lookahead + past, require_full_fit=full_fit)
        if adm is None:
            return None
        hit = adm.num_cached_tokens
        if hit != expected_hit or not read:
            self._uncounted += (PrefixCacheStats(0, 0, 0, 1, len(tokens), hit) if resumed
                                else PrefixCacheStats(1, len(tokens), hit))
        if hit != expected_hit:
            mgr.free(rid, num_computed_tokens=hit)  # what it scheduled was never computed
            raise RequestError(
                f"request {rid!r}: the cache now holds {hit} of its tokens, not the "
                f"{expected_hit} get_computed_blocks reported; call it again")
        ids = self._per_group(adm)
        self._blocks[rid] = len(ids[0])
        return self._wrap(tuple(t[hit // self.block_size:] for t in ids))

    def _grow(self, request: VllmRequest, nblocks: int, num_new_tokens: int, lookahead: int,
              full_fit: bool) -> BlockIds | None:
        #   | scheduled | known, to schedule now | reserved: tokens not known yet + lookahead |
        #   0       scheduled                  known                                      slots
        mgr, rid, bs = self.manager, request.request_id, self.block_size
        tokens = request.all_token_ids
        computed = request.num_computed_tokens
        if type(computed) is not int or computed < 0:
            check_count("num_computed_tokens", computed, 0, None)
        target = computed + num_new_tokens
        held, scheduled = mgr.num_tokens(rid), mgr.num_scheduled_tokens(rid)
        if len(tokens) < held:
            raise RequestError(f"request {rid!r} has {len(tokens)} tokens, fewer than the "
                               f"{held} the manager holds")
        known, slots = min(target, len(tokens)), target + lookahead
        if known > held and scheduled < held:  # the rest of the prompt first
            self._check_mid_prefill(rid)
        need = self._need(rid, slots, nblocks, known > scheduled)
        if full_fit:
            need = max(need, self._need(rid, len(tokens) + lookahead, nblocks, False))
        if need > mgr.num_free_blocks:
            return None
        new = self._none
        if known > held:
            fresh = tokens[held:known]
            if scheduled < held:
                encode_tokens(fresh, mgr.vocab_size)  # a TokenError before any change
                new = self._taken(mgr.extend(rid, held - scheduled))
            new = _cat(new, self._taken(mgr.append_tokens(rid, fresh)))
            scheduled = known
        elif known > scheduled:
            new = self._taken(mgr.extend(rid, known - scheduled))
            scheduled = known
        if slots > scheduled:
            new = _cat(new, self._taken(mgr.reserve(rid, slots - scheduled)))
        self._blocks[rid] = nblocks + len(new[0])
        return self._wrap(new) if new[0] else self.empty_kv_cache_blocks

    # ---- the shape of one group; VllmHybridKVCacheManager has one per layer group -----

    _none: tuple[tuple[int, ...], ...] = ((),)

    def _per_group(self, adm: Any) -> tuple[tuple[int, ...], ...]:
        return (adm.block_ids,)

    def _ids_of(self, rid: Hashable) -> tuple[tuple[int, ...], ...]:
        return (self.manager.get_block_ids(rid),)

    def _wrap(self, ids: tuple[tuple[int, ...], ...]) -> Any:
        return BlockIds(ids[0])

    def _taken(self, new: Any) -> tuple[tuple[int, ...], ...]:
        assert new is not None, "growth was short of blocks after the pool was checked"
        return (new,)

    def _need(self, rid: Hashable, slots: int, nblocks: int, schedules: bool) -> int:
        """Free blocks that covering ``slots`` positions takes (growth takes fresh
        blocks only: exact)."""
        return -(-slots // self.block_size) - nblocks

    def _check_mid_prefill(self, rid: Hashable) -> None:
        """Tokens may be appended before the prompt is fully scheduled."""

    def free(self, request: VllmRequest) -> None:
        """Release the request's blocks (tail first), withdrawing the full blocks past
        its ``num_computed_tokens`` (difference 6); a request holding none is a no-op.
        Raises RequestError when ``num_computed_tokens`` is not an int >= 0."""
        rid = request.request_id
        if self._held(rid) is None:
            return
        computed = check_count("num_computed_tokens", request.num_computed_tokens, 0, None)
        scheduled = self.manager.num_scheduled_tokens(rid)
        del self._blocks[rid]
        self.manager.free(rid, num_computed_tokens=min(computed, scheduled))

    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], ...]:
        """``([block ids in token order],)``; ``([],)`` for a request holding no blocks."""
        if self._held(request_id) is None:
            return tuple([] for _ in self._none)
        return tuple(map(list, self._ids_of(request_id)))

    def make_prefix_cache_stats(self) -> VllmPrefixCacheStats | None:
        """Stats since the previous call (get-and-reset), or None without ``log_stats``."""
        if not self.log_stats:
            return None
        t = self.manager.take_stats() - self._uncounted
        out = VllmPrefixCacheStats(
            reset=self._reset, requests=t.requests, queries=t.queries, hits=t.hits,
            preempted_requests=t.preempted_requests, preempted_queries=t.preempted_queries,
            preempted_hits=t.preempted_hits)
        self._reset, self._uncounted = False, PrefixCacheStats()
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block when none is in use; returns whether it did."""
        done = self.manager.reset_prefix_cache()
        self._reset = self._reset or done
        return done

    def take_events(self) -> list[VllmEvent]:
        """The manager's events since the previous call in vLLM's shapes, oldest first
        (see ``to_vllm_events``)."""
        return to_vllm_events(self.manager.take_events(), self.block_size)

    def _held(self, request_id: Hashable) -> int | None:
        """Blocks the request holds; None when it is not live (or not hashable)."""
        try:
            return self._blocks.get(request_id)
        except TypeError:
            return None


def _cat(a: tuple[tuple[int, ...], ...], b: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Block ids per group, ``b``'s after ``a``'s."""
    return tuple(x + y for x, y in zip(a, b))
