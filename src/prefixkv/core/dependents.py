"""The blocks live requests computed on top of blocks whose KV turned out invalid
(``uncache_blocks`` of either manager): what must stop being findable with them.

A live request holding a going block at index j of one of its rows (one row per group)
read it for everything it computed after j: its entries after j go, in every row, and a
request holding one of those goes the same way from there (it hit it, and computed its
own blocks on top), until nothing joins. A block sits at the same index in every row
that holds it (the same prefix), and each hop of the chain lands strictly further on::

    b:  | 0* | 1  | 2  | 3  |          * the failed block; b's entries after it go
    c:  | 0  | 1  | 2' | 3' |          c hit b's block 1: its entries after index 1 go
    e:  | 0  | 1  | 2' | 3" |          e hit c's block 2': its entries after index 2 go

So the search needs no pass over every entry of every request per hop: first the
requests holding a named block (a pass that stops once every holder its ``ref_cnt``
counts is found), then, index by index upward, the holders of the blocks that joined at
that index and are held by more than the request that brought them (``ref_cnt`` again),
each such search over the requests' entries at that index alone, stopping once they are
found (past the latest ``SCAN`` requests, the others' entries at that index are read at C
speed, all at once). The holds no live request makes (a store fetch's, a pending copy's, the null
block's) are the caller's ``outside``: not looked for. And once every named block is
placed (a holder found: they are at those indexes in every holder) the first search
too looks at those entries alone. Its cost: the requests passed (those a search
reaches before it stops; a named block's first holder found, per request a few entries)
and the entries that go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import getitem, gt

from .block import Block

Rows = Sequence[Sequence[Block | None]]

SCAN = 64
"""Requests a search looks at one by one (latest first) before it reads the others'
entries at its index at C speed (``_Search.holders``)."""


def computed_on(tables: Iterable[tuple[Rows, int]], blocks: list[Block],
                outside: Iterable[Block] = ()) -> list[Block]:
    """``blocks`` and the blocks live requests computed on top of them (see the module).
    ``tables``: per live request, its block rows (one per group; None where a window
    released an entry) and how many leading entries of each are full scheduled blocks
    (the only ones that go, or make a request's later ones go). ``outside``: the holds
    on blocks that no live request makes, a block once per hold (each counts in its
    ``ref_cnt``; one left out only makes a search pass more requests, one too many
    leaves a holder unfound). Returns each block once, ``blocks`` first; changes
    nothing."""
    return _Search(list(tables), blocks, Counter(outside)).run()


class _Search:
    """One ``computed_on``: ``first[i]``, where request i's entries start going (its
    count of full entries while none does); ``known[b]``, the holds of a joined block
    ``b`` found so far (its holders', and ``outside``'s); ``pending[j]``, the joined
    blocks at index j whose other holders are still wanted."""

    def __init__(self, reqs: list[tuple[Rows, int]], blocks: list[Block],
                 outside: Counter[Block]) -> None:
        self.reqs = reqs
        self.first = [n for _, n in reqs]
        self.out = list(dict.fromkeys(blocks))
        self.going = set(self.out)
        self.outside = outside
        self.known: dict[Block, int] = {}
        self.pending: dict[int, set[Block]] = {}
        self.columns: list[list[Sequence[Block | None]]] | None = None  # (``holders``)

    def run(self) -> list[Block]:
        reqs = self.reqs
        # the holders of the named blocks: requests latest first (a failed load is a
        # recent request's), until every hold their ref_cnt counts is found; each row
        # whole until every named block is placed, then its entries lo..hi-1 alone
        named = set(self.out)
        wanted = sum(b.ref_cnt - self.outside.get(b, 0) for b in named)
        unplaced = set(named)
        lo, hi = 1 << 62, 0  # (the placed ones' indexes: lo..hi-1)
        for i in range(len(reqs) - 1, -1, -1):
            if wanted <= 0:
                break
            rows, n = reqs[i]
            if unplaced:
                if all(named.isdisjoint(row) for row in rows):
                    continue
                js = [(j, b) for row in rows for j, b in enumerate(row) if b in named]
                unplaced.difference_update(b for _, b in js)
                at = min(j for j, _ in js)
                lo = min(lo, at)
                hi = max(hi, max(j for j, _ in js) + 1)
            else:
                if all(named.isdisjoint(row[lo:hi]) for row in rows):
                    continue
                js = [(j, b) for row in rows for j, b in enumerate(row[lo:hi], lo)
                      if b in named]
                at = min(j for j, _ in js)
            wanted -= len(js)
            if at < n:
                self.goes_from(i, at)
        # then index by index upward (each hop lands further on): the other holders of
        # the blocks that joined there
        pending = self.pending
        while pending:
            j = min(pending)
            joined = pending.pop(j)
            wanted = sum(b.ref_cnt - self.known[b] for b in joined)
            for i in self.holders(j, joined, wanted):
                for row in reqs[i][0]:
                    if j < len(row) and (b := row[j]) is not None and b in joined:
                        self.known[b] += 1
                self.goes_from(i, j)
        return self.out

    def holders(self, j: int, joined: set[Block], wanted: int) -> list[int]:
        """The requests holding one of ``joined`` at index j, before their ``first``,
        latest first, until ``wanted`` holds are found: the latest ``SCAN`` requests one
        by one, then (holds still wanted: an old holder) the others' entries at j at C
        speed, per group."""
        reqs, first = self.reqs, self.first
        out: list[int] = []
        stop = max(0, len(reqs) - SCAN)
        for i in range(len(reqs) - 1, stop - 1, -1):
            if wanted <= 0:
                return out
            if first[i] > j:
                held = sum(j < len(row) and row[j] in joined for row in reqs[i][0])
                if held:
                    out.append(i)
                    wanted -= held
        if wanted <= 0 or not stop:
            return out
        if self.columns is None:  # (per group, every request's row: once a call)
            width = max(len(rows) for rows, _ in reqs)
            self.columns = [[rows[g] if g < len(rows) else () for rows, _ in reqs]
                            for g in range(width)]
        found: set[int] = set()
        for rows in self.columns:
            long = list(map(gt, map(len, rows[:stop]), repeat(j)))  # (rows reaching j)
            at = map(getitem, compress(rows, long), repeat(j))
            found.update(compress(compress(range(stop), long), map(joined.__contains__, at)))
        out += sorted((i for i in found if first[i] > j), reverse=True)
        return out

    def goes_from(self, i: int, j: int) -> None:
        """Request i holds a going block at index j, before its ``first``: its entries
        after j up to those already gone join (each counted as held by it)."""
        rows, n = self.reqs[i]
        stop = self.first[i]
        self.first[i] = j
        hi = stop + 1 if stop < n else n  # (the entries at ``stop`` of its other rows too)
        going, known = self.going, self.known
        for row in rows:
            for k in range(j + 1, min(hi, len(row))):
                b = row[k]
                if b is None:
                    continue
                if b in going:
                    if b in known:
                        known[b] += 1
                    continue
                going.add(b)
                self.out.append(b)
                if b.ref_cnt > 1:  # (held by another request, or outside: holders wanted)
                    held = 1 + self.outside.get(b, 0)  # (this request's, and outside's)
                    if b.ref_cnt > held:
                        known[b] = held
                        self.pending.setdefault(k, set()).add(b)
