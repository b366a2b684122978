"""Pending runs: a miss's ``store`` records its run (``core.run.Run``) as one record,
and the blocks' content is written only when something reads one of them alone. A store
fetch's run that lands whole in device blocks is one too (``core.store_fill
.fill_pending``, on the fetcher's thread; ``ContentIndex.land_run`` records it): its
blocks' content fields but the key are written as well (parent and content ids, extra
bytes, hash, step), which the tier below reads when the run is evicted.

A 32k-token miss stores ~2,048 new blocks, each the chained child of the one before.
Written eagerly, each block takes nine writes (its content, its parent's ``child``, the
run's count and links); a pending run writes three a block, the ones the pool and a
claim of the whole run read (``counted``, ``prev``/``next``), and the whole content of
its last block (a claim of the run goes on from it, a decoded block is stored under it).
Its other blocks have no key (``key`` None, not ``chained``, a stale ``content_id``):

    head ──child──> b0 ··· b1 ··· ... ··· b(k-1)      ─── written, ··· not yet
    run.pcid = head's content id; b(i)'s: run.cid0 + i; run.chunk(i + 1): b(i)'s tokens

Who reads what:
- a claim reaching the head takes the run whole from ``head.starts`` (its token bytes compared
  as one bytes object, ``pcid`` for the first block's parent), or cuts it where the prompt
  parts from it (``split_pending``: the two blocks at the cut written, both parts pending);
- the pool's release and eviction use its count and links alone; an eviction that takes
  the whole run, or cuts its tail off (``Run.truncate``), has no dict entry to remove:
  the index unkeys none of those blocks (``BlockPool._evict`` names them: ``core.keyless``;
  the tier below reads the content of those it keeps from there; with deferred events the
  ``BlockRemoved`` names them all, their hashes set by the run's ``StoredRun`` build,
  which the log runs first), and the run clears its own
  last block's key (``Run.evicted``) or writes its new last one (``Run.truncate``); each
  block's own count is 1 from the store on (nothing writes it while the run counts
  them), so the eviction writes one field a block (``counted``), or none for a store
  fetch's start: the blocks keep the evicted run's ``counted`` (its ``n`` 1) until the
  fetcher fills them on its thread (``BlockPool.take``'s ``stale``);
- anything else settles it first: ``Run.dissolve`` (a block's count changed alone, the
  run broken), a ``store`` or decoded block under one of its blocks or under its head
  (``settle_near``), host hits adopted under one of its blocks (``adopt``), a spare of
  one of its blocks or of its head (``_add_twin``: that content and its children get
  keyed; other runs stay pending), ``match`` with multimodal keys (the runs whose
  heads its walk reaches; every run with a tier below) or a claimed start (without
  either, it walks runs whole, then the tier below), ``holds``, a ``snapshot``
  (``settle_all``: it reads every block anyway); ``uncache`` settles the runs it reads alone: those of
  the blocks it names, those they head, and those its walk of forgotten descendants
  reaches through their heads (a run's head is the block found for its parent content:
  a descendant the walk reaches);
- ``check_invariants`` verifies a pending run as it is, without settling it.

Settling costs what the eager store would have cost, once per run: a run is settled at
most once, so the work settled runs add up to is bounded by the eager stores'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.block import Block, ContentKey
from ..core.run import Run, new_run

_NO_PARENT = Block(-1)  # the parent of a first block in the walk: never given a child


def write_pending(run: Run) -> None:
    """Write the content of every block of pending ``run`` as an eager store would have:
    each its parent's ``child``, chained. The head's ``child`` is the first block
    already."""
    cid = run.pcid
    extra = run.extra
    parent: Block | None = None
    data = run.data
    width = len(data) // (len(run.blocks) + 1)
    for b, at, c in zip(run.blocks, range(width, len(data), width),
                        range(run.cid0, run.cid0 + len(run.blocks)), strict=False):
        chunk = data[at:at + width]
        b.parent_cid = cid
        b.extra = extra
        b.key = chunk
        b.chained = True
        b.content_id = cid = c
        if parent is not None:
            parent.child = b
        parent = b


def split_pending(run: Run, k: int, width: int) -> list[Block]:
    """``ContentIndex.claim``'s cut of pending ``run`` after its first ``k`` blocks (``0 <
    k < len(run.blocks)``; ``width``: a block's token bytes) without writing the run:
    the ``k`` stay a pending run, its new last block's content written; the block after
    them (the first cut off) is written, chained under it and counted alone (the run's
    count: it leaves the pending runs, ``_num_chained`` is the caller's); the blocks after
    that one, if any, are a pending run it heads (as a miss's ``store`` records one),
    shared alike (one segment while free). Two blocks written, not the run's every one:
    the claim reads neither part but through its head. Returns the blocks ``run`` keeps."""
    known = run.blocks
    counts, data, extra, cid = run.counts, run.data, run.extra, run.cid0 + k
    last, cut, rest = known[k - 1], known[k], known[k + 1:]
    run.blocks = known[:k]
    run.data = data[:(k + 1) * width]
    run.write_last()
    last.child = cut
    last.starts = None  # (stale: it headed no run while pending)
    cut.parent_cid = cid - 1
    cut.extra = extra
    cut.key = data[(k + 1) * width:(k + 2) * width]
    cut.chained = True
    cut.content_id = cid
    cut.counted = None
    cut.refs = run.n
    if rest:  # (else ``cut`` was the run's last block: its child and ``starts`` are its own)
        tail = new_run(rest, data[(k + 1) * width:], extra, run.ok, run.seen, counts, cid)
        tail.pending = True
        tail.cid0 = cid + 1
        tail.shared, tail.n, tail.fwd, tail.linked = True, run.n, run.fwd, run.linked
        counts.shared += 1
        if not run.n:
            counts.free += 1
        counts.pending[tail] = None
        for b in rest:
            b.counted = tail
        cut.starts = tail
        cut.child = rest[0]
    return run.blocks


def content_of(b: Block) -> tuple[int, bytes, bytes] | None:
    """The content ``(parent content id, token bytes, extra bytes)`` block ``b`` holds, a
    pending run's block's read from its run's record; None without content. For checks
    and tests (a hot path reads the fields)."""
    r = b.counted
    if r is not None and r.pending:
        i = r.blocks.index(b)
        return (r.pcid if i == 0 else r.cid0 + i - 1, r.chunk(i + 1), r.extra)
    if b.key is None:
        return None
    return (b.parent_cid, b.key if isinstance(b.key, bytes) else b.key[1], b.extra)


def child_of(b: Block) -> Block:
    """``b.child`` as it will be once ``b``'s pending run is written (the next block of
    the run); for tests."""
    r = b.counted
    if r is not None and r.pending and b is not r.blocks[-1]:
        return r.blocks[r.blocks.index(b) + 1]
    return b.child


def walk_pending(chunks: Sequence[bytes], base: bytes, get: Callable[[bytes], Block | None],
                 by_key: dict[ContentKey, Block], epoch: int) -> list[Block]:
    """``ContentIndex._walk`` (one extra-key bytes ``base`` for every block) while runs are
    pending, without writing them: a found block that heads a pending run (``starts``,
    of this ``epoch``) is followed by as many of the run's blocks as agree with the next
    chunks, as ``claim`` takes them. A walk that parts from a pending run ends there: no
    content is recorded under a pending block (a store under one writes its run first).
    The head's own chunk is not compared with the run's record (``claim`` compares it in
    the same memcmp): a run of this epoch recorded under the head's content id holds the
    head's chunk, one content having one id (``run_check.check_runs`` verifies it;
    tests/test_pending_walk_claim.py compares lookups with the claims after them)."""
    hits: list[Block] = []
    cid, b, i, n = 0, _NO_PARENT, 0, len(chunks)
    c: Block | None
    while i < n:
        chunk = chunks[i]
        c = b.child
        if c.key != chunk or c.parent_cid != cid or c.extra != base or c.twin:
            c = get(chunk)
            if c is None or c.parent_cid != cid or c.extra != base:
                c = by_key.get((cid, chunk, base)) if by_key else None
                if c is None:
                    break
        hits.append(c)
        cid = c.content_id
        b = c
        i += 1
        r = c.starts
        if r is None or not r.pending or r.ok != epoch or r.pcid != cid or r.extra != base:
            continue
        known, recorded = r.blocks, r.data
        k = len(known)
        width = len(recorded) // (k + 1)
        if b"".join(chunks[i:i + k]) == recorded[width:]:
            hits += known
            b = known[-1]
            cid = b.content_id
            i += k
            continue
        j = 0
        while i + j < n and j < k \
                and chunks[i + j] == recorded[(j + 1) * width:(j + 2) * width]:
            j += 1
        hits += known[:j]
        break
    return hits


def content_id_of(b: Block) -> int:
    """``b.content_id``, a pending run's block's from its run's record; for tests."""
    r = b.counted
    if r is not None and r.pending:
        return r.cid0 + r.blocks.index(b)
    return b.content_id
