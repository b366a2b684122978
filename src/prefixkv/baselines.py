"""Naive allocators behind the manager's interface, for the benchmarks.

``PagedAllocator``: paged blocks, no prefix caching (no hashing, nothing reused).
``ContiguousAllocator``: each request reserves ``max_model_len`` tokens of contiguous
blocks at admission, first fit, the way engines did before paging.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from typing import Protocol

from .errors import RequestError, TokenError, check_positive
from .extra_keys import ExtraKeys, check_extra
from .hashing import encode_tokens
from .manager import KVCacheManager
from .results import Admission, BlockCopy, Fork


class Allocator(Protocol):
    """What the benchmarks and the example engine need from any allocator."""

    num_blocks: int
    block_size: int

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
                    extra: ExtraKeys | None = None,
                    num_new_tokens: int | None = None) -> Admission | None: ...
    def append_tokens(self, request_id: Hashable,
                      token_ids: Sequence[int]) -> tuple[int, ...] | None: ...
    def fork(self, parent_id: Hashable, child_id: Hashable) -> Fork | None: ...
    def free(self, request_id: Hashable) -> None: ...
    def get_block_ids(self, request_id: Hashable) -> tuple[int, ...]: ...
    @property
    def num_free_blocks(self) -> int: ...


class PagedAllocator(KVCacheManager):
    """Paged allocation without prefix caching: ``KVCacheManager(enable_caching=False)``."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, vocab_size: int | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False, vocab_size=vocab_size)


class ContiguousAllocator:
    """Reserve ``ceil(max_model_len / block_size)`` contiguous blocks per request.

    Raises ConfigError for bad sizes; TokenError for a prompt longer than max_model_len or
    a request growing past it; RequestError for unknown or duplicate ids.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_model_len: int) -> None:
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        check_positive("max_model_len", max_model_len)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.span = -(-max_model_len // block_size)
        self._starts = [0]            # free ranges, sorted by start
        self._lengths = [num_blocks]
        self._live: dict[Hashable, list[int]] = {}  # id -> [start, num_tokens]

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
                    extra: ExtraKeys | None = None,
                    num_new_tokens: int | None = None) -> Admission | None:
        if request_id in self._live:
            raise RequestError(f"request {request_id!r} is already live")
        n = len(encode_tokens(prompt_token_ids))
        check_extra(extra, n)
        if not 0 < n <= self.max_model_len:
            raise TokenError(f"prompt of {n} tokens; need 1..max_model_len={self.max_model_len}")
        start = self._reserve()
        if start is None:
            return None
        self._live[request_id] = [start, n]
        return Admission(request_id, self.get_block_ids(request_id), 0, n)

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> tuple[int, ...]:
        entry = self._entry(request_id)
        total = entry[1] + len(encode_tokens(token_ids))
        if total > self.max_model_len:
            raise TokenError(f"request {request_id!r} would reach {total} > max_model_len "
                             f"{self.max_model_len} tokens")
        entry[1] = total
        return ()

    def fork(self, parent_id: Hashable, child_id: Hashable) -> Fork | None:
        start, n = self._entry(parent_id)
        if child_id in self._live:
            raise RequestError(f"request {child_id!r} is already live")
        dst = self._reserve()
        if dst is None:
            return None
        self._live[child_id] = [dst, n]
        used = -(-n // self.block_size)
        copies = tuple(BlockCopy(start + i, dst + i) for i in range(used))
        return Fork(child_id, self.get_block_ids(child_id), copies)

    def free(self, request_id: Hashable) -> None:
        start, _ = self._entry(request_id)
        del self._live[request_id]
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, self.span)
        for j in (i, i - 1):  # merge with the right neighbour, then the left
            if 0 <= j < len(self._starts) - 1 and self._starts[j] + self._lengths[j] == self._starts[j + 1]:
                self._lengths[j] += self._lengths.pop(j + 1)
                del self._starts[j + 1]

    def get_block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        start, n = self._entry(request_id)
        return tuple(range(start, start + -(-n // self.block_size)))

    def reserved_tokens(self, request_id: Hashable) -> int:
        """Slots reserved for the request (``span * block_size``), used or not."""
        self._entry(request_id)
        return self.span * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return sum(self._lengths)

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

    def _entry(self, request_id: Hashable) -> list[int]:
        try:
            return self._live[request_id]
        except (KeyError, TypeError):
            raise RequestError(f"unknown request {request_id!r}") from None
