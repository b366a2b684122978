"""``ContentIndex.match``: the blocks holding a prompt's prefix, found without taking them
(lookups, an admission with per-block extra keys), through the tier below where there is
one. ``claim`` (content.py) finds them and takes their references in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block
from .dropping import DroppingIndex
from .pending import content_id_of, walk_pending

NO_PARENT = Block(-1)  # the parent of a first block in a walk: never given a child


class MatchingIndex(DroppingIndex):
    """``ContentIndex`` less ``claim`` and its construction (see ``ContentIndex``)."""

    def match(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None, *,
              start: list[Block] | None = None) -> list[Block]:
        walked = False
        if self.run_counts.pending:  # (walks read each block's content: written first,
            if mm is None and start is None:  # unless the walk passes runs whole)
                hits = walk_pending(chunks, base, self._by_chunk.get, self._by_key,
                                    self._epoch)
                if self._lower is None:
                    return hits
                walked = True
            elif mm is None or self._lower is not None:  # (``_walk`` with ``mm`` writes
                self.settle_all()  # those it reads)
        if self._lower is None:
            return self._walk(chunks, base, mm)
        if walked:  # (the device's part, pending runs passed whole: below, the tier's)
            pass
        elif start is not None:  # the device's run, claimed already
            hits = list(start)
        else:
            hits = self._walk(chunks, base, None) if mm is None else []
        if len(hits) == len(chunks):
            return hits
        lower = self._lower
        cid = (content_id_of(hits[-1]) if walked else hits[-1].content_id) if hits else 0
        b = hits[-1] if hits else NO_PARENT
        get, by_key = self._by_chunk.get, self._by_key
        if mm is None and not by_key and not lower.by_key:  # the common case, in the tier
            return lower.walk(hits, chunks, cid, base, get if self.cut else None, b)
        below = lower.find
        c: Block | None
        for i in range(len(hits), len(chunks)):
            chunk = chunks[i]
            extra = base if mm is None or i >= len(mm) else mm[i]
            c = b.child  # the chained child first (a slot's chained child is found only so)
            if c.key != chunk or c.parent_cid != cid or c.extra != extra or c.twin:
                c = None
                if type(b) is Block or self.cut:  # past a slot only slots go on (``cut``)
                    c = get(chunk)
                    if c is None or c.parent_cid != cid or c.extra != extra:
                        c = by_key.get((cid, chunk, extra)) if by_key else None
                if c is None:  # the device misses: the chain may go on in the tier below
                    c = below(cid, chunk, extra)
                    if c is None:
                        break
            hits.append(c)
            cid = c.content_id
            b = c
        return hits

    def _walk(self, chunks: Sequence[bytes], base: bytes, mm: Sequence[bytes] | None) -> list[Block]:
        """``match`` without a tier below: each block is its parent's chained child or
        in the dicts, so the guess is tried first, as ``claim`` does. With ``mm``, a
        pending run is written when the walk reaches its head (its blocks are found
        through the head's ``child`` alone; no other pending block is in a dict or is a
        first block): the runs the walk reads, not all of them."""
        hits: list[Block] = []
        get, by_key = self._by_chunk.get, self._by_key
        cid, extra, b = 0, base, NO_PARENT
        c: Block | None
        for i, chunk in enumerate(chunks):
            if mm is not None:
                extra = mm[i] if i < len(mm) else base
                r = b.starts
                if r is not None and r.pending:
                    self._settle(r)
            c = b.child
            if c.key != chunk or c.parent_cid != cid or c.extra != extra or c.twin:
                c = get(chunk)
                if c is None or c.parent_cid != cid or c.extra != extra:
                    c = by_key.get((cid, chunk, extra)) if by_key else None
                    if c is None:
                        break
            hits.append(c)  # (not an alias: 3.11 specializes list.append called as a method)
            cid = c.content_id
            b = c
        return hits
