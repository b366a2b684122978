"""The growth of running requests: prefill chunks, decoded tokens (one request, or a
whole decode step in one call) and slots reserved before their tokens are known.
Functions ``KVCacheManager``'s body lists (``self`` the manager); construction and
admission are in ``admission.py``.

    | cached prefix | scheduled, computed | new (this call) | reserved, token unknown |
    0          num_cached          num_scheduled                          num_reserved
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from ..errors import ConfigError, RequestError, check_chunk, check_count
from ..hashing import encode_tokens
from ..index.announce import Prepared
from ..results import DecodeStep
from .block import blocks_for
from .request import Request, step_requests

_NO_BLOCKS: tuple[int, ...] = ()
_NOTHING_GREW = DecodeStep((), ())
_NO_FILLS: dict[int, Prepared | None] = {}  # no hash_mode callable: nothing prepared (never written)
_ID = attrgetter("block_id")

if TYPE_CHECKING:
    from .manager import KVCacheManager


def extend(self: KVCacheManager, request_id: Hashable, num_new_tokens: int) -> tuple[int, ...] | None:
    """Schedule the next ``num_new_tokens`` known tokens (the next prefill chunk).
    Returns the ids of blocks added, or None on shortage (nothing changed).
    Raises RequestError (unknown id, or a count outside 1..unscheduled tokens)."""
    req = self._get(request_id)
    check_chunk(request_id, num_new_tokens, len(req.tokens) - req.num_scheduled)
    return self._grow(req, req.num_scheduled + num_new_tokens)


def append_tokens(self: KVCacheManager,
                  request_id: Hashable, token_ids: Sequence[int]) -> tuple[int, ...] | None:
    """Append sampled tokens and schedule them (decode; several for speculative or
    multi-token steps). Blocks that become full are cached.
    Returns the ids of blocks added (usually empty), or None on shortage (nothing
    changed). Raises RequestError (unknown id, or prefill not fully scheduled),
    TokenError (bad ids or container)."""
    req = self._get(request_id)
    n, bs = req.num_scheduled, self.block_size
    if n != len(req.tokens):
        raise RequestError(
            f"request {request_id!r} has {len(req.tokens) - n} prompt "
            f"tokens not yet scheduled: call extend() before append_tokens()")
    if type(token_ids) is list and len(token_ids) == 1 and 0 < n % bs < bs - 1 \
            and self.vocab_size is None and type(token_ids[0]) is int:
        # the hot path: one token into a block that has room and does not fill
        try:
            req.tokens.append(token_ids[0])  # validates the range, atomically
        except OverflowError:
            self._encode(token_ids)  # raises the TokenError
        req.num_scheduled = n + 1
        return _NO_BLOCKS
    new = self._encode(token_ids)
    total = n + len(new)
    if total <= len(req.blocks) * bs and total // bs == n // bs:
        req.tokens.extend(new)  # no new block, no block becomes full
        req.num_scheduled = total
        return _NO_BLOCKS
    if total == n + 1 and not self._index.hash_may_fail:  # one token at a block edge
        return self._append_at_edge(req, new[0])
    return self._grow(req, total, new)


def _append_at_edge(self: KVCacheManager, req: Request, token: int,
                    prepared: Prepared | None = None) -> tuple[int, ...] | None:
    """Append one token that opens a block (which the pool must give: None when it
    cannot, nothing changed) or fills one (recorded: from ``prepared``, made before
    any change when a hash_mode callable may fail, else here). Returns the ids of
    the blocks added."""
    n, bs = req.num_scheduled, self.block_size
    added = _NO_BLOCKS
    if not n % bs and n >= len(req.blocks) * bs:
        b = self._pool.take_one()
        if b is None:
            return None
        req.blocks.append(b)
        added = (b.block_id,)
    req.tokens.append(token)
    req.num_scheduled = n + 1
    if n % bs == bs - 1:
        if prepared is None:
            self._index.store_filled(req, n // bs)
        else:
            self._index.store(req, n // bs, prepared)
    return added


def append_step(self: KVCacheManager,
                request_ids: Sequence[Hashable], token_ids: Sequence[int]) -> DecodeStep:
    """One decode step: append ``token_ids[i]`` to ``request_ids[i]`` for every
    running request, in one call. Each request is handled as ``append_tokens`` with
    one token; requests that need a new block and cannot get one (in the order
    given, earlier ones first) are left unchanged and listed in ``short``.
    Raises (before any change) RequestError (unknown or repeated id, lengths differ,
    prefill not fully scheduled), TokenError (bad ids)."""
    reqs = self._step_requests(request_ids, token_ids)
    new = encode_tokens(token_ids, self.vocab_size)
    bs = self.block_size
    last = bs - 1
    fills = self._prepare_fills(reqs, new) if self._index.hash_may_fail else _NO_FILLS
    edge = self._append_at_edge
    grown: list[tuple[Hashable, tuple[int, ...]]] = []
    short: list[Hashable] = []
    for req, t in zip(reqs, new, strict=True):
        n = req.num_scheduled
        r = n % bs
        if r != last and (r or n < len(req.blocks) * bs):  # room that does not fill
            req.tokens.append(t)
            req.num_scheduled = n + 1
            continue
        added = edge(req, t, fills.get(id(req)) if fills else None)  # 1 token in 16
        if added is None:
            short.append(req.request_id)
        elif added:
            grown.append((req.request_id, added))
    if not grown and not short:
        return _NOTHING_GREW
    return DecodeStep(tuple(grown), tuple(short))


def _prepare_fills(self: KVCacheManager,
                   reqs: list[Request], new: Sequence[int]) -> dict[int, Prepared | None]:
    """What the blocks filled by this step need (their hashes), computed before any
    change: a ``hash_mode`` callable may fail, and the step must then change nothing."""
    last = self.block_size - 1
    return {id(r): self._index.prepare_next(r, t)
            for r, t in zip(reqs, new, strict=True) if r.num_scheduled % self.block_size == last}


def reserve(self: KVCacheManager, request_id: Hashable, num_slots: int) -> tuple[int, ...] | None:
    """Make the blocks cover ``num_slots`` positions past the scheduled tokens, whose
    tokens are not known yet (speculative lookahead; a step scheduled before its
    sampled token arrives). Appending those tokens later needs no new block.
    Returns the ids of blocks added, or None on shortage (nothing changed).
    Raises RequestError (unknown id, ``num_slots`` < 0)."""
    req = self._get(request_id)
    check_count("num_slots", num_slots, 0, None)
    need = blocks_for(req.num_scheduled + num_slots, self.block_size) - len(req.blocks)
    if need > self._pool.num_free:
        return None
    new = self._pool.take(need) if need > 0 else []
    req.blocks += new
    req.num_reserved = max(req.num_reserved, req.num_scheduled + num_slots)
    return tuple(map(_ID, new))


def _step_requests(self: KVCacheManager, request_ids: Sequence[Hashable],
                   token_ids: Sequence[int]) -> list[Request]:
    """The live requests of a decode step, checked: known, distinct, prefill done."""
    return step_requests(self._requests, self._get, self._num_prefilling, request_ids, token_ids)


def _grow(self: KVCacheManager,
          req: Request, total: int, new_tokens: array[int] | None = None) -> tuple[int, ...] | None:
    """Append ``new_tokens`` and cover ``[0, total)`` with blocks, recording the
    blocks that became full; None on shortage, before any change."""
    bs = self.block_size
    need = blocks_for(total, bs) - len(req.blocks)
    if need > self._pool.num_free:
        return None
    n, first, last = len(req.tokens), req.num_scheduled // bs, total // bs
    if new_tokens is not None:
        req.tokens.extend(new_tokens)
    try:
        prepared = (self._index.prepare(req, first, last, req.blocks[first - 1] if first else None)
                    if first < last else None)
    except ConfigError:
        del req.tokens[n:]
        raise
    new = self._pool.take(need) if need > 0 else []
    req.blocks += new
    if req.num_scheduled < n == total:  # the prefill's last chunk
        self._num_prefilling -= 1
        req.prompt_chunks = req.prompt_hashes = None  # (kept for a prepared prompt's chunks)
    req.num_scheduled = total
    if prepared is not None:
        self._index.store(req, first, prepared)
    return tuple(b.block_id for b in new)
