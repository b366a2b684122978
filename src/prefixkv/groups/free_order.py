"""The order in which a finished request's blocks join the free queue (the first given is
evicted first): vLLM's (group by group, each group's tail first), but a block that no hit
can use goes ahead of the rest, as soon as it becomes so.

A hit of ``h`` blocks on the request's prefix needs, in each group, the blocks
``num_unread(h*bs) .. h-1`` cached (``hits.py``). A block is of use while some hit that
needs it is *alive*: every block it needs is cached and not ahead of it in the order.
Going down vLLM's order, each block placed kills the hits that need it; a block whose
hits are all dead then is of no use, and goes next, before vLLM's next block (those that
become so together in vLLM's order: where no hit is lost, the order is vLLM's). So after
any number of evictions from this batch, the hits alive are a superset of those alive
after as many evictions in vLLM's own order (the blocks of use evicted are vLLM's first
ones; the others kill no hit). Example (chunked 12 beside a window of 6, block size 4,
16 tokens): the chunk group's block 2 ends a chunk, and no hit at a block boundary reads
it; it goes first, and the window's blocks 2 and 3, which the hit at 12 and 16 read,
stay after it.

What is not known here is taken as alive: hits longer than the request's own prefix
(another request may hold their blocks), and blocks of the prefix cached elsewhere, even
in the free queue ahead of this batch (they may be taken before, so the order never
counts on them to kill a hit).

Cost: once no windowed group has a block left to place and at most one group is full
attention, placing a block frees nothing more, and the rest goes in vLLM's order as
slices. Before that, rounds of one shape (group d's block j placed kills hit j + 1, and
every other group's block j follows) go as slices too (``_lockstep``); the rest is work
per block of the windows' held tail (a window's reach past its cut) and per hit those
blocks reach. Hits are looked at lazily (free_hits.py: a dead stretch is skipped in one
step from the blocks that kill it, and killed in one), and where a group misses blocks is
fetched in slices, from the top down (``found``), but not in a full-attention group known
to find the whole prefix (the manager's ``free_runs.finder``: no content lost since the
request's admission). A long request beside a window of W
tokens thus costs at most O(W / block_size) in Python plus C-speed passes over its tables
(benchmarks/results/free-order-cpu.md: 2,810 bytecodes for 16,384 blocks; free about twice
vLLM's plain order). The order is hybrid-r12's, block for block
(tests/free_order_reference.py keeps that cascade as the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import gt, is_not, itemgetter, or_
from typing import cast

from ..core.block import Block
from .free_hits import Hits
from .free_runs import Found, held, once, reach
from .request import GroupRequest
from .spec import GroupSpec

_FLIP = bytes.maketrans(b"\x00\x01", b"\x01\x00")
_RANK = itemgetter(0, 1)
_BLOCK = itemgetter(2)


def free_order(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
               found: Found, longer: bool, uncached: bool = False) -> list[Block]:
    """The request's blocks (not None), in the order to release them (module
    docstring). ``found``: as ``free_runs.Found``; ``longer``: whether a longer prefix
    than the request's exists (hits past it may need its blocks); ``uncached``: some
    group is an uncached window (``GroupSpec.cached``), whose blocks hold nothing a hit
    uses: they go first, then the others' in their order (``_cached_order``)."""
    if uncached:
        return _cached_order(specs, block_size, req, found, longer)
    if req.nodes and len(specs) > 1:
        cascade = _Cascade(specs, block_size, req, found, longer)
        if cascade.moves:
            return cascade.order()
    return list(filter(None, chain.from_iterable(map(reversed, req.tables))))


def _cached_order(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
                  found: Found, longer: bool) -> list[Block]:
    """``free_order`` beside uncached windows: their blocks (each tail first), then the
    cached groups' in the order ``free_order`` gives them alone (the hits are theirs)."""
    kept = [g for g, s in enumerate(specs) if s.cached]
    first: list[Block] = [b for g, s in enumerate(specs) if not s.cached
                          for b in reversed(req.tables[g]) if b is not None]
    view = GroupRequest(req.request_id, req.tokens, req.keys, len(kept))
    view.nodes, view.cut = req.nodes, [req.cut[g] for g in kept]
    view.tables = [req.tables[g] for g in kept]
    return first + free_order([specs[g] for g in kept], block_size, view,
                              lambda i, lo, hi: found(kept[i], lo, hi), longer)


class _Cascade:
    """The hits of the request's prefix, 1 .. ``top`` blocks, alive or dead, and the
    blocks of use to them. Past ``top`` a hit needs no block below k but full
    attention's: those hits are one, ``tail`` (alive only where a longer prefix is)."""

    def __init__(self, specs: Sequence[GroupSpec], bs: int, req: GroupRequest, found: Found,
                 longer: bool) -> None:
        k = len(req.nodes)
        self.specs, self.bs, self.k, self.tables = specs, bs, k, req.tables
        self.top = top = k + max(reach(s, bs) for s in specs) if longer else k
        self.rel = [s.releases for s in specs]
        self.windows = [g for g, s in enumerate(specs) if s.releases]
        self.fulls = [g for g, s in enumerate(specs) if not s.releases]
        self.hits = Hits(specs, bs, k, top, found)
        self.placed = [bytearray(len(t)) for t in req.tables]
        # windowed groups' blocks whose place matters, from ``start[g]`` (below it the
        # table is empty); full groups' are asked (``once``) where visited
        self.at: list[list[Block | None]] = [[] for _ in specs]
        self.start = [0] * len(specs)
        self.pending = 0  # windowed groups' blocks not placed yet
        for g in self.windows:
            t, c = req.tables[g], min(req.cut[g], k)
            if t[:c].count(None) != c:
                c = 0
            row: list[Block | None] = [None] * k
            flags = held(t[c:k])
            if flags.count(1) == k - c:
                row[c:k] = t[c:k]
            else:
                for j in compress(range(c, k), flags):
                    row[j] = t[j]
            self.pending += flags.count(1)
            self.at[g], self.start[g] = row, c
        self.moves = self.pending > 0 or any(
            any(map(once, reversed(req.tables[g][:k]))) for g in self.fulls)
        self.tail = longer and self.hits.alive(top)
        self.freed: list[tuple[int, int, Block]] = []  # (group, -j, block): vLLM's order
        self.bulk: dict[int, list[Block]] = {}  # full groups' blocks freed, last first

    def _of_use(self, g: int, j: int) -> bool:
        """Whether a hit alive needs block j of group g."""
        if not self.rel[g]:
            return self.tail or self.hits.below(self.top) > j
        # (no hit alive above j: the common answer once a full group's block is placed)
        return self.hits.below(self.top) > j and self.hits.above(j + 1) <= self.hits.last(g, j)

    def _block(self, g: int, j: int) -> Block | None:
        """Block j of group g if its place matters, else None."""
        if j >= self.k:
            return None
        if self.rel[g]:
            return self.at[g][j]
        b = self.tables[g][j]
        return b if once(b) else None

    def order(self) -> list[Block]:
        k, placed = self.k, self.placed
        out: list[Block] = []
        low = k if self.tail else self.hits.below(self.top)  # full groups' blocks from
        for g, s in enumerate(self.specs):  # it on, and windows' of no use, go first
            done, first = placed[g], k  # (blocks from first on are of use)
            if self.hits.steady[g] and self.start[g] < k:  # (hit j + 1 needs block j, and
                hi = self.hits.last(g, k - 1)  # the hits alive live .. hi need blocks from
                live = self.hits.alive_down(self.start[g] + 1, hi)  # num_unread(live * bs) on)
                if live <= hi:
                    first = max(self.start[g], min(s.num_unread(live * self.bs, self.bs), live - 1))
            for j in range(first - 1, self.start[g] - 1 if s.releases else low - 1, -1):
                b = self._block(g, j)
                if b is not None and not self._of_use(g, j):
                    out.append(b)
                    done[j] = 1
                    self.pending -= s.releases
        self.full_next = low - 1  # full groups: their blocks above it are placed
        alone = len(self.fulls) <= 1
        for g, t in enumerate(self.tables):
            done, releases, j = placed[g], self.rel[g], len(t) - 1
            while j >= self.start[g]:
                if self.pending == 0 and alone:  # (placing a block frees nothing now)
                    for g2 in range(g, len(self.tables)):
                        self._rest(g2, j if g2 == g else len(self.tables[g2]) - 1, out)
                    return out
                b = t[j]
                if b is not None and not done[j]:
                    if self._block(g, j) is None:
                        out.append(b)
                    elif (last := self._lockstep(g, j, out)) <= j:
                        j = last
                    else:
                        out.append(b)
                        done[j] = 1
                        self.pending -= releases
                        self._kill(g, j)
                        if self.freed or self.bulk:
                            self._flush(out)
                j -= 1
        return out

    def _rest(self, g: int, last: int, out: list[Block]) -> None:
        """Group g's blocks ``last`` down to 0 that are not placed, in vLLM's order."""
        t, done, lo = self.tables[g], self.placed[g], self.start[g]
        if last < lo:
            return
        mid = done.find(1, lo, last + 1)  # (from the lowest placed block up: by flags)
        mid = last + 1 if mid < 0 else mid
        if mid <= last:
            out += filter(None, compress(t[mid:last + 1][::-1], done[mid:last + 1][::-1].translate(_FLIP)))
        below = t[lo:mid]
        below.reverse()
        out += filter(None, below) if None in below else cast("list[Block]", below)

    def _flush(self, out: list[Block]) -> None:
        """The blocks freed by the last placement, in vLLM's order (by group, each
        group's last first)."""
        freed, i = sorted(self.freed, key=_RANK), 0
        for g in sorted(self.bulk):
            while i < len(freed) and freed[i][0] < g:
                out.append(freed[i][2])
                i += 1
            out += self.bulk[g]
        out += map(_BLOCK, freed[i:])
        self.freed.clear()
        self.bulk.clear()

    def _free(self, g: int, j: int) -> None:
        """Block j of group g is of no use now: it goes right after the block placed."""
        b = self._block(g, j)
        if b is not None and not self.placed[g][j]:
            self.placed[g][j] = 1
            self.pending -= self.rel[g]
            self.freed.append((g, -j, b))

    def _kill(self, g: int, j: int) -> None:
        """Block j of group g is placed: the hits that need it die, and what is then
        of no use goes next."""
        full = not self.rel[g]
        if full:
            self.tail = False
        h = self.hits.below(self.top if full else self.hits.last(g, j))
        spans = []
        while h > j:  # (each stretch of hits alive at once, downward)
            low = max(j + 1, min(h, self.hits.alive_down(j + 1, h)))
            self.hits.kill(low, h)
            spans.append((low, h))
            h = self.hits.below(low - 1)
        k, bs = self.k, self.bs
        for low, h in spans:  # (windowed blocks that only those hits read: of no use now)
            for g2 in self.windows:
                row, done = self.at[g2], self.placed[g2]
                a, b = max(self.start[g2], min(self.specs[g2].num_unread(low * bs, bs), k)), min(h, k)
                for j2 in compress(range(a, b), map(is_not, row[a:b], repeat(None))) if a < b else ():
                    if not done[j2] and not self._of_use(g2, j2):
                        self._free(g2, j2)
        if not self.tail and self.fulls:
            top = self.hits.below(self.top)  # the longest hit alive (0: none)
            if self.full_next >= top:  # (full groups' blocks top .. full_next, at once)
                lo, hi = top, self.full_next + 1
                for g2 in self.fulls:
                    new = self._present(g2, lo, hi)
                    done = self.placed[g2]
                    done[lo:hi] = bytes(map(or_, done[lo:hi], new))
                    blocks = cast("list[Block]", self.tables[g2][lo:hi])  # (None where new is 0)
                    self.bulk[g2] = list(compress(blocks[::-1], new[::-1]))
                self.full_next = top - 1

    def _present(self, g: int, lo: int, hi: int) -> bytes:
        """1 for each block lo .. hi-1 of group g whose place matters and is not placed
        yet (``hi <= k``)."""
        if self.rel[g]:
            here = bytes(map(is_not, self.at[g][lo:hi], repeat(None)))
        else:
            here = held(self.tables[g][lo:hi])
        return bytes(map(gt, here, self.placed[g][lo:hi]))

    def _lockstep(self, d: int, top: int, out: list[Block]) -> int:
        """Rounds of one shape, at once, from block ``top`` of group ``d`` (the next to
        place) down: in round j, block j of d is placed and kills hit j + 1, the longest
        alive (hit j lives on), and then every other group's block j goes, where its
        place matters and it is not placed yet (no hit alive needs it). Returns the last
        round's j (``top + 1``: not one round of that shape). A round per block in
        Python would cost as much as the rest of the order together."""
        if self.tail or (self.fulls and self.full_next != top) or self.hits.below(self.top) != top + 1:
            return top + 1
        span = 64
        while True:  # rounds top .. low: every group's flags stay as at top (d's: 1)
            low = floor = max(0, top + 1 - span)
            cols = []
            for g in self.windows + self.fulls:  # (the windows' flags are cheap: bound first)
                f = self._present(g, low, top + 1)
                on = f[-1]
                if g == d and not on:
                    return top + 1
                low += f.rfind(b"\x00" if on else b"\x01") + 1
                if on:
                    cols.append(g)
            if low > floor or floor == 0:
                break
            span *= 8
        low = self.hits.alive_down(low, top)
        if low >= top:  # (one round or none: the general path)
            return top + 1
        n = top + 1 - low
        cols.sort()
        cols.remove(d)
        cols.insert(0, d)
        step = len(cols)
        rounds: list[Block | None] = [None] * (n * step)
        for i, g in enumerate(cols):
            rounds[i::step] = self.tables[g][low:top + 1][::-1]
            self.placed[g][low:top + 1] = b"\x01" * n
            self.pending -= n * self.rel[g]
        out += cast("list[Block]", rounds)
        self.hits.kill(low + 1, top + 1)
        if self.fulls:
            self.full_next = low - 1
        return low
