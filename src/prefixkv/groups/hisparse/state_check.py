"""``HiSparseState.check_invariants``: the pools, rows and copies agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...core.block import Block
from ...errors import InvariantError
from .row import UNPINNED

if TYPE_CHECKING:
    from .state import HiSparseState

__all__ = ["check"]


def check(state: HiSparseState, others: Sequence[Block] = (), host_others: Sequence[Block] = ()) -> None:
    """``HiSparseState.check_invariants``."""
    refs: dict[int, int] = {state.nulls[0].block_id: 1}
    for b in others:
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    host_refs: dict[int, int] = {state.nulls[1].block_id: 1}
    for b in [*state._held_host(), *host_others]:
        host_refs[b.block_id] = host_refs.get(b.block_id, 0) + 1
    for r in state._requests.values():
        r.row.check_invariants()
        if not len(r.blocks) == len(r.row) == len(r.indexer) <= len(r.host):
            raise InvariantError(f"rows of {len(r.host)}, {len(r.indexer)}, {len(r.blocks)} pages")
        for b in (*r.indexer, *r.hot, *[b for p, b in enumerate(r.blocks) if b is not None
                                         and r.row.state(p) != UNPINNED]):
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in r.host:
            host_refs[b.block_id] = host_refs.get(b.block_id, 0) + 1
    for block, host in state._orphans.values():
        refs[block.block_id] = refs.get(block.block_id, 0) + 1
        host_refs[host.block_id] = host_refs.get(host.block_id, 0) + 1
    state.spills.check_invariants()
    state.imports.check_invariants(list(state.spills.flight), list(state._requests))
    problem = state.device.check(refs) or state.host.check(host_refs)
    if problem is None and not set(state._unpinned) <= set(state.device.unpinned):
        problem = f"unpinned pages {sorted(state._unpinned)} not all unpinned in the pool"
    if problem is not None:
        raise InvariantError(problem)
