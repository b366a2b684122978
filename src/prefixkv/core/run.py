"""A run of blocks recorded by one ``store`` (``Run``: one count, one span of token bytes,
one segment of the free queue) and the per-index counts of runs (``RunCounts``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block import Block


class RunCounts:
    """How many of one index's runs are ``shared``, and how many of those are ``free``
    (count 0: their blocks are in the cached tier). While none is free no block the pool
    evicts is counted through a run, and while none is shared no block it releases is:
    it skips those per-block checks (each count changes per run, never per block).
    ``pending``: the runs whose blocks' content is not written yet (``Run.pending``);
    ``settle``: the index's call that writes a pending run's content (``Run.dissolve``
    needs it before the blocks are counted alone). ``spans``: whether an eviction keeps
    the records of the pending runs' blocks it takes (``Keyless``): only a tier below
    reads them (the index skips those blocks by their positions alone)."""

    __slots__ = ("shared", "free", "pending", "settle", "spans")

    def __init__(self) -> None:
        self.shared = 0
        self.free = 0
        # (a dict used as a set: its insert is the C path a step runs anyway, the
        # request's; ``set.add``'s is cold after the forward pass)
        self.pending: dict[Run, None] = {}
        self.settle: Callable[[Run], None] = _no_pending
        self.spans = False


def _no_pending(run: Run) -> None:
    raise AssertionError(f"{run!r} is pending in an index that records none")


class Run:
    """A run of blocks one ``store`` recorded after a first new content (``head``, which
    is not one of them), each the chained child of the one before: ``blocks`` in chain
    order; ``data``: the head's token bytes, then theirs, in one piece (one memcmp
    compares the run with a prompt); the extra-key bytes ``extra`` of every one.

    ``ok``: the index's epoch when recorded (``reset`` starts another), -1 once known
    broken. A run that is not shared may be stale (a block's content lost since): the
    claim that first takes it whole checks each block as a hit is checked, then makes
    it shared; unless ``seen``, the index's count of content losses when the run was
    last known whole (recorded or checked), is still that count: no block anywhere
    has lost its content since, so none of these has. A shared run holds its content:
    the loss of any block's content breaks it (``broken``). So ``claim`` compares its
    token bytes as one bytes object, instead of block by block, and checks its first
    block's parent id against the head's content id.

    ``shared``: the blocks' reference count is ``n``, one count for all of them (each
    block's ``counted`` is this run): they are held by exactly the same requests, so a
    claim or a release of the whole run changes one count. A run is shared from its
    ``store`` on (its blocks are the storing request's alone), or becomes shared when a
    claim takes all of its blocks, each free, at once. Any change to one block's count
    alone (``Block.ref_cnt`` set), any removal of one of them from the free queue alone,
    and the loss of any block's content first give every block its own count again
    (``dissolve``); an eviction that takes its last blocks alone (not ``fwd``) cuts
    them off instead (``truncate``: the rest keep their content). While ``n`` is 0 the
    blocks are consecutive in the free queue's cached tier, in the order of ``blocks``
    (``fwd``) or the reverse: a claim, or an eviction, takes them out of it as one
    segment.

    ``linked``: the blocks' links (``prev``/``next``) still chain them in the order
    ``fwd`` says, as the last release that freed them linked them, or as ``store``
    linked them for the release that frees its request, tail first (a claim takes them
    out as one segment, leaving those links; nothing else writes a held block's links):
    the next release that frees them in that order links its two ends alone.

    ``counts``: the index's ``RunCounts``, kept as ``shared`` and ``n`` change.

    ``pending``: recorded by a miss's ``store`` without writing its blocks' content (see
    ``index/pending.py``): each block has its ``counted`` and links, the last block its
    whole content; the others have no key (``key`` None, not ``chained``; ``content_id``
    stale) until the index writes them (``RunCounts.settle``), which it does before
    anything but a claim of the whole run, a release or an eviction reads one of them.
    Pending implies shared: ``dissolve`` settles it first. ``pcid``: the head's content
    id (the first block's ``parent_cid``); ``cid0``: the first block's content id (block
    i's is ``cid0 + i``).

    No ``__init__``: ``new_run`` makes one, ``ContentRecorder._record_run`` (a miss's
    store, once a step) sets the fields itself. A class called with an ``__init__``
    enters the interpreter again from C (``slot_tp_init``, a frame of its own): paths
    cold after the forward pass (benchmarks/results/events-r22.md)."""

    __slots__ = ("blocks", "data", "extra", "ok", "seen", "n", "shared", "fwd", "linked",
                 "counts", "pending", "pcid", "cid0")
    blocks: list[Block]
    data: bytes
    extra: bytes
    ok: int
    seen: int
    n: int
    shared: bool
    fwd: bool
    linked: bool
    counts: RunCounts
    pending: bool
    pcid: int
    cid0: int

    def dissolve(self) -> None:
        """Give each block its own count again (the shared one), not shared from now on
        (a pending run's content written first)."""
        if self.pending:
            self.counts.settle(self)
        if self.shared:
            self.shared = self.linked = False
            n = self.n
            self.counts.shared -= 1
            if not n:
                self.counts.free -= 1
            for b in self.blocks:
                b.refs = n
                b.counted = None

    def evicted(self) -> None:
        """Every block of this free shared run is being evicted at once: broken (its
        content goes), not shared; the caller clears each block's ``counted`` and sets its
        count as it takes it (no pass to dissolve), or, for a pending run taken by a store
        fetch's start, sets ``n`` to 1 and leaves each block's ``counted`` to its taker
        (``BlockPool.take``'s ``stale``). A pending run's blocks hold no key but the last
        one's, cleared here: the index has none of them to drop."""
        self.ok = -1
        self.shared = self.linked = False
        self.counts.shared -= 1
        self.counts.free -= 1
        if self.pending:
            self.pending = False
            self.counts.pending.pop(self, None)
            last = self.blocks[-1]
            last.key = None
            last.chained = False

    def truncate(self, keep: int) -> list[Block]:
        """Cut this free shared run after its first ``keep`` blocks (``0 < keep <
        len(blocks)``; their content stays, one segment still): the blocks cut off, last
        first (the order the cached tier holds them in when not ``fwd``), for the
        eviction to take (their ``counted`` is the caller's to clear). A pending run stays
        pending: its old last block's key is cleared (the index holds none of the blocks
        cut off), its new last block's content written."""
        gone = self.blocks[:keep - 1:-1]
        width = len(self.data) // (len(self.blocks) + 1)
        del self.blocks[keep:]
        self.data = self.data[:(keep + 1) * width]
        if self.pending:
            old = gone[0]
            old.key = None
            old.chained = False
            self.write_last()
        return gone

    def write_last(self) -> None:
        """Write the content of a pending run's last block (chained under the one before)."""
        k = len(self.blocks)
        b = self.blocks[-1]
        b.content_id = self.cid0 + k - 1
        b.parent_cid = self.cid0 + k - 2 if k > 1 else self.pcid
        b.extra = self.extra
        data = self.data  # (``chunk(k)``, inline: the last chunk of ``data``)
        b.key = data[k * (len(data) // (k + 1)):]
        b.chained = True

    def chunk(self, i: int) -> bytes:
        """The token bytes recorded for the run's ``i``-th block counted from its head
        (0: the head's; ``i``: ``blocks[i - 1]``'s), a slice of ``data``."""
        width = len(self.data) // (len(self.blocks) + 1)
        return self.data[i * width:(i + 1) * width]

    def broken(self) -> None:
        """One of the blocks (or the head) lost its content: not ``ok``, not shared."""
        self.ok = -1
        if self.shared:
            self.dissolve()

    def __repr__(self) -> str:
        return (f"Run(ok={self.ok}, n={self.n if self.shared else None}, len={len(self.blocks)}"
                f"{', pending' if self.pending else ''})")


def new_run(blocks: list[Block], data: bytes, extra: bytes, ok: int, seen: int,
            counts: RunCounts, pcid: int) -> Run:
    """A ``Run`` of ``blocks`` (see there), not shared, linked or pending yet: its first
    block's parent has content id ``pcid``."""
    run = Run()
    run.blocks, run.data, run.extra = blocks, data, extra
    run.ok, run.seen, run.counts = ok, seen, counts
    run.n, run.shared, run.fwd = 0, False, False
    run.linked, run.pending, run.pcid = False, False, pcid
    run.cid0 = 0
    return run
