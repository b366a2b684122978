"""Naive allocators behind the manager's interface, for the benchmarks.

``PagedAllocator``: paged blocks, no prefix caching (no hashing, nothing reused).
``ContiguousAllocator``: each request reserves ``max_model_len`` tokens of contiguous
blocks at admission, first fit, the way engines did before paging.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .core.block import blocks_for
from .core.manager import KVCacheManager
from .errors import (
    MAX_BLOCKS,
    RequestError,
    TokenError,
    check_chunk,
    check_count,
    check_new_request,
    check_positive,
    live_request,
)
from .events import Event
from .extra_keys import ExtraKeys, check_extra
from .hashing import encode_tokens
from .results import Admission, BlockCopy, Fork, KVOp
from .stats import PrefixCacheStats, StatsCounter


class PagedAllocator(KVCacheManager):
    """Paged allocation without prefix caching: the manager with an index that never
    finds anything (``KVCacheManager(enable_caching=False)``)."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, vocab_size: int | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False, vocab_size=vocab_size)


class ContiguousAllocator:
    """Reserve ``ceil(max_model_len / block_size)`` contiguous blocks per request.

    The block ids reported for a request are those of its reservation that hold
    scheduled tokens. Nothing is ever shared: ``lookup`` finds nothing, hits are 0.
    Raises ConfigError for bad sizes (``num_blocks`` past ``MAX_BLOCKS`` too); TokenError
    for a prompt longer than max_model_len or a request growing past it, and for bad token
    ids; RequestError for unknown, duplicate or unhashable ids and counts out of range.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_model_len: int) -> None:
        check_positive("num_blocks", num_blocks, MAX_BLOCKS)
        check_positive("block_size", block_size)
        check_positive("max_model_len", max_model_len)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.span = blocks_for(max_model_len, block_size)
        self._starts = [0]            # free ranges, sorted by start
        self._lengths = [num_blocks]
        self._live: dict[Hashable, _Reservation] = {}
        self._stats = StatsCounter()
        self._kv_ops: list[KVOp] = []

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
                    extra: ExtraKeys | None = None,
                    num_new_tokens: int | None = None,
                    resumed: bool = False) -> Admission | None:
        self._check_new_id(request_id)
        tokens = encode_tokens(prompt_token_ids)
        n = len(tokens)
        check_extra(extra, n)
        if not 0 < n <= self.max_model_len:
            raise TokenError(f"prompt of {n} tokens; need 1..max_model_len={self.max_model_len}")
        todo = n if num_new_tokens is None else min(n, check_count("num_new_tokens", num_new_tokens, 1, None))
        start = self._reserve()
        if start is None:
            return None
        self._live[request_id] = _Reservation(start, list(tokens), todo)
        self._stats.record(n, 0, resumed)
        return Admission(request_id, self.get_block_ids(request_id), 0, todo)

    def lookup(self, prompt_token_ids: Sequence[int], *, extra: ExtraKeys | None = None) -> int:
        if not encode_tokens(prompt_token_ids):
            raise TokenError("the prompt is empty: at least one token is needed")
        return 0

    def extend(self, request_id: Hashable, num_new_tokens: int) -> tuple[int, ...]:
        r = self._entry(request_id)
        check_chunk(request_id, num_new_tokens, len(r.tokens) - r.scheduled)
        return self._advance(r, r.scheduled + num_new_tokens)

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> tuple[int, ...]:
        """As ``KVCacheManager.append_tokens``, but never None: the request's span was
        reserved at admission. Raises TokenError when it would grow past max_model_len."""
        r = self._entry(request_id)
        if r.scheduled != len(r.tokens):
            raise RequestError(f"request {request_id!r}: call extend() before append_tokens()")
        new = encode_tokens(token_ids)
        total = len(r.tokens) + len(new)
        if total > self.max_model_len:
            raise TokenError(f"request {request_id!r} would reach {total} > max_model_len "
                             f"{self.max_model_len} tokens")
        r.tokens += new
        return self._advance(r, total)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> Fork | None:
        """Reserve a span for ``child_id`` and ask for a copy of every parent block that
        holds scheduled tokens (nothing is shared). None when no span is free."""
        r = self._entry(parent_id)
        self._check_new_id(child_id)
        dst = self._reserve()
        if dst is None:
            return None
        self._live[child_id] = _Reservation(dst, list(r.tokens), r.scheduled)
        used = blocks_for(r.scheduled, self.block_size)
        copies = tuple(BlockCopy(r.start + i, dst + i) for i in range(used))
        self._kv_ops += copies
        return Fork(child_id, self.get_block_ids(child_id), copies)

    def free(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> None:
        r = self._entry(request_id)
        if num_computed_tokens is not None:
            check_count("num_computed_tokens", num_computed_tokens, 0, r.scheduled)
        del self._live[request_id]
        i = bisect.bisect(self._starts, r.start)
        self._starts.insert(i, r.start)
        self._lengths.insert(i, self.span)
        for j in (i, i - 1):  # merge with the right neighbour, then the left
            if 0 <= j < len(self._starts) - 1 and self._starts[j] + self._lengths[j] == self._starts[j + 1]:
                self._lengths[j] += self._lengths.pop(j + 1)
                del self._starts[j + 1]

    def preempt(self, request_id: Hashable, *, num_computed_tokens: int | None = None) -> tuple[int, ...]:
        tokens = tuple(self._entry(request_id).tokens)
        self.free(request_id, num_computed_tokens=num_computed_tokens)
        return tokens

    def get_block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        r = self._entry(request_id)
        return tuple(range(r.start, r.start + blocks_for(r.scheduled, self.block_size)))

    def num_tokens(self, request_id: Hashable) -> int:
        return len(self._entry(request_id).tokens)

    def num_scheduled_tokens(self, request_id: Hashable) -> int:
        return self._entry(request_id).scheduled

    def reserved_tokens(self, request_id: Hashable) -> int:
        """Slots reserved for the request (``span * block_size``), used or not."""
        self._entry(request_id)
        return self.span * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return sum(self._lengths)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def take_stats(self) -> PrefixCacheStats:
        return self._stats.take()

    def take_events(self) -> list[Event]:
        return []

    def take_kv_ops(self) -> list[KVOp]:
        out, self._kv_ops = self._kv_ops, []
        return out

    def reset_prefix_cache(self) -> bool:
        return not self._live

    def _advance(self, r: _Reservation, total: int) -> tuple[int, ...]:
        bs = self.block_size
        old = blocks_for(r.scheduled, bs)
        r.scheduled = total
        return tuple(range(r.start + old, r.start + blocks_for(total, bs)))

    def _reserve(self) -> int | None:
        for i, length in enumerate(self._lengths):
            if length >= self.span:
                start = self._starts[i]
                if length == self.span:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += self.span
                    self._lengths[i] -= self.span
                return start
        return None

    def _check_new_id(self, request_id: Hashable) -> None:
        check_new_request(self._live, request_id)

    def _entry(self, request_id: Hashable) -> _Reservation:
        return live_request(self._live, request_id)


@dataclass(slots=True)
class _Reservation:
    start: int
    tokens: list[int]
    scheduled: int
