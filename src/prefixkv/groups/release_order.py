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
window's reach), whatever the request's length, and C-speed copies of the windows' tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from ..core.block import Block
from .free_order import free_order
from .prefixes import Prefix
from .request import GroupRequest
from .spec import GroupSpec


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
    view = GroupRequest(req.request_id, req.tokens, req.keys, len(windows))
    view.nodes = nodes = req.nodes
    view.cut = [req.cut[g] for g in windows]
    empty: list[Block | None] = [None]
    view.tables = [empty * req.cut[g] + list(going[g]) for g in windows]
    order = free_order([specs[g] for g in windows], block_size, view,
                       lambda i, lo, hi: finds(windows[i], nodes[lo:hi]), True)
    req.release(going)
    return order
