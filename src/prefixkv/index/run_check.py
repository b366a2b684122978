"""What ``check_invariants()`` verifies of the runs (``core.run.Run``): one count for
the blocks of a shared run, and a run still ``ok`` holding what it was recorded with.
Builds messages only for what is wrong."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block, key_chunk
from ..core.run import Run, RunCounts


def check_runs(blocks: Sequence[Block], epoch: int, counts: RunCounts,
               losses: int = -1) -> str | None:
    """The first inconsistency of the shared runs ``blocks`` belong to, None when sound:
    each block counted through a run is one of its blocks, the run shared and every
    block of it counted through it, its count not negative, one segment of the cached
    tier while free, its own links chaining its blocks while ``linked``; and the run
    ``ok`` (of this ``epoch``), its blocks holding its chunks, each the child of the one
    before, found (not spares); ``counts`` as many shared and free shared runs as there
    are. (A run that is not shared may be stale: the claim that makes it shared checks
    it.) And no retaken block is served: a run a found block heads (``starts``), ``ok``
    and recorded under its content, that a claim would take without checking each block
    (shared, or not shared while ``losses``, the index's count of content losses, is its
    ``seen``) holds what it recorded, its blocks counted through it when shared; a
    pending run's head holds the chunk and extra keys the run recorded for it (what
    ``claim`` compares and ``walk_pending`` relies on)."""
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
    for b in blocks:
        r = b.starts
        if r is None or r.ok != epoch or b.key is None or b.twin or not r.blocks or (
                r.pcid if r.pending else r.blocks[0].parent_cid) != b.content_id:
            continue
        if r.shared and id(r) not in seen:
            return f"{b!r} heads shared {r!r}, whose blocks are not counted through it"
        if r.pending and (key_chunk(b.key) != r.data[:len(r.data) // (len(r.blocks) + 1)]
                          or b.extra != r.extra):
            # (``walk_pending`` compares only the chunks after the head: one content, one id)
            return f"{b!r} heads pending {r!r} under its content but holds other tokens"
        if not r.shared and r.seen == losses:
            problem = _check_span(r)
            if problem:
                return f"unchecked run of {b!r}: {problem}"
    if any(not r.pending or not r.shared or id(r) not in seen for r in counts.pending):
        return "a run listed as pending is not pending, not shared or no block's"
    if (counts.shared, counts.free) != (len(seen), free):
        return (f"run counts {counts.shared} shared, {counts.free} free: there are "
                f"{len(seen)} and {free}")
    return None


def _check_span(run: Run) -> str | None:
    width, rest = divmod(len(run.data), len(run.blocks) + 1)
    if rest or not run.blocks:
        return f"{run!r}: its token bytes are not its blocks'"
    if run.pending:
        return _check_pending(run)
    p = None
    for j, b in enumerate(run.blocks, 1):
        if b.key is None or key_chunk(b.key) != run.data[j * width:(j + 1) * width] or b.twin \
                or b.extra != run.extra or (p is not None and b.parent_cid != p.content_id):
            return f"{run!r}: {b!r} no longer holds what the run recorded"
        p = b
    return None


def _check_pending(run: Run) -> str | None:
    """A pending run (``pending.py``): no block has a key but the last, which holds its
    content (content id ``cid0`` + its place); each block's own count (``refs``, unread
    while counted through the run) 1, as ``store`` recorded it; one of the index's
    pending runs."""
    known = run.blocks
    for b in known[:-1]:
        if b.key is not None or b.chained or b.twin:
            return f"pending {run!r}: {b!r} has a key"
    if any(b.refs != 1 for b in known):  # (the eviction of a pending run relies on it)
        return f"pending {run!r}: a block's own count is not 1"
    last = known[-1]
    k = len(known)
    if last.content_id != run.cid0 + k - 1 or last.key != run.chunk(k) \
            or not last.chained or last.twin or last.extra != run.extra \
            or last.parent_cid != (run.cid0 + k - 2 if k > 1 else run.pcid):
        return f"pending {run!r}: its last block {last!r} does not hold its content"
    if run not in run.counts.pending:
        return f"pending {run!r} is not among its index's pending runs"
    return None


def _consecutive(run: Run) -> bool:
    """Whether the run's blocks are linked one after the other, in the order ``fwd``
    says (in the cached tier when free)."""
    known = run.blocks
    order = known if run.fwd else known[::-1]
    return all(a.next is b and b.prev is a for a, b in zip(order, order[1:], strict=False))
