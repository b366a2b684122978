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
found. Its cost: the requests passed (those a search reaches before it stops) and the
entries that go. A hold no live request makes (a store fetch's, the null block's) is
never found, and its block's search then passes every request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .block import Block

Rows = Sequence[Sequence[Block | None]]


def computed_on(tables: Iterable[tuple[Rows, int]], blocks: list[Block]) -> list[Block]:
    """``blocks`` and the blocks live requests computed on top of them (see the module).
    ``tables``: per live request, its block rows (one per group; None where a window
    released an entry) and how many leading entries of each are full scheduled blocks
    (the only ones that go, or make a request's later ones go). Returns each block once,
    ``blocks`` first; changes nothing."""
    return _Search(list(tables), blocks).run()


class _Search:
    """One ``computed_on``: ``first[i]``, where request i's entries start going (its
    count of full entries while none does); ``known[b]``, the holders of a joined block
    ``b`` found so far; ``pending[j]``, the joined blocks at index j whose other holders
    are still wanted."""

    def __init__(self, reqs: list[tuple[Rows, int]], blocks: list[Block]) -> None:
        self.reqs = reqs
        self.first = [n for _, n in reqs]
        self.out = list(dict.fromkeys(blocks))
        self.going = set(self.out)
        self.known: dict[Block, int] = {}
        self.pending: dict[int, set[Block]] = {}

    def run(self) -> list[Block]:
        reqs, first = self.reqs, self.first
        # the holders of the named blocks: requests latest first (a failed load is a
        # recent request's), until every hold their ref_cnt counts is found
        named = set(self.out)
        wanted = sum(b.ref_cnt for b in named)
        for i in range(len(reqs) - 1, -1, -1):
            if wanted <= 0:
                break
            rows, n = reqs[i]
            if all(named.isdisjoint(row) for row in rows):
                continue
            js = [j for row in rows for j, b in enumerate(row) if b in named]
            wanted -= len(js)
            at = min(js)
            if at < n:
                self.goes_from(i, at)
        # then index by index upward (each hop lands further on): the other holders of
        # the blocks that joined there
        pending = self.pending
        while pending:
            j = min(pending)
            joined = pending.pop(j)
            wanted = sum(b.ref_cnt - self.known[b] for b in joined)
            for i in range(len(reqs) - 1, -1, -1):
                if wanted <= 0:
                    break
                if first[i] <= j:
                    continue
                held = [b for row in reqs[i][0]
                        if j < len(row) and (b := row[j]) is not None and b in joined]
                if held:
                    for b in held:
                        self.known[b] += 1
                    wanted -= len(held)
                    self.goes_from(i, j)
        return self.out

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
                if b.ref_cnt > 1:  # (held by another request too: its holders are wanted)
                    known[b] = 1
                    self.pending.setdefault(k, set()).add(b)
