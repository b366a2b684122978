"""The order in which the blocks a step releases (the windows' blocks no query reads any
more) join the free queue: vLLM's (group by group, each group's last block first, as its
``remove_skipped_blocks`` frees them), but a block that no hit of the request's prefix can
use goes ahead as soon as it becomes so, as a finished request's blocks do
(``free_order.py``): however many of the batch are evicted, every hit vLLM's order keeps
is kept (tests/test_groups_release_order.py, brute force).

Beside several windows this matters: the first window's block j placed kills the hits
that read it, and the other windows' block j, read by the same hits only, follows it
before the first window's block j - 1 (gemma3-like, five windows of 1024 beside full
attention: a hit rate of 26.3% in vLLM's order, 28.1% so, all full attention's;
benchmarks/results/groups-cpu.md).

Only the windowed groups are looked at (a step releases no full-attention block): their
hits are taken as served by the full groups, which is what the request's own held blocks
do, and where it is not so a hit taken as alive only keeps a block from moving ahead.
A batch of one block per window (a decode step crossing a block boundary) keeps vLLM's
order: moving ahead could only put a block whose hits are dead already before the others,
and the cascade would cost several times the release (benchmarks/results/free-order-cpu.md).
Otherwise the cost is Python work per released block and per hit that reads one (a
window's reach), whatever the request's length: the order is taken on a view of the
request that leaves out the blocks below the windows' cuts but the reach of one (shifted
by a multiple of every chunk, so each group reads the same blocks: ``shift``), whose
tables are copied at C speed. Where every window is the same sliding window releasing the
same blocks, each freeing its content, and every hit that reads one of them is alive
(gemma3-like's steps, most of the time), the order is known without the cascade
(``in_rounds``): asking whether those hits are alive is a C-speed pass per window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from math import gcd

from ..core.block import Block
from .free_order import free_order
from .free_runs import held, reach, steady
from .prefixes import Prefix
from .request import GroupRequest
from .spec import CHUNKED, SLIDING, GroupSpec


def release_order(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
                  going: Sequence[Sequence[Block | None]],
                  finds: Callable[[int, Sequence[Prefix]], Iterator[bool]]) -> list[Block]:
    """Release ``going`` from the request (``GroupRequest.release``: each group's next
    blocks after its cut) and return them in the order to release them (module
    docstring). ``finds(g, nodes)``: whether group ``g`` finds each of ``nodes``
    (``GroupIndex.finds``)."""
    windows = [g for g, part in enumerate(going) if part and specs[g].releases]
    if len(windows) < 2 or all(len(going[g]) == 1 for g in windows):
        return req.release(going)  # (one block each, a decode step's: little to move)
    rounds = in_rounds(specs, block_size, req, going, windows, finds)
    if rounds is not None:
        req.release(going)
        return rounds
    wspecs = [specs[g] for g in windows]
    s = shift(wspecs, block_size, min(req.cut[g] for g in windows))
    nodes = req.nodes
    view = GroupRequest(req.request_id, req.tokens, req.keys, len(windows))
    view.nodes = nodes[s:]
    view.cut = [req.cut[g] - s for g in windows]
    empty: list[Block | None] = [None]
    view.tables = [empty * (req.cut[g] - s) + list(going[g]) for g in windows]
    order = free_order(wspecs, block_size, view,
                       lambda i, lo, hi: finds(windows[i], nodes[lo + s:hi + s]), True,
                       not all(spec.cached for spec in wspecs))
    req.release(going)
    return order


def in_rounds(specs: Sequence[GroupSpec], block_size: int, req: GroupRequest,
              going: Sequence[Sequence[Block | None]], windows: Sequence[int],
              finds: Callable[[int, Sequence[Prefix]], Iterator[bool]]) -> list[Block] | None:
    """The cascade's order, in rounds, when every windowed group of the step (``windows``)
    is one sliding window whose hits each read their last block (``steady``) and
    releases the same blocks ``c .. c+n-1`` (its cut is ``c``), each of them freeing its
    content (``held``), and every hit that reads one of them is alive (each window finds
    every block such a hit needs below ``len(req.nodes)``; past it, hits are taken as
    alive, as the cascade takes them): from j = c+n-1 down, each window's block j, in
    group order. (The cascade places the first window's block j, which kills the hits
    that read it, hits j+1 .. the last reading j, the only ones alive that read the other
    windows' block j, which then follow; hit j reads block j-1 and lives on.) None,
    with nothing changed, where it is not so; the caller then runs the cascade."""
    spec, first = specs[windows[0]], windows[0]
    c, n = req.cut[first], len(going[first])
    if spec.kind != SLIDING or not steady(spec, block_size) or any(
            specs[g] != spec or req.cut[g] != c or len(going[g]) != n for g in windows):
        return None
    if any(held(going[g]).count(1) != n for g in windows):
        return None
    nodes = req.nodes
    lo = spec.num_unread((c + 1) * block_size, block_size)  # (the hits: c+1 .. last)
    hi = min(len(nodes), (spec.unread_from(c + n - 1, block_size) - 1) // block_size)
    if lo < hi:
        span = nodes[lo:hi]
        if not all(all(finds(g, span)) for g in windows):
            return None
    out: list[Block | None] = [None] * (n * len(windows))
    for i, g in enumerate(windows):
        out[i::len(windows)] = going[g][::-1]
    return out  # type: ignore[return-value]  # (no None: each block frees its content)


def shift(specs: Sequence[GroupSpec], block_size: int, cut: int) -> int:
    """How many leading blocks the view of a step's release leaves out (all below every
    window's ``cut``), so that it costs the windows' reach and not the request's length:
    a multiple of every chunked group's chunk (where each spec reads the same blocks,
    shifted, as below), leaving more than any spec's ``reach`` below ``cut`` (no hit that
    reads a released block reads a block below the view, nor one where ``max(0, ...)``
    clamps ``first_needed``)."""
    period = 1
    for spec in specs:
        if spec.kind == CHUNKED:
            chunk = spec.tokens // gcd(spec.tokens, block_size)  # (blocks: C / gcd(C, bs)
            period = period * chunk // gcd(period, chunk)  # is lcm(C, bs) / bs)
    room = cut - 1 - max(reach(spec, block_size) for spec in specs)
    return room // period * period if room > 0 else 0
