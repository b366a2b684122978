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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.block import Block
from .request import GroupRequest
from .spec import GroupSpec


def free_order(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
               cached: Callable[[int, int], bool], longer: bool) -> list[Block]:
    """The request's blocks (not None), in the order to release them (module
    docstring). ``cached(g, j)``: whether group ``g`` finds block ``j`` of the request's
    prefix (``j < len(req.nodes)``), by any block; ``longer``: whether a longer prefix
    than the request's exists (hits past it may need its blocks)."""
    base = [(g, j, b) for g, t in enumerate(req.tables) for j in range(len(t) - 1, -1, -1)
            if (b := t[j]) is not None]
    k = len(req.nodes)
    # the blocks whose place matters: cached content this release frees (a spare's place
    # goes to its primary when that is free)
    joining = {id(b) for _, j, b in base if j < k and b.ref_cnt == 1 and b.key is not None}
    if not joining or len(specs) == 1:
        return [b for _, _, b in base]
    return _Cascade(specs, block_size, k, cached, longer).order(base, joining)


class _Cascade:
    """The hits of the request's prefix, 1 .. ``top`` blocks, alive or dead, and the
    blocks of use to them. Past ``top`` a hit needs no block below k but full
    attention's: those hits are one, ``tail`` (alive only where a longer prefix is)."""

    def __init__(self, specs: Sequence[GroupSpec], bs: int, k: int,
                 cached: Callable[[int, int], bool], longer: bool) -> None:
        self.specs, self.k = specs, k
        top = k + max(_reach(s, bs) for s in specs) if longer else k
        self.top = top
        self.firsts = [[s.num_unread(h * bs, bs) if s.releases else 0 for h in range(top + 1)]
                       for s in specs]
        alive = [False] * (top + 2)
        missing = []  # per group: blocks below j that the group does not find
        for g in range(len(specs)):
            row = [0]
            for j in range(k):
                row.append(row[-1] + (not cached(g, j)))
            missing.append(row)
        for h in range(1, top + 1):
            alive[h] = all(m[min(h, k)] == m[min(f[h], k)] for m, f in zip(missing, self.firsts, strict=True))
        self.alive = alive
        self.tail = longer and alive[top]
        # union-find over h: the next alive at or above, the last alive at or below
        self.up = [h if alive[h] or h == top + 1 else h + 1 for h in range(top + 2)]
        self.down = [h if alive[h] or h == 0 else h - 1 for h in range(top + 2)]
        # per windowed group, block j's hits: (j, last[g][j]]
        self.last: list[list[int]] = []
        for g, s in enumerate(specs):
            row, h = [], 0
            for j in range(k):
                while h < top and self.firsts[g][h + 1] <= j:
                    h += 1
                row.append(h if s.releases else top)
            self.last.append(row)

    def _find(self, links: list[int], h: int) -> int:
        while links[h] != h:
            links[h] = links[links[h]]
            h = links[h]
        return h

    def of_use(self, g: int, j: int) -> bool:
        """Whether a hit alive needs block j of group g."""
        if not self.specs[g].releases:
            return self.tail or self._find(self.down, self.top) > j
        return self._find(self.up, j + 1) <= self.last[g][j]

    def order(self, base: list[tuple[int, int, Block]], joining: set[int]) -> list[Block]:
        k = self.k
        self.out: list[Block] = []
        self.placed: set[int] = set()
        self.at: list[dict[int, Block]] = [{} for _ in self.specs]
        for g, j, b in base:
            if id(b) in joining:
                self.at[g][j] = b
        self.full_next = [k - 1] * len(self.specs)  # full groups: blocks above are placed
        for g, j, b in base:  # first what is of no use already
            if j in self.at[g] and not self.of_use(g, j):
                self._put(b)
        rank = {id(b): i for i, (_, _, b) in enumerate(base)}
        self.freed: list[Block] = []
        for g, j, b in base:
            if id(b) in self.placed:
                continue
            self._put(b)
            if j in self.at[g]:
                self.freed = []
                self._kill(g, j)
                self.out += sorted(self.freed, key=lambda x: rank[id(x)])  # (in vLLM's order)
        return self.out

    def _put(self, b: Block) -> None:
        self.out.append(b)
        self.placed.add(id(b))

    def _free(self, b: Block) -> None:
        """``b`` is of no use now: it goes right after the block just placed."""
        self.freed.append(b)
        self.placed.add(id(b))

    def _kill(self, g: int, j: int) -> None:
        """Block j of group g is placed: the hits that need it die, and what is then
        of no use goes next."""
        full = not self.specs[g].releases
        if full:
            self.tail = False
        h = self._find(self.down, self.top if full else self.last[g][j])
        while h > j:  # (downward: each death looks at the blocks just below it)
            self._die(h)
            h = self._find(self.down, h - 1)
        if not self.tail:
            top = self._find(self.down, self.top)  # the longest hit alive (0: none)
            for g2, s in enumerate(self.specs):
                if not s.releases:
                    while self.full_next[g2] >= top:
                        b = self.at[g2].get(self.full_next[g2])
                        if b is not None and id(b) not in self.placed:
                            self._free(b)
                        self.full_next[g2] -= 1

    def _die(self, h: int) -> None:
        self.alive[h] = False
        self.up[h], self.down[h] = h + 1, h - 1
        below = self._find(self.down, h - 1)  # blocks under it keep that hit
        for g, s in enumerate(self.specs):
            if s.releases:
                for j in range(max(below, self.firsts[g][h]), min(h, self.k)):
                    b = self.at[g].get(j)
                    if b is not None and id(b) not in self.placed and not self.of_use(g, j):
                        self._free(b)


def _reach(spec: GroupSpec, block_size: int) -> int:
    """Blocks past a block j up to the last hit that needs it (1 + the blocks a query
    reads behind it); 0 for full attention (every hit above j needs it)."""
    if not spec.releases:
        return 0
    return spec.release_at(0, block_size) // block_size + 1
