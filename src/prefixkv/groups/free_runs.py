"""What ``free_order.py`` asks of a finished request's tables and of the groups' indexes,
in runs rather than per block: where a group misses the prefix (``Misses``, fetched in
slices from the top down; ``finder``: not at all in a full-attention group that is known
to find the whole prefix), which blocks a release frees with their content (``held``),
and, per group spec, how far a block's hits reach (``reach``, ``steady``).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, count, repeat
from operator import and_, attrgetter, eq, is_not, not_, sub
from typing import TYPE_CHECKING

from ..core.block import Block
from .request import GroupRequest
from .spec import CHUNKED, GroupSpec

if TYPE_CHECKING:
    from .index import GroupIndex

Found = Callable[[int, int, int], Iterable[bool]]
"""``found(g, lo, hi)``: whether group ``g`` finds blocks ``lo .. hi-1`` of the request's
prefix (``0 <= lo < hi <= len(req.nodes)``), by any block, one flag each in order; or
no flag at all when it is known to find every one (``finder``)."""

_KEY, _REFS, _COUNTED, _REF_CNT = (attrgetter(a) for a in ("key", "refs", "counted", "ref_cnt"))


def finder(index: GroupIndex, req: GroupRequest) -> Found:
    """``Found`` for ``req``'s prefix: each group's index asked (``GroupIndex.finds``),
    but a full-attention group (not sparse) while ``req`` is known to find the whole
    prefix there (``GroupRequest.losses``): no miss, without touching the prefix's
    nodes (asking would cost a pass over a long request's cold nodes, most of a finished
    request's order: benchmarks/results/uncache-r16.md); not with caching off (no
    content recorded: ``GroupIndex.records``)."""
    finds, nodes = index.finds, req.nodes
    if req.tainted_from is None and req.losses == index.losses and index.records:
        every = [not s.releases and not s.sparse for s in index.specs]
        return lambda g, lo, hi: () if every[g] else finds(g, nodes[lo:hi])
    return lambda g, lo, hi: finds(g, nodes[lo:hi])


def unfound(index: GroupIndex, req: GroupRequest) -> str | None:
    """Where a request that ``finder`` counts on finding its whole prefix in its
    full-attention groups does not (None: nowhere, or not counted on)."""
    if req.tainted_from is not None or req.losses != index.losses or not index.records:
        return None
    for g, s in enumerate(index.specs):
        if not s.releases and not s.sparse:
            missed = list(index.finds(g, req.nodes)).count(False)
            if missed:
                return (f"request {req.request_id!r}: group {g} misses {missed} of its "
                        f"{len(req.nodes)} prefix blocks, though no content was lost since "
                        f"its admission (losses {req.losses})")
    return None


class Misses:
    """The positions below ``k`` where group ``g`` misses the prefix, sorted, fetched
    from ``lo`` up (downward in doubling slices, as queries reach lower)."""

    __slots__ = ("found", "g", "k", "lo", "at", "runs")

    def __init__(self, found: Found, g: int, k: int) -> None:
        self.found, self.g, self.k, self.lo = found, g, k, k
        self.at: list[int] = []
        self.runs: list[int] = []  # at[i] - i: equal along a run of consecutive misses

    def last(self, a: int, b: int) -> int:
        """The last position in ``[a, b)`` missed, -1 if none (``0 <= a <= b <= k``)."""
        if a < self.lo:
            lo = min(a, max(0, 2 * self.lo - self.k))
            flags = list(self.found(self.g, lo, self.lo))
            if False in flags:
                self.at[:0] = compress(range(lo, self.lo), map(not_, flags))
                self.runs = list(map(sub, self.at, count()))
            self.lo = lo
        at = self.at
        i = bisect_left(at, b) - 1
        return at[i] if i >= 0 and at[i] >= a else -1

    def run(self, q: int) -> tuple[int, int]:
        """The first and last position of the run of misses through ``q`` (a miss
        fetched; the run is cut at ``lo``)."""
        at, runs = self.at, self.runs
        i = bisect_left(at, q)
        return at[bisect_left(runs, runs[i])], at[bisect_right(runs, runs[i]) - 1]


def once(b: Block | None) -> bool:
    """Whether this release frees ``b``'s cached content (its place then matters)."""
    return b is not None and b.key is not None and b.ref_cnt == 1


def held(seg: Sequence[Block | None]) -> bytes:
    """``once`` of each block of ``seg``, as 0/1 bytes (C-speed passes where no entry is
    None and no block's count is a shared run's)."""
    if None in seg:
        return bytes(map(once, seg))
    refs = map(_REFS if list(map(_COUNTED, seg)).count(None) == len(seg) else _REF_CNT, seg)
    return bytes(map(and_, map(is_not, map(_KEY, seg), repeat(None)), map(eq, refs, repeat(1))))


def reach(spec: GroupSpec, block_size: int) -> int:
    """Blocks past a block j up to the last hit that needs it (1 + the blocks a query
    reads behind it); 0 for full attention (every hit above j needs it)."""
    if not spec.releases:
        return 0
    return spec.unread_from(0, block_size) // block_size + 1


def steady(spec: GroupSpec, block_size: int) -> bool:
    """Whether a hit of every length h needs block h - 1 of a windowed group: not so for
    chunks (a hit at a chunk's end reads none) nor a window of one token."""
    return spec.releases and spec.kind != CHUNKED and spec.first_needed(block_size) < block_size
