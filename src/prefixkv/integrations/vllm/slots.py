"""The slots ``manager.KVCacheManager`` gives a request, over prefixkv's manager:
admission of a new request with the hit it reuses (``allocate_slots``; the hit is found
by hits.py); the growth of a live one (``allocate_slots``, ``cache_blocks``) is growth.py's.

How vLLM's calls map (``| hit | external | new | lookahead |`` = vLLM's allocate_slots
layout): prefixkv's *scheduled* tokens of a request are the ones vLLM has cached (their
blocks findable); the blocks past them are reserved slots. ``allocate_slots`` makes the
blocks cover ``hit + external + new + lookahead`` positions (capped at ``max_model_len``)
and caches up to ``min(hit + external + new, request.num_tokens)`` (nothing past the hit
with ``delay_cache_blocks``; multi-module MTP's last ``m.reprefill_tokens`` a step later,
as vLLM); ``cache_blocks(request, n)`` caches up to ``n`` later (the
scheduler calls it at output time and when an async load lands). Tokens reach prefixkv
from ``request.all_token_ids`` as they become known; at admission, as the ``Prompt``
prepared when vLLM built the request (``prepared_prompts``: prepared.py) while it
describes the request exactly, else as those ids (``admission_prompt``, which the
lookup of a hit reads too: hits.py).

Functions of the manager ``m``, whose methods state their contracts; they read and
change its request map, block table and telemetry, and hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import blocks_for
from prefixkv.core.prompt import Prompt
from prefixkv.errors import PromptTooLongError, RequestError, check_count
from prefixkv.extra_keys import ExtraKeys

from . import sessions
from .growth import grow_live
from .layout import UnsupportedByPrefixKV
from .requests import core_tokens, extra_keys_of

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["admission_prompt", "admit", "allocate", "uncached_new"]

_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def uncached_new(m: KVCacheManager, new: tuple[tuple[int, ...], ...],
                 tables: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """An admission's ``new`` blocks per group (those past the hit) with an uncached
    window's replaced by all it took (``tables``: the request's, prefixkv's ids)."""
    null = m.core.null_block_id
    return tuple(ids if c else tuple(i for i in t if i != null)
                 for ids, t, c in zip(new, tables, m.cached_groups, strict=True))


def allocate(m: KVCacheManager, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
             num_lookahead_tokens: int, num_external_computed_tokens: int, delay_cache_blocks: bool,
             num_encoder_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int,
             has_scheduled_reqs: bool) -> KVCacheBlocks | None:
    """``m.allocate_slots`` (its contract is there): the arguments checked before any
    change, then ``admit`` for a request holding no blocks, ``grow_live`` for a live one."""
    try:  # (one test: an or of ints is negative iff one of them is)
        bad = (num_new_tokens | num_new_computed_tokens | num_lookahead_tokens
               | num_external_computed_tokens | reserved_blocks) < 0
        bad = bad.__class__ is not bool or bad  # (numpy's: an array or a numpy bool)
    except TypeError:  # None, a float
        bad = True
    if bad:
        for name, value in (("num_new_tokens", num_new_tokens),
                            ("num_new_computed_tokens", num_new_computed_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens),
                            ("num_external_computed_tokens", num_external_computed_tokens),
                            ("reserved_blocks", reserved_blocks)):
            check_count(name, value, 0, None)
    if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
        raise ValueError("num_new_tokens must be greater than 0 when there are no "
                         "computed tokens to adopt")
    if num_encoder_tokens:
        raise UnsupportedByPrefixKV("prefixkv does not offer encoder (cross-attention) caches")
    keep = reserved_blocks
    if m.watermark_blocks and has_scheduled_reqs and request.status in _ADMITTING:
        keep += m.watermark_blocks
    key = m._keys.get(request.request_id)
    if key is None:
        if m._watch_sessions:  # (a first request of a session is bracketed: sessions.py)
            return sessions.admitting(admit, m, request, num_new_tokens, num_new_computed_tokens,
                                      num_external_computed_tokens, num_lookahead_tokens,
                                      delay_cache_blocks, full_sequence_must_fit, keep)
        return admit(m, request, num_new_tokens, num_new_computed_tokens,
                     num_external_computed_tokens, num_lookahead_tokens, delay_cache_blocks,
                     full_sequence_must_fit, keep)
    return grow_live(m, key, request, num_new_tokens, num_new_computed_tokens,
                     num_external_computed_tokens, num_lookahead_tokens, delay_cache_blocks,
                     full_sequence_must_fit, keep, keep - reserved_blocks)


def admit(m: KVCacheManager, request: Request, num_new_tokens: int, hit: int, external: int,
          lookahead: int, delay: bool, full_fit: bool, keep: int) -> KVCacheBlocks | None:
    """``allocate_slots`` for a request holding no blocks: admit it with a hit of ``hit``
    tokens, register its vLLM id; the blocks past the hit (an uncached window's: all it
    took), or None when the pool, less ``keep`` blocks, is short or could never hold it
    (nothing changed). Raises
    RequestError when the request has computed tokens and a hit, or when the cache's hit
    is not ``hit``, PromptTooLongError when it has more than ``m.max_model_len`` tokens
    (nothing changed)."""
    if request.num_tokens > m.max_model_len:  # vLLM's input processor refuses these
        bs = m.block_size
        raise PromptTooLongError(request.num_tokens, blocks_for(request.num_tokens, bs),
                                 blocks_for(m.max_model_len, bs),
                                 f" for a request (max_model_len={m.max_model_len} tokens)")
    # A waiting request may come with computed tokens (its KV written elsewhere, e.g.
    # a disaggregated decode): they count as external ones, scheduled with the rest.
    if request.num_computed_tokens and hit:
        raise RequestError(f"request {request.request_id!r} has {request.num_computed_tokens} "
                           f"computed tokens and a cache hit of {hit}")
    prompt, extra = admission_prompt(m, request)
    read = hit > 0 and m.prefix_cache_lookup_enabled(request)
    computed = request.num_computed_tokens + hit + external
    slots = min(computed + num_new_tokens + lookahead, m.max_model_len)
    cache_to = min(hit if delay else computed + num_new_tokens, len(prompt))
    if m.reprefill_tokens:  # (multi-module MTP: its last tokens cached a step late, as vLLM)
        cache_to = max(hit, cache_to - m.reprefill_tokens)
    scheduled = max(cache_to - hit, 1)  # prefixkv schedules at least one token, but
    if not num_new_tokens and m._uncached and not external:  # where vLLM adopts a hit alone
        scheduled = 0  # (a chunk ending in the tokens SWA bounded replay recomputes below it)
    key = m._next_key
    # a load's tokens: no query reads below the windows' reach at their end (vLLM: null
    # blocks); a resumed request's prompt is its first num_prompt_tokens (its partial tail)
    loaded = {}
    cap: int | None = hit
    if m._hybrid:
        loaded = {"num_external_tokens": computed - hit,
                  "num_prompt_tokens": max(1, request.num_prompt_tokens)}
        if m._hit_caps is not None and read:  # (a hit inside a full-attention block: hit_caps.py)
            cap = m._hit_caps.cap(request, hit)
            if delay:  # (vLLM's copy holds its partial entry from a later cache_blocks on)
                loaded["hold_tail"] = False
            if hit % m._hit_caps.fine_size and m.eagle_groups:  # (found again as found: EAGLE's)
                loaded["peek"] = m.eagle_groups
        if m._retains or m.mamba_shared_prefix_checkpoint:  # (the windows' retention keeps what a
            # hit reads at vLLM's junction; Mamba's shared-prefix checkpoint is recorded there)
            loaded["junction"] = request.shared_prefix_boundary
    try:
        adm = m.core.add_request(key, prompt, extra=extra, num_new_tokens=scheduled,
                                 resumed=request.num_preemptions > 0, read_cache=read,
                                 max_hit_tokens=cap if read else None,
                                 num_lookahead_tokens=max(0, slots - hit - scheduled),
                                 require_full_fit=full_fit, keep_free=keep, **loaded)
    except PromptTooLongError:
        return None  # vLLM's answer: None (its max_model_len check keeps such prompts out)
    if adm is None:
        return None
    if adm.num_cached_tokens != hit:
        m.core.free(key, num_computed_tokens=adm.num_cached_tokens)
        raise RequestError(f"request {request.request_id!r}: the cache holds {adm.num_cached_tokens} "
                           f"of its tokens, not the {hit} get_computed_blocks reported")
    recorded, bs = (hit + scheduled) // m.block_size, m.block_size
    if recorded > cache_to // bs:  # the one token scheduled filled a block (block_size 1):
        # its KV is not there before the load lands, so no other request may find it
        early = range(cache_to // bs, recorded)
        m.core.uncache_blocks([ids[j] for ids in adm.group_block_ids for j in early])
        # and estimate_cached_tokens leaves them out, as vLLM's (nothing cached yet)
        m._evicted[request.request_id] = {(g, j) for g in range(len(adm.group_block_ids)) for j in early}
    m._next_key += 1
    m._keys[request.request_id] = key
    if m._hybrid:
        new = tuple(ids[hit // b:] for ids, b in zip(adm.group_block_ids, m.group_sizes, strict=True))
    else:  # (one group: the ids past the hit alone, a long hit's not listed)
        new = (adm.block_ids_from(hit // m.group_sizes[0]),)
    if m._uncached:  # (an uncached window's blocks are all new)
        new = uncached_new(m, new, adm.group_block_ids)
    m._telemetry.on_allocated(new)
    return m._blocks.of(new)


def admission_prompt(m: KVCacheManager, request: Request) -> tuple[Sequence[int] | Prompt, ExtraKeys | None]:
    """What admission (and the lookup) takes for ``request``: the Prompt prepared when
    it was built, while it describes the request exactly (prepared.py), else its token
    ids and extra keys, read and encoded here."""
    prompt = m.prepared_prompts.prompt_of(request)
    if prompt is not None:
        return prompt, None
    return core_tokens(request), extra_keys_of(request, m.hash_block_size)
