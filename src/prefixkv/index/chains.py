"""The state of ``ContentIndex`` and how one content is found held, chained or keyed:
the parts every recording path shares (``_held``, ``_chain``, ``_key``, ``_add_twin``), and
pending runs written when a reader needs their blocks (``_settle``). The recording paths
are in ``recording.py`` (a miss's blocks: ``store``, ``store_filled``) and ``landed.py``
(content from the tier or store below: ``adopt``, ``land_run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import NO_CHILD, Block, ContentKey, Key
from ..core.run import Run, RunCounts
from ..event_log import EventSink
from .announce import Announcer, Fresh
from .hasher import Hasher
from .kids import Kids
from .pending import write_pending

if TYPE_CHECKING:
    from .lower import LowerTier


class ContentChains(Announcer):
    """``ContentIndex``'s state and the parts its recording calls share (see
    ``ContentIndex``)."""

    def __init__(self, hasher: Hasher, sink: EventSink, block_size: int, *,
                 lower: LowerTier | None = None) -> None:
        self._by_chunk: dict[bytes, Block] = {}
        self._by_key: dict[ContentKey, Block] = {}
        self._twins: dict[int, list[Block]] = {}  # content id -> held spares
        self._num_chained = 0  # blocks found through their parent's ``child`` alone
        self._kids = Kids()  # keyed contents' keys by parent content id (``kids.py``)
        self._next_id = 1
        self._hasher = hasher
        self._sink = sink
        self._bs = block_size
        self._lower = lower  # the tier that keeps evicted content (HostTier), or None
        if lower is not None:  # (it asks whether the device still holds a content)
            lower.device = self.keyed
        self.hashing = sink.active
        # events built when taken (``announce.py``): a tier or a shared store below needs
        # each hash as stored, and a caller's hash callable must fail before any change
        self.lazy = sink.active and lower is None and not hasher.checked
        self.fresh: list[Fresh] | None = None  # with a shared store: contents recorded
        self.hash_may_fail = self.hashing and hasher.checked  # a caller's hash callable
        self.step = 0  # the manager's step: content recorded now is computed this step
        # With a tier below: how many contents ``uncache`` took off the device while other
        # requests held them. While 0, every block found on the device has its parent's
        # content there too (eviction takes children first: a child's use is its parent's
        # use, and requests release their tail first; an uncached block's own children are
        # uncached with it), so a walk that left the device for a slot never comes back;
        # ``check`` verifies it. Those other holders must be dropped too (they hit KV never
        # written), which leaves nothing cut off; an engine that lets them run would, and
        # from then on the walk probes the device at every step.
        self.cut = 0
        self._epoch = 0  # ``clear`` starts another: every run recorded before is not ``ok``
        self.runs = True  # record runs (``Run``); off, every block is claimed alone
        self.pending_runs = True  # a miss's run recorded pending (``pending.py``); off, eagerly
        # calls that took content from device blocks (``drop``, ``drop_one``, ``uncache``):
        # a run recorded (or checked whole) while this count was what it is now is whole
        self.losses = 0
        self.run_counts = RunCounts()  # (the pool reads them: ``BlockPool``)
        self.run_counts.settle = self._settle
        self.run_counts.spans = lower is not None  # (its demotion reads ``Keyless``)
        # device blocks a store fetch fills on its thread, not findable yet (``land_run``
        # makes them so): by the fetch's id; ``check`` passes them by
        self.landing: dict[int, list[Block]] = {}


    def _settle(self, run: Run) -> None:
        """Write pending ``run``'s blocks' content (``pending.py``): ordinary chained blocks
        from now on."""
        write_pending(run)
        run.pending = False
        self.run_counts.pending.pop(run, None)
        self._num_chained += len(run.blocks)

    def settle_all(self) -> None:
        """Write every pending run's content (a reader that may meet any of them)."""
        for run in list(self.run_counts.pending):
            self._settle(run)

    def content_of(self, b: Block) -> int | None:
        """The content id ``b`` holds findable (as its content's primary or a listed
        spare), None when it holds none (a block ``uncache`` took out while others held
        it keeps its key for them, as an unlisted twin: None). Changes nothing but the
        writes of a pending run ``b`` is in."""
        if self.run_counts.pending:
            self._settle_near(b)
        if b.key is None or (b.twin and b not in self._twins.get(b.content_id, ())):
            return None
        return b.content_id

    def contents_of(self, blocks: Sequence[Block]) -> list[int]:
        """``content_of`` of each of ``blocks`` (0 for None), writing no pending run: a
        block of one, but its last, holds the run's ``cid0`` plus its place (pending.py;
        the settle would key it, never a twin). A stretch of ``blocks`` that is such a
        run's, in order, is answered at once."""
        twins = self._twins
        if not self.run_counts.pending:  # (no pending run: each block's own fields)
            if not twins:  # (a twin then is one ``uncache`` took out: unlisted)
                return [0 if b.key is None or b.twin else b.content_id for b in blocks]
            return [0 if b.key is None or (b.twin and b not in twins.get(b.content_id, ())) else b.content_id
                    for b in blocks]
        out: list[int] = []
        i, n = 0, len(blocks)
        while i < n:
            b = blocks[i]
            r = b.counted
            if r is not None and r.pending and b is not r.blocks[-1]:
                run = r.blocks
                k = run.index(b)
                m = len(run) - 1 - k  # (the last is written: read below)
                if blocks[i:i + m] == run[k:k + m]:  # (the blocks themselves: no __eq__)
                    out.extend(range(r.cid0 + k, r.cid0 + k + m))
                    i += m
                else:
                    out.append(r.cid0 + k)
                    i += 1
                continue
            out.append(0 if b.key is None or (b.twin and b not in twins.get(b.content_id, ()))
                       else b.content_id)
            i += 1
        return out

    def _settle_near(self, parent: Block) -> None:
        """Settle the pending run ``parent`` is a block of (but its last, written), or
        heads: new content recorded under ``parent`` reads and writes its ``child`` (and a
        content held there must be found)."""
        r = parent.counted
        if r is not None and r.pending and parent is not r.blocks[-1]:
            self._settle(r)
        r = parent.starts
        if r is not None and r.pending:
            self._settle(r)

    def _may_chain(self, parent: Block) -> bool:
        """Whether a new content under ``parent`` may be found through ``parent.child``
        alone: ``parent`` is the block found for its content (not a spare, not emptied),
        no spare of that content is held (their children are keyed in the dicts, where a
        spare's request finds them)."""
        return (parent.key is not None and not parent.twin
                and not (self._twins and parent.content_id in self._twins))

    def _held(self, parent: Block | None, cid: int, chunk: bytes, extra: bytes) -> Block | None:
        """The block found for content ``(cid, chunk, extra)``, if one holds it: the
        parent's chained child, or a dict entry. Changes nothing but a pending run's
        writes (``pending.py``)."""
        if parent is not None and self.run_counts.pending:
            self._settle_near(parent)
        c = parent.child if parent is not None else NO_CHILD
        if c.key == chunk and c.parent_cid == cid and c.extra == extra and not c.twin:
            return c
        k = self._by_chunk.get(chunk)
        if k is not None and k.parent_cid == cid and k.extra == extra:
            return k
        return self._by_key.get((cid, chunk, extra)) if self._by_key else None

    def keyed(self, parent_cid: int, chunk: bytes, extra: bytes) -> Block | None:
        """The block keyed in the maps for content ``(parent_cid, chunk, extra)``, if one
        is (a chained block, found through its parent alone, is not looked for). Changes
        nothing."""
        return self._held(None, parent_cid, chunk, extra)

    def holds(self, parent: Block | None, chunk: bytes, extra: bytes) -> bool:
        """Whether a device block holds the content ``chunk``/``extra`` under ``parent``'s
        content (None: a first block): ``held`` is not None (written out: a store's
        landing asks it, one call less)."""
        if parent is not None and self.run_counts.pending:  # (its content id read here)
            self._settle_near(parent)
        return self._held(parent, parent.content_id if parent is not None else 0,
                          chunk, extra) is not None

    def held(self, parent: Block | None, chunk: bytes, extra: bytes) -> Block | None:
        """The device block holding the content ``chunk``/``extra`` under ``parent``'s
        content (None: a first block), as ``match`` would find it after ``parent``; None
        when none does. Changes nothing but the writes of a pending run ``parent`` heads
        or is in (no other pending block can hold it: none is a first block or in a
        dict)."""
        if parent is not None and self.run_counts.pending:  # (its content id read here)
            self._settle_near(parent)
        return self._held(parent, parent.content_id if parent is not None else 0, chunk, extra)

    def spares(self, b: Block) -> list[Block]:
        """The held spares of the content ``b`` holds as its primary, the oldest first
        (the one that takes its place if it goes). Changes nothing."""
        return list(self._twins.get(b.content_id, ())) if self._twins else []

    def _chain(self, parent: Block, b: Block, chunk: bytes) -> None:
        """Record ``b`` (new content ``chunk`` under ``parent``) as ``parent``'s chained
        child, found through that link alone; a chained child it displaces goes into the
        dicts (``_enter``)."""
        c = parent.child
        if c.chained and c.parent_cid == parent.content_id:
            self._enter(c)
        parent.child = b
        b.key = chunk
        b.chained = True
        self._num_chained += 1

    def _enter(self, b: Block) -> None:
        """Key chained block ``b`` in the dicts: by its token bytes, or by its triple when
        those are another content's key."""
        self._num_chained -= 1
        key = self._key_first(b, b.key)  # type: ignore[arg-type]  # (a chained block's key is its bytes)
        if b.parent_cid:  # (``_key``, inline)
            self._kids.note(b.parent_cid, key, self._by_chunk, self._by_key)

    def _key(self, b: Block, chunk: bytes) -> None:
        """Key new content ``b`` in the dicts (by its token bytes, or by its triple when
        those are another content's key), noted as its parent's child (``Kids``)."""
        key = self._key_first(b, chunk)
        if b.parent_cid:  # (a first block's parent, 0, is never forgotten: ``kids.py``)
            self._kids.note(b.parent_cid, key, self._by_chunk, self._by_key)

    def _key_first(self, b: Block, chunk: bytes) -> Key:
        """``_key`` for a first block (parent content 0), which is noted nowhere; returns
        the key."""
        b.chained = False
        if self._by_chunk.setdefault(chunk, b) is b:
            b.key = chunk
            return chunk
        b.key = key = (b.parent_cid, chunk, b.extra)
        self._by_key[key] = b
        return key

    def _add_twin(self, b: Block, held: Block) -> int:
        """Equal content is already held by ``held``: ``b`` becomes its spare. A content
        with spares is keyed in the dicts, and so are its children (see ``_may_chain``):
        the pending run ``held`` is a block of (its last one too: keyed now) or heads is
        written first; no other run holds such a block."""
        if self.run_counts.pending:
            r = held.counted
            if r is not None and r.pending:
                self._settle(r)
            r = held.starts
            if r is not None and r.pending:
                self._settle(r)
        c = held.child
        if c.chained and c.parent_cid == held.content_id:
            self._enter(c)
        if held.chained:
            self._enter(held)
        b.key = held.key
        b.content_id = held.content_id
        b.twin = True
        if not self.lazy:  # (deferred: the run's build sets them, in log order)
            b.hash, b.event = held.hash, held.event
        self._twins.setdefault(held.content_id, []).append(b)
        return held.content_id
