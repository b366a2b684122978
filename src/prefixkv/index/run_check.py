"""What ``check_invariants()`` verifies of the runs (``core.block.Run``): one count for
the blocks of a shared run, and a run still ``ok`` holding what it was recorded with.
Builds messages only for what is wrong."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block, Run, key_chunk


def check_runs(blocks: Sequence[Block], epoch: int) -> str | None:
    """The first inconsistency of the runs ``blocks`` belong to, None when sound: each
    block counted through a run is one of its blocks, the run shared and every block of
    it counted through it; each ``ok`` run (of this ``epoch``) is its head's, and its
    blocks hold its chunks, each the child of the one before, found (not spares)."""
    seen: set[int] = set()
    for b in blocks:
        r = b.counted
        if r is not None and id(r) not in seen:
            seen.add(id(r))
            if not r.shared or not any(x is b for x in r.blocks):
                return f"{b!r} is counted through {r!r}, which is not shared or not its"
            if any(x.counted is not r for x in r.blocks):
                return f"a block of shared {r!r} is not counted through it"
            if r.n < 0:
                return f"shared {r!r} has a negative count"
        head = b.starts
        if head is not None and head.ok == epoch:
            problem = _check_span(b, head)
            if problem:
                return problem
    return None


def _check_span(head: Block, run: Run) -> str | None:
    if head.run is not run or head.key is None or head.twin or len(run.chunks) != len(run.blocks):
        return f"ok {run!r}: its head {head!r} no longer holds its content"
    p = head
    for b, chunk in zip(run.blocks, run.chunks, strict=True):
        if b.run is not run or b.key is None or key_chunk(b.key) != chunk or b.twin \
                or b.extra != run.extra or b.parent_cid != p.content_id:
            return f"ok {run!r}: {b!r} no longer holds what the run recorded"
        p = b
    return None
