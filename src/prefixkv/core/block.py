"""The physical block: created once per pool slot, mutated in place, never copied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from ..events import BlockStored

ContentKey = tuple[int, bytes, bytes]  # (parent content id, token bytes, extra-key bytes)
Key = bytes | ContentKey  # the index key: token bytes alone, or the whole content


def key_chunk(key: Key | None) -> bytes:
    """The token bytes of an index key (the key, or its middle); ``key`` is not None."""
    assert key is not None, "a block without content has no token bytes"
    return key if isinstance(key, bytes) else key[1]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` token slots take: the one ceiling division of the
    package (also where the units are not blocks: chunks of a chunked-attention group)."""
    return -(-num_tokens // block_size)


def hit_limit(num_tokens: int, block_size: int, max_hit_tokens: int | None = None) -> int:
    """The most blocks a cache hit of a ``num_tokens``-token prompt may have: all but the
    one holding its last token (computed anew: its logits are needed), and at most
    ``max_hit_tokens // block_size`` when a cap is given."""
    limit = (num_tokens - 1) // block_size
    return limit if max_hit_tokens is None else min(limit, max_hit_tokens // block_size)


class _NoChild:
    """The ``child`` of a block without one: fails every check a guess must pass."""

    __slots__ = ()
    key = None
    chained = twin = False
    parent_cid = content_id = -1
    extra = None
    counted = starts = None


class _Unlinked:
    """The ``prev``/``next`` of a block outside the free queue's cached tier."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNLINKED"


class RunCounts:
    """How many of one index's runs are ``shared``, and how many of those are ``free``
    (count 0: their blocks are in the cached tier). While none is free no block the pool
    evicts is counted through a run, and while none is shared no block it releases is:
    it skips those per-block checks (each count changes per run, never per block).
    ``pending``: the runs whose blocks' content is not written yet (``Run.pending``);
    ``settle``: the index's call that writes a pending run's content (``Run.dissolve``
    needs it before the blocks are counted alone)."""

    __slots__ = ("shared", "free", "pending", "settle")

    def __init__(self) -> None:
        self.shared = 0
        self.free = 0
        self.pending: set[Run] = set()
        self.settle: Callable[[Run], None] = _no_pending


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
    i's is ``cid0 + i``)."""

    __slots__ = ("blocks", "data", "extra", "ok", "seen", "n", "shared", "fwd", "linked",
                 "counts", "pending", "pcid", "cid0")

    def __init__(self, blocks: list[Block], data: bytes, extra: bytes, ok: int,
                 seen: int, counts: RunCounts, pcid: int = 0) -> None:
        self.blocks = blocks
        self.data = data
        self.extra = extra
        self.ok = ok
        self.seen = seen
        self.n = 0
        self.shared = False
        self.fwd = False
        self.linked = False
        self.counts = counts
        self.pending = False
        self.pcid = pcid
        self.cid0 = 0

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
            self.counts.pending.discard(self)
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



# Typed as a Block so that the links of a linked block need no None checks on the hot
# paths; it is only ever compared by identity, never read through.
UNLINKED: Block = cast("Block", _Unlinked())

# Typed as a Block: it answers every read that checking a guess makes (key, parent_cid,
# extra, twin, chained, content_id), and each such check fails; it is never written to.
NO_CHILD: Block = cast("Block", _NoChild())


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block.

    ``ref_cnt``: how many live requests hold it (a property: ``refs``, the block's own
    count, unless the block is one of a shared ``Run``'s, ``counted``, whose ``n`` it is).
    ``key``: the index key of its content once full and recorded (see ``ContentIndex``),
    None while it holds no reusable content (partial, never computed, or reused); while
    it is None, the content fields are stale and meaningless (not cleared: the next fill
    overwrites them). The content: ``parent_cid`` (the parent's content id, 0 for a first
    block), the token bytes (in the key) and ``extra`` (extra-key bytes). ``content_id``:
    a per-process id of that content, shared by every block that holds equal content (its
    children's keys name it); 0 without content.
    ``twin``: another block held the same content first; this one is a spare copy that is
    findable only if that one goes (see ``ContentIndex``).
    ``hash``: the chain hash (the identity outside the process), computed only when a
    consumer needs it (events, tiers), else None.
    ``event``: the BlockStored (a run of blocks) that announced this content, when events
    are recorded (``event.block_of(hash, ...)`` is this block's part of it).
    ``step``: the manager's step in which the content was recorded (its KV is computed by
    that step's forward pass, so it may be copied elsewhere only in a later step).
    ``child``: the block last recorded with this block's content as its parent: a
    guess the index tries before a dict probe, verified like any hit (may be stale);
    ``NO_CHILD`` (which fails every check) until one is.
    ``chained``: the index finds this block only as its parent's ``child``, not in its
    dicts (see ``ContentIndex``).
    ``prev``/``next``: links of the free queue's cached tier (intrusive list).
    ``starts``: the run whose head it is, if any (may be stale: see ``Run``).
    ``counted``: the shared run whose count is this block's, if any.
    """

    block_id: int
    refs: int = 0
    key: Key | None = None
    parent_cid: int = 0
    extra: bytes = b""
    content_id: int = 0
    twin: bool = False
    hash: bytes | None = None
    event: BlockStored | None = None
    step: int = 0
    child: Block = NO_CHILD
    chained: bool = False
    prev: Block = UNLINKED
    next: Block = UNLINKED
    starts: Run | None = None
    counted: Run | None = None

    @property
    def ref_cnt(self) -> int:
        """How many live requests hold the block (its run's one count, if shared)."""
        r = self.counted
        return self.refs if r is None else r.n

    @ref_cnt.setter
    def ref_cnt(self, n: int) -> None:  # one block's count alone: its run's is dissolved
        r = self.counted
        if r is not None:
            r.dissolve()
        self.refs = n

    def clear_content(self) -> None:
        """Mark the block as holding no reusable content (``key`` None, not a twin, not
        chained). Only that: the caller has already taken it out of the index; the content
        fields go stale, as ``key`` None says."""
        self.key = None
        self.twin = False
        self.chained = False

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, ref={self.ref_cnt}, content={self.content_id}"
                f"{', twin' if self.twin else ''})")
