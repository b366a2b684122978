"""Filling a store fetch's device blocks with the content its run lands (``fill_device``,
or ``fill_pending`` for a run that lands as one pending run: ``index/pending.py``), on
the fetcher's thread (``store_landing.fetch_ready``) or, when the fetcher did not, at
the landing; and giving blocks back without it (``unpend``, ``emptied``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from .block import Block
from .run import Run, RunCounts, new_run

__all__ = ["emptied", "fill_device", "fill_pending", "unpend"]


def fill_device(blocks: Sequence[Block], parent_cid: int, extras: Sequence[bytes],
                cids: Sequence[int], hashes: Sequence[bytes], chunks: Sequence[bytes],
                step: int) -> None:
    """Write the content fields of held device ``blocks`` for ``ContentIndex.land_run``:
    block i's parent (block i - 1's content, or ``parent_cid``), ``extras[i]``,
    ``cids[i]``, ``hashes[i]``, ``step``, no event, each its predecessor's ``child``,
    each counted alone (a stale ``counted`` cleared: ``BlockPool.take``); then every
    block but the first keyed by ``chunks[i]`` and chained (after every parent id).
    May run on a fetcher's thread, as ``fill_landing`` for slots: the blocks
    are in no map and no free queue, the first has no key, and every other one's parent
    id is a fresh id that nothing findable holds until the first is keyed, so no walk
    and no guess through a stale ``child`` link (which compares the key and the parent
    id) stops at one."""
    prev: Block | None = None
    for b, extra, cid, h in zip(blocks, extras, cids, hashes, strict=True):
        b.parent_cid, b.extra, b.content_id, b.hash, b.step = parent_cid, extra, cid, h, step
        b.event, b.twin, b.chained, b.counted = None, False, False, None
        if prev is not None:
            prev.child = b
        parent_cid, prev = cid, b
    for b, chunk in zip(islice(blocks, 1, None), islice(chunks, 1, None), strict=True):
        b.key = chunk
        b.chained = True


def fill_pending(blocks: Sequence[Block], parent_cid: int, extra: bytes, cids: Sequence[int],
                 hashes: Sequence[bytes], chunks: Sequence[bytes], step: int,
                 counts: RunCounts) -> Run:
    """``fill_device`` for a run that lands as one pending run (``index/pending.py``):
    ``blocks[1:]`` are the run, headed by ``blocks[0]``, all under one ``extra``. Each
    block's content fields are written as ``fill_device`` writes them but the key: the
    run's blocks have none but the last, and are counted through the run (one count,
    held) and linked tail first, as ``_record_run`` leaves them; the head is counted
    alone (a stale ``counted`` cleared: ``BlockPool.take``). The run is returned
    unregistered: ``ContentIndex.land_run`` records it (the blocks are in ``landing``
    until then: no check reads them); every path that empties the blocks instead clears
    their ``counted`` (``emptied``, ``unpend``). On the fetcher's thread."""
    run = new_run(list(islice(blocks, 1, None)), b"".join(chunks), extra, -1, 0, counts, cids[0])
    run.cid0 = cids[1]
    run.shared = run.linked = run.pending = True
    run.n = 1
    prev: Block | None = None
    for b, cid, h in zip(blocks, cids, hashes, strict=True):
        b.parent_cid, b.extra, b.content_id, b.hash, b.step = parent_cid, extra, cid, h, step
        b.event, b.twin, b.chained, b.key = None, False, False, None
        if prev is not None:
            prev.child = b
            b.counted = run
            b.next = prev  # (the head's links too: harmless, it is held)
            prev.prev = b
        else:  # (the head: counted alone, a stale ``counted`` cleared: ``BlockPool.take``)
            b.counted = None
        parent_cid, prev = cid, b
    assert prev is not None
    prev.key = chunks[-1]  # (the last block's whole content: ``Run.write_last``)
    prev.chained = True
    return run


def unpend(blocks: Sequence[Block]) -> None:
    """Blocks ``fill_pending`` counted through a run that will not be recorded: each
    counted alone again (its own count, 1, is the fetch's)."""
    for b in blocks:
        b.counted = None


def emptied(blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` (filled or not, never keyed in a map) with no content again, reversed
    (as a request releases its blocks: the tail first)."""
    for b in blocks:
        b.key = None
        b.chained = False
        b.counted = None  # (``fill_pending``'s)
    return list(reversed(blocks))
