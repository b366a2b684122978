"""A claimed run cut where the prompt parts from it: ``agree`` finds how many of a run's
blocks the prompt's bytes agree with, ``split_run`` cuts the run after them (the rest a
run of its own). ``ContentIndex.claim``'s (content.py)."""

from __future__ import annotations

from ..core.block import Block
from ..core.run import Run, new_run


def agree(known: bytes, data: bytes, at: int, end: int, width: int) -> int:
    """How many ``width``-byte chunks of ``known`` agree with ``data[at:end]``, from the
    first (they do not all): memcmps in C (``startswith`` at an offset, the chunks of
    ``known`` viewed without a copy), halving the stretch where they part."""
    view = memoryview(known)
    lo, hi = 0, min(len(known), end - at) // width  # known's first lo agree; hi may not
    if hi and data.startswith(view[:hi * width], at):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(view[lo * width:mid * width], at + lo * width):
            lo = mid
        else:
            hi = mid
    return lo


def split_run(run: Run, k: int, width: int) -> list[Block]:
    """Cut ``run`` (not pending: ``split_pending``) after its first ``k`` blocks (a claim
    agrees with those alone): the rest become a run of their own, headed by the ``k``-th,
    shared alike (one segment each while free), or not. ``width``: a block's token
    bytes. Returns the blocks ``run`` keeps."""
    known = run.blocks
    counts = run.counts
    tail = new_run(known[k:], run.data[k * width:], run.extra, run.ok, run.seen,  # (headed by
                   counts, known[k - 1].content_id)  # known[k - 1])
    run.blocks = known = known[:k]
    run.data = run.data[:(k + 1) * width]
    _settle_headed(known[-1])
    known[-1].starts = tail
    if run.shared:
        tail.shared, tail.n, tail.fwd, tail.linked = True, run.n, run.fwd, run.linked
        counts.shared += 1
        if not run.n:
            counts.free += 1
        for b in tail.blocks:
            b.counted = tail
    return known


def _settle_headed(b: Block) -> None:
    """Write the pending run ``b`` heads, if any, before a cut overwrites ``b.starts``
    (``b`` the last block the cut keeps: a stale run's, recorded since as the first
    block of a miss's run, whose pending blocks are found only from ``b.starts``). A
    claim that takes a run whole needs no write: it follows ``b.starts`` itself."""
    r = b.starts
    if r is not None and r.pending:
        r.counts.settle(r)
