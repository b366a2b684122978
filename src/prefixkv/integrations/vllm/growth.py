"""The growth of a live request ``manager.KVCacheManager`` holds (``allocate_slots`` for a
request holding blocks, ``cache_blocks``), over prefixkv's manager: its windows moved,
vLLM's set-back counts rewound (``rewind``), its blocks cached up to what vLLM computed
and reserved up to its slots (``grow``). The hit: hits.py; admission: slots.py, whose
``allocate`` checks the arguments and calls ``grow_live``.

In vLLM's layout (``| hit | external | new | lookahead |``, slots.py) a live request's
hit is behind it: ``allocate_slots`` caches up to ``computed + new`` (nothing more with
``delay_cache_blocks``; multi-module MTP's last ``m.reprefill_tokens`` a step later) and
reserves up to ``computed + new + lookahead`` positions (capped at ``max_model_len``).
Tokens reach prefixkv from ``request.all_token_ids`` as they become known.

Functions of the manager ``m``, whose methods state their contracts; they read and
change its block table and telemetry, and hold no state of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request

from prefixkv.errors import RequestError

from .requests import core_tokens, sound_tokens

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["grow", "grow_live", "rewind"]


def grow_live(m: KVCacheManager, key: int, request: Request, num_new_tokens: int,
              num_new_computed_tokens: int, num_external_computed_tokens: int, num_lookahead_tokens: int,
              delay_cache_blocks: bool, full_sequence_must_fit: bool, keep: int,
              full_keep: int = 0) -> KVCacheBlocks | None:
    """``allocate_slots`` for the live request ``key``: the blocks added, or None when
    the pool, less ``keep`` blocks, is short, or with ``full_sequence_must_fit`` less
    ``full_keep`` (the watermark: vLLM's whole-sequence gate leaves ``reserved_blocks``
    out) for the whole sequence (nothing changed but, as in vLLM, the release of the
    blocks no window reads any more)."""
    computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
    n, scheduled = request.num_computed_tokens, m.core.num_scheduled_tokens(key)
    # (the second: vLLM computes what a load was to write, which failed, where the
    # windows gave back what the query after the load would not read)
    back = n < scheduled or bool(m._hybrid and n == scheduled and num_new_tokens
                                 and m.core.reads_released(key, n))
    if m._hybrid:
        # as vLLM, windows move at the tokens processed: steps in flight (async
        # scheduling) still read from where they start, which is before computed
        m.core.bound_release(key, max(0, computed - request.num_in_flight_tokens))
    slots = min(computed + num_new_tokens + num_lookahead_tokens, m.max_model_len)
    cache_to = (request.num_computed_tokens if delay_cache_blocks else computed + num_new_tokens) \
        - m.reprefill_tokens  # (vLLM's num_reprefillable_tokens: cached when final)
    # counted before the rewind below, which a refusal must not make (it uncaches the
    # request's blocks past the count, whose KV may be sound: a landed load whose last
    # token vLLM recomputes, before the recompute); the count is the same either way: the
    # tables keep their length, and the bound above caps the release at or below the
    # rewound position
    short = m.coordinator.short_of_blocks
    if (full_sequence_must_fit and short(key, max(slots, min(request.num_tokens, m.max_model_len)), full_keep,
                                         request)) or short(key, slots, keep, request):
        if m._hybrid:  # as vLLM, which frees what no window reads before it counts
            m.core.release_unread(key)
        return None
    if back:  # (but while vLLM replays the window below a hit: its tokens are sound)
        sound = sound_tokens(request, m.replay_tokens)
        if sound == n or sound < scheduled:
            rewind(m, key, sound)
    return m._blocks.of(grow(m, key, request, min(cache_to, request.num_tokens), slots))


def rewind(m: KVCacheManager, key: int, num_computed_tokens: int) -> None:
    """vLLM set the live request ``key`` back to ``num_computed_tokens`` (KV found
    invalid: a failed load) and recomputes from there: so does prefixkv. Its full blocks
    from there lose their content and are cached anew as the recompute schedules them
    (unless the recompute reads what a window released: never, groups/taint.py); the
    windows move at the recompute's start, not at the old, later position. The plain
    manager refuses, changing nothing, while another request holds one of those blocks
    (vLLM recomputes a shared invalid block once, in place, for all): the request then
    goes on as before, the blocks it recomputes not cached again while it lives."""
    if m._hybrid:
        m.core.rewind(key, num_computed_tokens)
        return
    try:
        m.core.rewind(key, num_computed_tokens)
    except RequestError:  # (the only refusal left: a block another request holds)
        pass


def grow(m: KVCacheManager, key: int, request: Request, cache_to: int, slots: int
         ) -> tuple[tuple[int, ...], ...]:
    """Cache up to ``cache_to`` (tokens from ``request.all_token_ids``), then reserve up
    to ``slots``; the blocks added per group. The pool was checked."""
    core, hybrid = m.core, m._hybrid
    added: list[tuple[int, ...]] = [()] * m.num_kv_cache_groups  # (no closure: a decode step's)
    held, scheduled = core.num_tokens(key), core.num_scheduled_tokens(key)
    if cache_to > scheduled:
        if min(cache_to, held) > scheduled:
            _took(added, core.extend(key, min(cache_to, held) - scheduled), hybrid)
        if cache_to > held:
            _took(added, core.append_tokens(key, core_tokens(request)[held:cache_to]), hybrid)
        scheduled = cache_to
    if slots > scheduled:
        _took(added, core.reserve(key, slots - scheduled), hybrid)
    m._telemetry.on_allocated(added)
    return tuple(added)


def _took(added: list[tuple[int, ...]], got: Any, hybrid: bool) -> None:
    """Add a growth call's new block ids (per group when ``hybrid``) to ``added``."""
    assert got is not None, "growth was short of blocks after the pool was checked"
    if not hybrid:
        added[0] += got
        return
    for g, ids in enumerate(got):
        added[g] += ids
