"""What ``check_invariants()`` verifies of the runs (``core.block.Run``): one count for
the blocks of a shared run, and a run still ``ok`` holding what it was recorded with.
Builds messages only for what is wrong."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block, Run, RunCounts, key_chunk


def check_runs(blocks: Sequence[Block], epoch: int, counts: RunCounts) -> str | None:
    """The first inconsistency of the shared runs ``blocks`` belong to, None when sound:
    each block counted through a run is one of its blocks, the run shared and every
    block of it counted through it, its count not negative, one segment of the cached
    tier while free, its own links chaining its blocks while ``linked``; and the run
    ``ok`` (of this ``epoch``), its blocks holding its chunks, each the child of the one
    before, found (not spares); ``counts`` as many shared and free shared runs as there
    are. (A run that is not shared may be stale: the claim that makes it shared checks
    it.)"""
    seen: set[int] = set()
    free = 0
    for b in blocks:
        r = b.counted
        if r is None or id(r) in seen:
            continue
        seen.add(id(r))
        if not r.shared or not any(x is b for x in r.blocks):
            return f"{b!r} is counted through {r!r}, which is not shared or not its"
        if any(x.counted is not r for x in r.blocks):
            return f"a block of shared {r!r} is not counted through it"
        if r.n < 0:
            return f"shared {r!r} has a negative count"
        if (not r.n or r.linked) and not _consecutive(r):
            return (f"shared {r!r}: its blocks are not one segment of the cached tier (free)"
                    f" or not chained by their own links (held, linked)")
        free += not r.n
        if r.ok != epoch:
            return f"shared {r!r} is not ok"
        problem = _check_span(r)
        if problem:
            return problem
    if (counts.shared, counts.free) != (len(seen), free):
        return (f"run counts {counts.shared} shared, {counts.free} free: there are "
                f"{len(seen)} and {free}")
    return None


def _check_span(run: Run) -> str | None:
    width, rest = divmod(len(run.data), len(run.blocks) + 1)
    if rest or not run.blocks:
        return f"{run!r}: its token bytes are not its blocks'"
    p = None
    for j, b in enumerate(run.blocks, 1):
        if b.key is None or key_chunk(b.key) != run.data[j * width:(j + 1) * width] or b.twin \
                or b.extra != run.extra or (p is not None and b.parent_cid != p.content_id):
            return f"shared {run!r}: {b!r} no longer holds what the run recorded"
        p = b
    return None


def _consecutive(run: Run) -> bool:
    """Whether the run's blocks are linked one after the other, in the order ``fwd``
    says (in the cached tier when free)."""
    known = run.blocks
    order = known if run.fwd else known[::-1]
    return all(a.next is b and b.prev is a for a, b in zip(order, order[1:], strict=False))
