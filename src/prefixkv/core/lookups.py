"""Lookups that change nothing: how much of a prompt an admission would find now
(``lookup``), and the device blocks of that prefix (``lookup_block_ids``). Neither asks
the shared store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import check_count, checked_ids
from ..extra_keys import ExtraKeys
from ..index import ContentIndex
from .block import Block
from .probe import BlockProbe
from .prompt import Prompt

if TYPE_CHECKING:
    from .manager import KVCacheManager


def lookup(self: KVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
           extra: ExtraKeys | None = None, max_hit_tokens: int | None = None) -> int:
    """Tokens of this prompt that an admission now (with this ``max_hit_tokens``)
    would find cached on the device and in host slots. Changes nothing (no
    references, no stats, no LRU update) and never asks the shared store. Takes a
    ``Prompt`` as ``add_request`` does. Raises as ``add_request`` for bad input."""
    if max_hit_tokens is not None:
        check_count("max_hit_tokens", max_hit_tokens, 0, None)
    return len(self._find(None, prompt_token_ids, extra, True, None, max_hit_tokens)[1]) * self.block_size


def lookup_block_ids(self: KVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
                     extra: ExtraKeys | None = None, max_hit_tokens: int | None = None
                     ) -> tuple[int, ...]:
    """The device blocks of the prefix ``lookup`` finds, in token order (it stops at
    the first block that is not in the device pool: host tier, store). Changes
    nothing. Takes a ``Prompt``. Raises as ``add_request`` for bad input."""
    if max_hit_tokens is not None:
        check_count("max_hit_tokens", max_hit_tokens, 0, None)
    hits = self._find(None, prompt_token_ids, extra, True, None, max_hit_tokens)[1]
    if self._host is None:  # every hit a device block: no type test or append a block (a
        # comprehension, whose read is specialized: ``map(attrgetter)`` reads each block's
        # ``block_id`` through the generic lookup, ~5x slower; events-r26.md)
        return tuple([b.block_id for b in hits])
    out = []
    for b in hits:
        if type(b) is not Block:
            break
        out.append(b.block_id)
    return tuple(out)


def cached_block_id(self: KVCacheManager, prompt_token_ids: Sequence[int] | Prompt, num_tokens: int, *,
                    extra: ExtraKeys | None = None) -> int | None:
    """The device block holding the content of the prompt's first ``num_tokens`` tokens
    (a multiple of ``block_size``, 1 block to all the prompt's full blocks), the last
    one included (``lookup`` leaves out the block holding a prompt's last token); None
    when no device block holds it now. Changes nothing (no reference, no LRU update).
    Takes a ``Prompt``. Raises RequestError for a bad ``num_tokens``, and as
    ``add_request`` for bad input. (One prompt asked again and again: ``block_probe``.)"""
    return block_probe(self, prompt_token_ids, extra=extra).at(num_tokens)


def block_probe(self: KVCacheManager, prompt_token_ids: Sequence[int] | Prompt, *,
                extra: ExtraKeys | None = None) -> BlockProbe:
    """The prompt encoded once, to ask ``cached_block_id`` of its prefixes again and
    again (``BlockProbe.at``): O(1) a question while the blocks found stay (probe.py).
    Changes nothing; holds no reference. Takes a ``Prompt``. Raises as ``add_request``
    for bad input."""
    req = self._find(None, prompt_token_ids, extra, False, None)[0]
    chunks = req.prompt_chunks
    assert chunks is not None, "_find sets a request's prompt chunks"
    return BlockProbe(self._index, self._host is not None, chunks, len(req.tokens) // self.block_size,
                      req.keys.base, req.keys.mm, self.block_size)


def held_content(self: KVCacheManager, block_id: int) -> tuple[int, int] | None:
    """What block ``block_id`` holds findable: (0, its content id), a content id naming
    one content for the process's life (never reused), None when it holds none (empty,
    partial, evicted, uncached, or caching off). Changes nothing. Raises RequestError
    for an id that is not one of this pool's."""
    b = self._pool.blocks[check_count("block id", block_id, 0, self.num_blocks - 1)]
    index = self._index
    cid = index.content_of(b) if isinstance(index, ContentIndex) else None
    return None if cid is None else (0, cid)


def held_contents(self: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    """``held_content``'s content id of each block of ``block_ids`` (0 where it holds
    none), in one pass. Changes nothing. Raises RequestError for an id that is not one
    of this pool's."""
    ids = checked_ids(block_ids, self.num_blocks)
    index = self._index
    if not isinstance(index, ContentIndex):
        return [0] * len(ids)
    return index.contents_of(list(map(self._pool.blocks.__getitem__, ids)))

