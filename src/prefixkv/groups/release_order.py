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
tables are copied at C speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from math import gcd

from ..core.block import Block
from .free_order import free_order
from .free_runs import reach
from .prefixes import Prefix
from .request import GroupRequest
from .spec import CHUNKED, GroupSpec


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
    wspecs = [specs[g] for g in windows]
    s = shift(wspecs, block_size, min(req.cut[g] for g in windows))
    nodes = req.nodes
    view = GroupRequest(req.request_id, req.tokens, req.keys, len(windows))
    view.nodes = nodes[s:]
    view.cut = [req.cut[g] - s for g in windows]
    empty: list[Block | None] = [None]
    view.tables = [empty * (req.cut[g] - s) + list(going[g]) for g in windows]
    order = free_order(wspecs, block_size, view,
                       lambda i, lo, hi: finds(windows[i], nodes[lo + s:hi + s]), True)
    req.release(going)
    return order


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
