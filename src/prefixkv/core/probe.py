"""The device block holding each prefix of one prompt, asked again and again: an engine
that asks its pool about a request's blocks one at a time (vLLM's
``BlockPool.get_cached_block``, called by connectors per block per step).

A probe keeps the prompt encoded and the blocks its last walk found, with the content id
each held then. Content ids are never reused (``ContentIndex``), so a block that still
holds that content id, as the primary of its content (not a spare) and with content
(``key``), still holds that exact prefix: the answer, in O(1). Otherwise the walk goes
on from the deepest block of the prefix that still holds its content (one index probe a
block newly found), as ``match`` would from the root. A content is held by one primary
at a time, so the answer is the block ``match`` finds wherever the walk reaches it.

With a tier below the device (``match`` may pass slots and come back to the device) or
without an index (caching off), every question is ``match``'s whole walk, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import RequestError, check_count
from ..index import ContentIndex, NoIndex
from .block import Block


class BlockProbe:
    """Per prefix of one encoded prompt (``chunks``: its blocks' token bytes, ``full`` of
    them full; ``base``/``mm``: its extra-key bytes), the device block holding it now (``at``).
    Holds the blocks found last (not references: nothing is kept from eviction)."""

    __slots__ = ("_index", "_chunks", "_full", "_base", "_mm", "_hits", "_cids", "_whole", "block_size")

    def __init__(self, index: ContentIndex | NoIndex, tiered: bool, chunks: Sequence[bytes], full: int,
                 base: bytes, mm: Sequence[bytes] | None, block_size: int) -> None:
        self._index, self._chunks, self._full, self._base, self._mm = index, chunks, full, base, mm
        self._whole = tiered or not isinstance(index, ContentIndex)  # (``match`` each time)
        self._hits: list[Block] = []
        self._cids: list[int] = []
        self.block_size = block_size

    def at(self, num_tokens: int) -> int | None:
        """The device block holding the prompt's first ``num_tokens`` tokens (a multiple
        of the block size, one block to all the prompt's full blocks, the last one
        included), None when none holds it now. Changes nothing but a pending run's
        writes (``ContentIndex.held``). Raises RequestError for a bad ``num_tokens``."""
        b = self._block(num_tokens)
        return None if b is None else b.block_id

    def ids(self, num_tokens: int) -> tuple[int | None]:
        """``at``, as the one group's answer (``HybridKVCacheManager.prefix_probe``'s
        shape)."""
        return (self.at(num_tokens),)

    def copies(self, num_tokens: int, g: int = 0) -> tuple[int, ...]:
        """Every device block holding the prompt's first ``num_tokens`` tokens: the one
        ``at`` finds, then its held spares, the oldest first (``g``: the group, 0 the only
        one; another holds none). Raises as ``at``."""
        b = self._block(num_tokens)
        if b is None or g:
            return ()
        assert isinstance(self._index, ContentIndex), "a block found is a content index's"
        return (b.block_id, *(s.block_id for s in self._index.spares(b)))

    def _block(self, num_tokens: int) -> Block | None:
        bs = self.block_size
        check_count("num_tokens", num_tokens, bs, self._full * bs)
        if num_tokens % bs:
            raise RequestError(f"num_tokens must be a multiple of block_size {bs}, got {num_tokens}")
        k = num_tokens // bs
        return self._hits[k - 1] if k <= len(self._hits) and self._holds(k - 1) else self._walk(k)

    def _holds(self, i: int) -> bool:
        """Whether the block found for prefix ``i`` still holds it: the content id it held
        then, as its content's primary (not a spare), with content."""
        b = self._hits[i]
        return b.content_id == self._cids[i] and b.key is not None and not b.twin

    def _walk(self, k: int) -> Block | None:
        chunks, base, mm = self._chunks, self._base, self._mm
        if self._whole:
            found = self._index.match(chunks if k == len(chunks) else chunks[:k], base, mm)
            b = found[k - 1] if len(found) >= k else None
            return b if type(b) is Block else None
        assert isinstance(self._index, ContentIndex)
        hits, cids = self._hits, self._cids
        i = min(k - 1, len(hits))  # the deepest block of the prefix still holding its content
        while i and not self._holds(i - 1):
            i -= 1
        del hits[i:], cids[i:]
        held = self._index.held
        p = hits[-1] if hits else None
        while i < k:
            c = held(p, chunks[i], base if mm is None or i >= len(mm) else mm[i])
            if c is None:
                return None
            hits.append(c)
            cids.append(c.content_id)
            p = c
            i += 1
        return hits[-1]
