"""The finished request's free order as hybrid-r12 wrote it (groups/free_order.py at
50b1e6a): one cascade over every hit and block of the prefix, ``cached(g, j)`` asked per
block. Kept as the reference the faster module must equal (tests/test_groups_free_order.py)
and as the old side of benchmarks/bench_free_order.py; not part of the package."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prefixkv.core.block import Block
from prefixkv.groups.request import GroupRequest
from prefixkv.groups.spec import GroupSpec


def free_order(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
               cached: Callable[[int, int], bool], longer: bool) -> list[Block]:
    """The request's blocks (not None), in the order to release them (module
    docstring). ``cached(g, j)``: whether group ``g`` finds block ``j`` of the request's
    prefix (``j < len(req.nodes)``), by any block; ``longer``: whether a longer prefix
    than the request's exists (hits past it may need its blocks)."""
    k = len(req.nodes)
    base: list[Block] = []
    # per group, the blocks whose place matters (None elsewhere): cached content this
    # release frees (a spare's place goes to its primary when that is free)
    at: list[list[Block | None]] = []
    moves = False
    for t in req.tables:
        row: list[Block | None] = [None] * k
        for j in range(len(t) - 1, -1, -1):
            b = t[j]
            if b is not None:
                base.append(b)
                if j < k and b.key is not None and b.ref_cnt == 1:
                    row[j] = b
                    moves = True
        at.append(row)
    if not moves or len(specs) == 1:
        return base
    return _Cascade(specs, block_size, k, cached, longer, at).order(req.tables)


class _Cascade:
    """The hits of the request's prefix, 1 .. ``top`` blocks, alive or dead, and the
    blocks of use to them. Past ``top`` a hit needs no block below k but full
    attention's: those hits are one, ``tail`` (alive only where a longer prefix is)."""

    def __init__(self, specs: Sequence[GroupSpec], bs: int, k: int, cached: Callable[[int, int], bool],
                 longer: bool, at: list[list[Block | None]]) -> None:
        self.specs, self.k, self.at = specs, k, at
        top = k + max(_reach(s, bs) for s in specs) if longer else k
        self.top = top
        self.windows = [g for g, s in enumerate(specs) if s.releases]
        self.fulls = [g for g, s in enumerate(specs) if not s.releases]
        # firsts[g][h]: the first block a hit of h blocks needs in windowed group g
        self.firsts: list[list[int]] = [[] for _ in specs]
        alive = [True] * (top + 2)
        alive[0] = alive[top + 1] = False
        for g, s in enumerate(specs):
            miss, row = 0, [0]  # blocks below j the group does not find
            for j in range(k):
                miss += not cached(g, j)
                row.append(miss)
            if s.releases:
                self.firsts[g] = f = [s.num_unread(h * bs, bs) for h in range(top + 1)]
                for h in range(1, top + 1):
                    if alive[h] and row[min(h, k)] != row[min(f[h], k)]:
                        alive[h] = False
            elif miss:
                for h in range(1, top + 1):
                    if alive[h] and row[min(h, k)]:
                        alive[h] = False
        self.tail = longer and alive[top]
        # the last alive at or below h (union-find, halved paths), and at or above
        self.down = [h if alive[h] or h == 0 else h - 1 for h in range(top + 2)]
        self.up = [h if alive[h] or h == top + 1 else h + 1 for h in range(top + 2)]
        # per windowed group, block j's hits: (j, last[g][j]]
        self.last: list[list[int]] = [[] for _ in specs]
        for g in self.windows:
            f, row, h = self.firsts[g], [], 0
            for j in range(k):
                while h < top and f[h + 1] <= j:
                    h += 1
                row.append(h)
            self.last[g] = row
        self.placed = [bytearray(k) for _ in specs]
        # windowed groups' blocks not placed yet: once none is left, beside one full group,
        # placing a block frees nothing more (that group's blocks above it went before)
        self.pending = sum(b is not None for g in self.windows for b in at[g])
        self.freed: list[tuple[int, int, Block]] = []  # (group, -j, block): vLLM's order

    def _below(self, h: int) -> int:
        """The longest hit alive of at most ``h`` blocks (0: none)."""
        down = self.down
        while down[h] != h:
            down[h] = down[down[h]]
            h = down[h]
        return h

    def _of_use(self, g: int, j: int) -> bool:
        """Whether a hit alive needs block j of group g."""
        if not self.specs[g].releases:
            return self.tail or self._below(self.top) > j
        up, h = self.up, j + 1
        while up[h] != h:
            up[h] = up[up[h]]
            h = up[h]
        return h <= self.last[g][j]

    def order(self, tables: list[list[Block | None]]) -> list[Block]:
        at, placed, out = self.at, self.placed, []
        low = self.k if self.tail else self._below(self.top)  # full groups' blocks from
        for g, row in enumerate(at):  # it on, and windows' of no use, go first
            for j in range(self.k - 1, -1 if self.specs[g].releases else low - 1, -1):
                b = row[j]
                if b is not None and not self._of_use(g, j):
                    out.append(b)
                    placed[g][j] = 1
                    self.pending -= self.specs[g].releases
        self.full_next = [self.k - 1] * len(self.specs)  # full groups: blocks above are placed
        alone = len(self.fulls) <= 1
        for g, t in enumerate(tables):
            row, done = at[g], placed[g]
            for j in range(len(t) - 1, -1, -1):
                b = t[j]
                if b is None:
                    continue
                if j >= self.k or row[j] is None:
                    out.append(b)
                elif not done[j]:
                    out.append(b)
                    done[j] = 1
                    if self.pending == 0 and alone:
                        continue
                    self.pending -= self.specs[g].releases
                    self._kill(g, j)
                    if self.freed:
                        self.freed.sort(key=lambda x: (x[0], x[1]))
                        out += [x[2] for x in self.freed]
                        self.freed = []
        return out

    def _free(self, g: int, j: int) -> None:
        """Block j of group g is of no use now: it goes right after the block placed."""
        b = self.at[g][j]
        if b is not None and not self.placed[g][j]:
            self.placed[g][j] = 1
            self.pending -= self.specs[g].releases
            self.freed.append((g, -j, b))

    def _kill(self, g: int, j: int) -> None:
        """Block j of group g is placed: the hits that need it die, and what is then
        of no use goes next."""
        full = not self.specs[g].releases
        if full:
            self.tail = False
        h = self._below(self.top if full else self.last[g][j])
        while h > j:  # (downward: each death looks at the blocks just below it)
            self._die(h)
            h = self._below(h - 1)
        if not self.tail and self.fulls:
            top = self._below(self.top)  # the longest hit alive (0: none)
            for g2 in self.fulls:
                while self.full_next[g2] >= top:
                    self._free(g2, self.full_next[g2])
                    self.full_next[g2] -= 1

    def _die(self, h: int) -> None:
        self.up[h], self.down[h] = h + 1, h - 1
        below = self._below(h - 1)  # blocks under it keep that hit
        for g in self.windows:
            row, done = self.at[g], self.placed[g]
            for j in range(max(below, self.firsts[g][h]), min(h, self.k)):
                if row[j] is not None and not done[j] and not self._of_use(g, j):
                    self._free(g, j)


def _reach(spec: GroupSpec, block_size: int) -> int:
    """Blocks past a block j up to the last hit that needs it (1 + the blocks a query
    reads behind it); 0 for full attention (every hit above j needs it)."""
    if not spec.releases:
        return 0
    return spec.unread_from(0, block_size) // block_size + 1


def release_order_whole(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
                        going: Sequence[Sequence[Block | None]],
                        finds: Callable[[int, Sequence[object]], Iterable[bool]]) -> list[Block]:
    """groups/release_order.py before deps-r15 (its view of the step copied each window's
    whole table, from block 0): the oracle of the view that leaves the blocks below the
    cuts out (tests/test_groups_release_order.py), and the old side of
    benchmarks/bench_free_order.py's steps."""
    from prefixkv.groups.free_order import free_order as current
    windows = [g for g, part in enumerate(going) if part and specs[g].releases]
    if len(windows) < 2 or all(len(going[g]) == 1 for g in windows):
        return req.release(going)
    view = GroupRequest(req.request_id, req.tokens, req.keys, len(windows))
    view.nodes = nodes = req.nodes
    view.cut = [req.cut[g] for g in windows]
    empty: list[Block | None] = [None]
    view.tables = [empty * req.cut[g] + list(going[g]) for g in windows]
    order = current([specs[g] for g in windows], block_size, view,
                    lambda i, lo, hi: finds(windows[i], nodes[lo:hi]), True)
    req.release(going)
    return order
