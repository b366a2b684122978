"""The hits of a request's prefix for ``free_order.py``: 1 .. ``top`` blocks, alive or
dead, asked lazily. A hit is alive unless a pointer says otherwise: ``down[h]``
(``up[h]``) is set once h is known dead, and every hit strictly between it and h is dead
too; a hit found dead at the start gets pointers past the whole stretch its missed
blocks kill, and the cascade kills stretches of hits with one dict update each.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat

from .free_runs import Found, Misses, steady
from .spec import GroupSpec


class Hits:
    """Which hits of the prefix are alive (module docstring)."""

    def __init__(self, specs: Sequence[GroupSpec], bs: int, k: int, top: int, found: Found) -> None:
        self.specs, self.bs, self.k, self.top = specs, bs, k, top
        self.steady = [steady(s, bs) for s in specs]
        self.misses = [Misses(found, g, k) for g in range(len(specs))]
        self.down: dict[int, int] = {}
        self.up: dict[int, int] = {}
        self.seen: set[int] = set()  # hits found alive at the start

    def alive(self, h: int) -> bool:
        """Whether hit h (not killed) was alive at the start; a dead one gets pointers
        past the stretch of hits that its missed blocks kill."""
        if h in self.seen:
            return True
        k, bs, hi = self.k, self.bs, min(h, self.k)
        low, high = h, -1  # the stretch (low, high] is dead
        for g, s in enumerate(self.specs):
            lo = min(s.num_unread(h * bs, bs), k) if s.releases else 0
            q = self.misses[g].last(lo, hi) if lo < hi else -1
            if q < 0:
                continue
            if not s.releases:  # (every hit above the first miss needs it)
                low, high = min(low, self.misses[g].at[0]), self.top
            elif self.steady[g]:  # (every hit needs its own last block: one in the run)
                first, end = self.misses[g].run(q)
                low, high = min(low, first), max(high, self.last(g, end))
            else:
                low, high = min(low, q), max(high, self.last(g, q))
        if high < 0:
            self.seen.add(h)
            return True
        self.down[h], self.up[h] = low, high + 1
        return False

    def alive_down(self, low: int, hi: int) -> int:
        """The least ``h >= low`` with every hit ``h .. hi`` alive (``hi + 1``: none),
        at once: where the groups miss blocks, and the pointers, in C-speed passes."""
        k, bs = self.k, self.bs
        for g, s in enumerate(self.specs):
            lo = min(s.num_unread(low * bs, bs), k) if s.releases else 0
            q = self.misses[g].last(lo, min(hi, k)) if lo < min(hi, k) else -1
            if q >= 0:
                low = max(low, self.last(g, q) + 1 if s.releases else hi + 1)
        hits = range(hi, low - 1, -1)
        return max(low, next(compress(hits, map(self.down.__contains__, hits)), low - 1) + 1)

    def kill(self, low: int, high: int) -> None:
        """Hits ``low .. high`` die (those alive among them), at once."""
        dead = range(low, high + 1)
        self.down.update(zip(dead, repeat(low - 1)))
        self.up.update(zip(dead, repeat(high + 1)))

    def last(self, g: int, j: int) -> int:
        """The longest hit that needs block j of windowed group g (those above j do)."""
        return min(self.top, (self.specs[g].unread_from(j, self.bs) - 1) // self.bs)

    def below(self, h: int) -> int:
        """The longest hit alive of at most ``h`` blocks (0: none)."""
        return self.walk(self.down, h, 0)

    def above(self, h: int) -> int:
        """The shortest hit alive of at least ``h`` blocks (top + 1: none)."""
        return self.walk(self.up, h, self.top + 1)

    def walk(self, ptrs: dict[int, int], h: int, end: int) -> int:
        """From hit h along ``ptrs`` to the first hit alive, or ``end`` (the pointers
        never pass it); the hits walked over then point there."""
        path = []
        while h != end:
            nxt = ptrs.get(h)
            if nxt is None:
                if self.alive(h):
                    break
                nxt = ptrs[h]
            path.append(h)
            h = nxt
        for x in path[:-1]:
            ptrs[x] = h
        return h
