"""Where an eviction's list of blocks holds pending runs' blocks (``index/pending.py``):
those have no key, and no dict entry for the index to drop; their content is read from
their run's record. ``BlockPool._evict`` notes each span (``lo, hi``: the index skips
them when it unkeys) as it takes a pending run whole, or cuts its tail, and when a tier
below keeps evicted content (``RunCounts.spans``) their records here: the tier reads
their content (``content``; ``among``: the positions of given content ids).

    evicted:  b b [p p p p] b [q q] b      p, q: two pending runs' blocks (spans)
"""

from __future__ import annotations

from collections.abc import Sequence

from .block import Block, key_chunk
from .run import Run

Content = tuple[int, bytes, bytes, int]
"""A block's content: (parent content id, token bytes, extra bytes, content id)."""


class Keyless:
    """The spans of one eviction's list that are pending runs' blocks, each with its
    run's record as it was when they were taken (``data``, ids, extra bytes)."""

    __slots__ = ("spans",)

    def __init__(self) -> None:
        # (lo, hi, data, width, first position in the run, +1 or -1, pcid, cid0, extra)
        self.spans: list[tuple[int, int, bytes, int, int, int, int, int, bytes]] = []

    def add(self, lo: int, run: Run, at: int, step: int, k: int) -> None:
        """Positions ``lo..lo + k - 1`` of the list hold pending ``run``'s blocks from
        its block ``at`` on, by ``step`` (1 forward, -1 backward); ``run`` as it is
        before it is cut (``Run.truncate``) or evicted."""
        width = len(run.data) // (len(run.blocks) + 1)
        self.spans.append((lo, lo + k, run.data, width, at, step, run.pcid, run.cid0, run.extra))

    def content(self, i: int) -> Content:
        """The content of the list's block ``i`` (in a span): ``(parent content id, token
        bytes, extra bytes, content id)``."""
        for lo, hi, data, width, at, step, pcid, cid0, extra in self.spans:
            if lo <= i < hi:
                p = at + step * (i - lo)  # (its position in the run: 0 the head's child)
                return (pcid if p == 0 else cid0 + p - 1, data[(p + 1) * width:(p + 2) * width],
                        extra, cid0 + p)
        raise IndexError(f"position {i} is in no pending span")

    def among(self, blocks: Sequence[Block], start: int, ids: set[int]) -> list[tuple[int, Content]]:
        """The positions of ``blocks[start:]`` whose content id is in ``ids``, each with its
        content (as ``content``): a keyed block's from the block (blocks with no key
        outside the spans are passed by), a span's from its record. A span is not walked:
        in it, position ``i`` holds id ``cid0 + p + step * (i - lo)``, so each id names at
        most one position; a span costs the smaller of its length and ``len(ids)`` set
        probes, in C (a lost eviction with a pending run of 8,192 blocks and a handful of
        ids: ~90 bytecodes a block before, results/store25-r27.md section 9)."""
        out: list[tuple[int, Content]] = []
        at = start
        for lo, hi, data, width, p0, step, pcid, cid0, extra in self.spans:
            if hi <= start:
                continue
            i = max(lo, start)
            out += keyed_among(blocks, at, i, ids)
            first = cid0 + p0 + step * (i - lo)  # (block i's id)
            r = range(first, first + step * (hi - i), step)
            for c in (ids.intersection(r) if len(r) <= len(ids) else [c for c in ids if c in r]):
                p = c - cid0  # (its position in the run; step is 1 or -1)
                out.append((lo + (p - p0) * step, (pcid if p == 0 else c - 1,
                                                   data[(p + 1) * width:(p + 2) * width], extra, c)))
            at = hi
        out += keyed_among(blocks, at, len(blocks), ids)
        return out


def keyed_among(blocks: Sequence[Block], lo: int, hi: int, ids: set[int]) -> list[tuple[int, Content]]:
    """``Keyless.among`` for ``blocks[lo:hi]``, keyed blocks (the others passed by)."""
    return [(i, (b.parent_cid, key_chunk(b.key), b.extra, b.content_id)) for i in range(lo, hi)
            if (b := blocks[i]).content_id in ids and b.key is not None]


_new = object.__new__


def new_keyless() -> Keyless:
    """``Keyless()``, the same empty record, made without the class call's machine code
    (``type_call``, ``slot_tp_init``, a frame pushed from C), which an eviction, the one
    caller, runs for this alone: cold at a store start (results/store25-r24.md)."""
    k: Keyless = _new(Keyless)
    k.spans = []
    return k
