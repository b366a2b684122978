"""The request-level manager: what an engine's scheduler calls.

A request's token positions and its blocks::

    | cached prefix (hits) | new, scheduled now | known, not yet scheduled |
    0               num_cached_tokens     num_scheduled              len(tokens)

Blocks cover ``[0, num_scheduled)``. Every block that is full within ``num_scheduled`` has
its content recorded and is indexed (findable) from the step it is scheduled in: the
engine writes a step's K/V before it reads any, so a request admitted in the same step
may share it. The partial last block is never shared and never cached.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from operator import attrgetter

from .block import Block
from .errors import (
    RequestError, TokenError, check_count, check_new_request, check_positive, live_request,
)
from .events import Event
from .extra_keys import ExtraKeys, check_extra
from .hashing import HashFn, encode_tokens, make_hash_fn
from .pool import BlockPool
from .request import Request
from .results import Admission, BlockCopy, Fork
from .stats import PrefixCacheStats, StatsCounter

_NONE: tuple[int, ...] = ()
_ID = attrgetter("block_id")


class KVCacheManager:
    """Paged KV blocks for many requests, with automatic prefix caching.

    Args:
        num_blocks: physical blocks in the pool (> 0).
        block_size: token slots per block (> 0; 16 is usual).
        hash_mode: ``"xxhash"`` (default; xxh3-128, random seed per manager unless
            ``seed`` is given) or ``"sha256"`` (ids stable across processes), or a
            callable ``bytes -> bytes``. Either way a hit is confirmed against content.
        seed: chain seed (int >= 0 or bytes).
        enable_caching: False gives plain paged allocation (no hashing, no reuse).
        enable_events: record BlockStored/BlockRemoved/AllBlocksCleared for ``take_events``.
        vocab_size: when given, token ids >= vocab_size are rejected (costs a max() per call).

    Raises:
        ConfigError: a size is not a positive int.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, hash_mode: str | HashFn = "xxhash",
        seed: int | bytes | None = None, enable_caching: bool = True,
        enable_events: bool = False, vocab_size: int | None = None,
    ) -> None:
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        if vocab_size is not None:
            check_positive("vocab_size", vocab_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.vocab_size = vocab_size
        self._hash, self._root = make_hash_fn(hash_mode, seed)
        self._events: list[Event] | None = [] if enable_events else None
        self._pool = BlockPool(num_blocks, self._events)
        self._requests: dict[Hashable, Request] = {}
        self._stats = StatsCounter()

    # ---- admission -------------------------------------------------------------------

    def add_request(
        self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
        extra: ExtraKeys | None = None, num_new_tokens: int | None = None, resumed: bool = False,
    ) -> Admission | None:
        """Admit a request: find its longest cached prefix, take references on those
        blocks, allocate blocks for the tokens scheduled now and index the full ones.

        ``num_new_tokens`` limits how many tokens after the cached prefix are scheduled
        now (chunked prefill; the rest follow through ``extend``); default: all of them.
        At least one prompt token is always scheduled, even on a full hit. ``resumed``:
        this re-admits a preempted request (its tokens from ``preempt``); the stats count
        it in the ``preempted_*`` fields rather than as new traffic.

        Returns the Admission, or None when the pool is short of blocks; then nothing
        has changed (no references, no stats) and the engine may wait or preempt.
        Raises RequestError (id in use or unhashable, ``num_new_tokens`` < 1), TokenError
        (empty prompt, bad ids), ExtraKeysError.
        """
        self._check_new_id(request_id)
        if num_new_tokens is not None:
            check_count("num_new_tokens", num_new_tokens, 1, None)
        req, hits = self._find(request_id, prompt_token_ids, extra)
        n, bs = len(req.tokens), self.block_size
        num_cached = len(hits) * bs
        todo = n - num_cached
        if num_new_tokens is not None:
            todo = min(todo, num_new_tokens)
        blocks = self._pool.acquire(hits, -(-(num_cached + todo) // bs) - len(hits))
        if blocks is None:
            return None
        req.blocks = blocks
        req.num_cached = req.num_scheduled = num_cached
        self._advance(req, num_cached + todo)
        self._requests[request_id] = req
        self._stats.record(n, num_cached, resumed)
        return Admission(request_id, tuple(map(_ID, req.blocks)), num_cached, todo)

    def lookup(self, prompt_token_ids: Sequence[int], *, extra: ExtraKeys | None = None) -> int:
        """Tokens of this prompt that an admission now would find cached. Changes nothing
        (no references, no stats, no LRU update). Raises as ``add_request`` for bad input."""
        return len(self._find(None, prompt_token_ids, extra)[1]) * self.block_size

    def _find(self, request_id: Hashable, prompt_token_ids: Sequence[int],
              extra: ExtraKeys | None) -> tuple[Request, list[Block]]:
        """Check and encode a prompt, hash its full blocks and find its cached prefix
        (at most all blocks but the one holding the last token). No side effects."""
        tokens = encode_tokens(prompt_token_ids, self.vocab_size)
        n, bs = len(tokens), self.block_size
        if n == 0:
            raise TokenError("the prompt is empty: at least one token is needed")
        req = Request(request_id, tokens, check_extra(extra, n), bs)
        if not self.enable_caching:
            return req, []
        req.hash_through(self._hash, self._root, n // bs)
        return req, self._pool.lookup(req.hashes, req.chunks, req.extras, (n - 1) // bs)

    # ---- growth ----------------------------------------------------------------------

    def extend(self, request_id: Hashable, num_new_tokens: int) -> tuple[int, ...] | None:
        """Schedule the next ``num_new_tokens`` known tokens (the next prefill chunk).
        Returns the ids of blocks added, or None on shortage (nothing changed).
        Raises RequestError (unknown id, or a count outside 1..unscheduled tokens)."""
        req = self._get(request_id)
        check_count("num_new_tokens", num_new_tokens, 1, len(req.tokens) - req.num_scheduled)
        return self._grow(req, req.num_scheduled + num_new_tokens)

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        """Append sampled tokens and schedule them (decode; several for speculative or
        multi-token steps). Blocks that become full are cached.
        Returns the ids of blocks added (usually empty), or None on shortage (nothing
        changed). Raises RequestError (unknown id, or prefill not fully scheduled),
        TokenError (bad ids)."""
        req = self._get(request_id)
        n, bs = req.num_scheduled, self.block_size
        if n != len(req.tokens):
            raise RequestError(
                f"request {request_id!r} has {len(req.tokens) - n} prompt "
                f"tokens not yet scheduled: call extend() before append_tokens()")
        if len(token_ids) == 1 and 0 < n % bs < bs - 1 and self.vocab_size is None:
            # the hot path: one token into a block that has room and does not fill
            try:
                req.tokens.append(token_ids[0])  # validates the range, atomically
            except (OverflowError, TypeError) as exc:
                raise TokenError(f"token ids must be ints in [0, 2**32): {exc}") from None
            req.num_scheduled = n + 1
            return _NONE
        new = encode_tokens(token_ids, self.vocab_size)
        total = n + len(new)
        if total <= len(req.blocks) * bs and total // bs == n // bs:
            req.tokens.extend(new)  # fast path: no new block, no block becomes full
            req.num_scheduled = total
            return _NONE
        return self._grow(req, total, new)

    def _grow(self, req: Request, total: int, new_tokens: array | None = None) -> tuple[int, ...] | None:
        """Cover ``[0, total)`` with blocks (None on shortage, before any change)."""
        need = -(-total // self.block_size) - len(req.blocks)
        if need > self._pool.num_free:
            return None
        if new_tokens is not None:
            req.tokens.extend(new_tokens)
        new = self._pool.take(need) if need > 0 else []
        req.blocks += new
        self._advance(req, total)
        return tuple(map(_ID, new))

    def _advance(self, req: Request, total: int) -> None:
        """Move ``num_scheduled`` to ``total`` and record every block that became full."""
        bs = self.block_size
        first, last = req.num_scheduled // bs, total // bs
        req.num_scheduled = total
        if not self.enable_caching or first == last:
            return
        req.hash_through(self._hash, self._root, last)  # decode: the newly full blocks
        stored = self._pool.fill(req.blocks, first, req.hashes[first:last],
                                 req.chunks[first:last], req.extras_for(first, last))
        if self._events is not None:
            self._events += map(req.block_stored, stored)

    # ---- forks, free, preemption -------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> Fork | None:
        """Create ``child_id`` sharing the parent's full blocks (parallel sampling, beam
        search). The parent's partial last block is copied on write: the child gets a new
        block and the result's ``copies`` says which block to copy into it.
        Returns None when that block cannot be had (nothing changed). Raises RequestError
        (unknown parent, child id in use, parent's prefill not fully scheduled)."""
        parent = self._get(parent_id)
        self._check_new_id(child_id)
        if parent.num_scheduled != len(parent.tokens):
            raise RequestError(f"cannot fork {parent_id!r} before its prefill is fully scheduled")
        full = parent.num_scheduled // self.block_size
        blocks = self._pool.acquire(parent.blocks[:full], len(parent.blocks) - full)
        if blocks is None:
            return None
        child = parent.copy(child_id)
        child.blocks = blocks
        copies = tuple(BlockCopy(s.block_id, d.block_id)
                       for s, d in zip(parent.blocks[full:], child.blocks[full:]))
        self._requests[child_id] = child
        return Fork(child_id, tuple(map(_ID, child.blocks)), copies)

    def free(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
        """Release a finished, aborted or preempted request's blocks, tail of the chain
        first (so of these, the block ending the longest prefix is evicted first). Cached
        blocks keep their content and stay findable until evicted.

        ``num_computed_tokens``: pass it when the request is dropped before all its
        scheduled tokens were computed (aborted before its step ran): full blocks past it
        are made unfindable, so no later request hits KV that was never written. Default:
        every scheduled token was computed. (Requests that hit those blocks in the same
        step must not run without them either.)
        Raises RequestError for an unknown or already freed id, or a count outside
        ``[0, num_scheduled_tokens]``.
        """
        req = self._get(request_id)
        if num_computed_tokens is not None:
            check_count("num_computed_tokens", num_computed_tokens, 0, req.num_scheduled)
            bs = self.block_size
            first = max(num_computed_tokens, req.num_cached) // bs
            self._pool.uncache(req.blocks[first:req.num_scheduled // bs])
        del self._requests[request_id]
        self._pool.release(reversed(req.blocks))

    def preempt(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> tuple[int, ...]:
        """Free a running request (as ``free``, same ``num_computed_tokens``) and return
        all its known token ids (prompt and generated), to pass to ``add_request(...,
        resumed=True)`` when it is re-admitted; it will hit whatever is still cached.
        Raises as ``free``."""
        tokens = tuple(self._get(request_id).tokens)
        self.free(request_id, num_computed_tokens=num_computed_tokens)
        return tokens

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content, only when no block is in use. Returns whether it did."""
        return self._pool.reset()

    # ---- queries ---------------------------------------------------------------------

    def get_block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's block ids in token order. Raises RequestError for an unknown id."""
        return tuple(map(_ID, self._get(request_id).blocks))

    def num_tokens(self, request_id: Hashable) -> int:
        """Known tokens of the request (prompt and appended), scheduled or not."""
        return len(self._get(request_id).tokens)

    def num_scheduled_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request that have slots (computed or scheduled)."""
        return self._get(request_id).num_scheduled

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (empty ones and cached ones that may be evicted);
        an admission or growth needing more than this returns None."""
        return self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by a lookup (indexed), whether in use or free."""
        return self._pool.num_cached

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (0.0 to 1.0)."""
        return 1.0 - self._pool.num_free / self.num_blocks

    def free_block_order(self) -> list[int]:
        """Free block ids in the order they will be reused (empty ones, then LRU)."""
        return self._pool.free_order()

    @property
    def stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache statistics since creation."""
        return self._stats.total

    def take_stats(self) -> PrefixCacheStats:
        """Statistics since the previous ``take_stats`` (get-and-reset)."""
        return self._stats.take()

    def take_events(self) -> list[Event]:
        """Events since the previous call, oldest first (empty unless ``enable_events``)."""
        if not self._events:
            return []
        out = self._events[:]
        self._events.clear()
        return out

    def check_invariants(self) -> None:
        """Verify every count and link (pool, free queue, index, refcounts against the
        live requests, each request's blocks against its tokens). Raises InvariantError."""
        refs: dict[int, int] = {}
        for req in self._requests.values():
            req.check(self.block_size, self.enable_caching)
            for b in req.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        self._pool.check_invariants(refs)

    # ---- helpers ---------------------------------------------------------------------

    def _get(self, request_id: Hashable) -> Request:
        try:  # every call goes through here, decode included: one dict access when live
            return self._requests[request_id]
        except (KeyError, TypeError):
            return live_request(self._requests, request_id)  # raises RequestError

    def _check_new_id(self, request_id: Hashable) -> None:
        check_new_request(self._requests, request_id)
