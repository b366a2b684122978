"""The recording half of ``ContentIndex``: its state, and how the content of blocks that
became full is recorded (``store``, ``store_filled``) or came from the tier below
(``adopt``): chained or keyed, spares for equal content. The blocks to record with their
hashes (``prepare``), events and store writes are in ``announce.py``; spares leaving the
index (``uncache``, ``release_spare``) in ``spares.py``; finding (``match``, ``claim``),
eviction and checks in ``content.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, islice
from typing import TYPE_CHECKING

from ..chunks import joined
from ..core.block import NO_CHILD, Block, ContentKey, Key, Run, RunCounts
from ..core.request import Request
from ..event_log import EventSink
from ..events import DEVICE
from .announce import Announcer, Fresh, Prepared, StoredRun
from .cut_off import cut_off, record_cut_off
from .hasher import Hasher
from .kids import Kids
from .pending import record_pending, write_pending

if TYPE_CHECKING:
    from .lower import LowerTier



class ContentRecorder(Announcer):
    """``ContentIndex``'s state and its recording calls (see ``ContentIndex``)."""

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
        # device blocks a store fetch fills on its thread, not findable yet (``land_run``
        # makes them so): by the fetch's id; ``check`` passes them by
        self.landing: dict[int, list[Block]] = {}

    def store_filled(self, req: Request, j: int) -> None:
        """Record block ``j`` of ``req``, which the last token appended filled (decode).
        In the common case (a new content under a parent that may take it as its chained
        child, no hashes wanted) one probe and no dict write (with a tier below, a probe
        of its map too: a slot that keeps this content lends its id); else ``store``."""
        bs = self._bs
        chunk = req.tokens[j * bs:(j + 1) * bs].tobytes()
        mm = req.keys.mm
        extra = req.keys.base if mm is None or j >= len(mm) else mm[j]
        parent = req.blocks[j - 1] if j else None
        if parent is not None and self.run_counts.pending:
            self._settle_near(parent)
        if self.hashing or parent is None:
            self.store(req, j, self._hashed(parent, [chunk], [extra]))
            return
        cid = parent.content_id
        # ``_may_chain``, ``_held`` and ``_chain`` inlined (one block in 16 tokens: the
        # calls cost ~10 ns a decoded token)
        c = parent.child
        if parent.key is None or parent.twin or (self._twins and cid in self._twins) or (
                c.key == chunk and c.parent_cid == cid and c.extra == extra):
            self.store(req, j, ([chunk], [extra], None))  # keyed, or a spare: ``store`` decides
            return
        h = self._by_chunk.get(chunk)
        if (h is not None and h.parent_cid == cid and h.extra == extra) or (
                self._by_key and (cid, chunk, extra) in self._by_key):  # held, keyed
            self.store(req, j, ([chunk], [extra], None))
            return
        if c.chained and c.parent_cid == cid:  # displaced: keyed in the dicts
            self._enter(c)
        b = req.blocks[j]
        parent.child = b
        b.key, b.chained = chunk, True
        self._num_chained += 1
        b.parent_cid, b.extra, b.step = cid, extra, self.step
        # one content, one id: a host slot that keeps this content lends its id
        lower = self._lower
        slot = lower.find(cid, chunk, extra) if lower is not None else None
        if lower is None or slot is None:
            b.content_id = self._next_id
            self._next_id += 1
        else:
            b.content_id = slot.content_id
            lower.on_device(slot)

    def _settle(self, run: Run) -> None:
        """Write pending ``run``'s blocks' content (``pending.py``): ordinary chained blocks
        from now on."""
        write_pending(run)
        run.pending = False
        self.run_counts.pending.discard(run)
        self._num_chained += len(run.blocks)

    def settle_all(self) -> None:
        """Write every pending run's content (a reader that may meet any of them)."""
        for run in list(self.run_counts.pending):
            self._settle(run)

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

    def holds(self, parent: Block | None, chunk: bytes, extra: bytes) -> bool:
        """Whether a device block holds the content ``chunk``/``extra`` under ``parent``'s
        content (None: a first block), as ``match`` would find it after ``parent``.
        Changes nothing but the writes of a pending run ``parent`` heads or is in (no
        other pending block can hold it: none is a first block or in a dict)."""
        if parent is not None and self.run_counts.pending:  # (its content id read here)
            self._settle_near(parent)
        return self._held(parent, parent.content_id if parent is not None else 0,
                          chunk, extra) is not None

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

    def store(self, req: Request, first: int, prepared: Prepared, data: bytes | None = None) -> None:
        """``Index.store``; ``data``: the chunks' bytes in one piece, if the caller has
        them (a prepared prompt's: no join)."""
        chunks, extras, hashes = prepared
        blocks = req.blocks
        parent = blocks[first - 1] if first else None
        if parent is not None and self.run_counts.pending:
            self._settle_near(parent)
        if parent is not None and (parent.key is None or parent.twin) \
                and cut_off(parent, self._by_chunk, self._by_key):  # (rare: ``cut_off.py``)
            self._next_id = record_cut_off(blocks[first:first + len(chunks)], parent, extras,
                                           hashes, self._next_id, self.step)
            return
        cid = parent.content_id if parent is not None else 0
        if hashes is None and self._lower is None and len(chunks) > 2 and self.runs \
                and req.keys.mm is None and (parent is None or (
                    parent.key is not None and not parent.twin
                    and not (self._twins and cid in self._twins))) \
                and self._store_run(req, first, parent, cid, chunks, extras, data):
            return
        nid = fresh = self._next_id  # ids from ``fresh`` on are minted by this call
        minted = 0  # ids minted below the chained branch (``_chain`` counts its own blocks)
        spares: dict[int, Block] | None = None  # position -> the block held, when deferred
        lower, step = self._lower, self.step
        span = blocks[first:first + len(chunks)]  # (less its head, a ``Run``'s blocks below)
        it = zip(span, chunks, extras, strict=False)
        new: Iterable[tuple[Block, bytes, bytes]] = ()  # the rest, once each content is new
        for item in it:
            if cid >= fresh:  # the parent's content is new: so is each from here on (below)
                new = chain((item,), it)
                break
            b, chunk, extra = item
            b.parent_cid = cid
            b.extra = extra
            held = self._held(parent, cid, chunk, extra)
            if held is not None:  # equal content is held: b is its spare
                cid = self._add_twin(b, held)
                if self.lazy:  # (rare: a position found without a counter per block)
                    spares = spares or {}
                    spares[blocks.index(b, first) - first] = held
                parent = held
                continue
            if parent is not None and self._may_chain(parent):
                self._chain(parent, b, chunk)
            elif parent is not None:
                self._key(b, chunk)
                parent.child = b  # the guess ``claim`` tries first after the parent
            else:  # a first block: not noted as a child (``Kids``)
                self._key_first(b, chunk)
            parent = b
            # a new content; one content, one id: recomputed while a host slot keeps it,
            # it takes the slot's id, so the slot's children stay findable below it
            slot = lower.find(cid, chunk, extra) if lower is not None else None
            if lower is None or slot is None:
                b.content_id = cid = nid
                nid += 1
                minted += 1
            else:
                b.content_id = cid = slot.content_id
                lower.on_device(slot)  # its chained child must be found by ``find`` now
        if new and len(span) > 2 and span[0].content_id >= fresh and self.runs \
                and lower is None and req.keys.mm is None:
            # a new first content: every block after it is chained, a run (``Run``; the
            # span, the head's first, not copied again)
            at = nid
            nid = self._record_run(span, chunks, joined(chunks), extras[0], cid, nid)
            minted += nid - at  # (``_record_run`` counts its own chained blocks)
        else:
            for b, chunk, extra in new:  # nothing is held under a new content yet (no
                # slot either) and its child is stale: b is its chained child (ids from
                # ``fresh`` on are minted here and above, for a block)
                b.parent_cid = cid
                b.extra = extra
                parent.child = b  # type: ignore[union-attr]
                b.key = chunk
                b.chained = True
                b.content_id = cid = nid
                nid += 1
                parent = b
        if lower is not None:  # (the step a content was recorded in: read by the tier alone)
            for b in span:
                b.step = step
        self._num_chained += nid - fresh - minted  # (each id the chained branch minted)
        self._next_id = nid
        if hashes is not None:
            self._announce(req, first, chunks, hashes)
            if self.fresh is not None:
                self._note_fresh(self.fresh, req, first, len(hashes))
        elif self.lazy:  # announced when the log is taken: one StoredRun for the run
            self._sink.defer(StoredRun(self._hasher, blocks[first - 1] if first else None,
                                       blocks[first:first + len(chunks)], chunks, extras,
                                       req.keys.extra, first, self._bs, spares))

    def _store_run(self, req: Request, first: int, parent: Block | None, cid: int,
                   chunks: Sequence[bytes], extras: list[bytes], data: bytes | None) -> bool:
        """``store``'s common case in one pass, without its loop: a miss's first block is
        new content (so is every block after it) chained under ``parent`` (or keyed: a
        first block), and the rest are a run (``_record_run``); no tier below, no hashes
        now, no multimodal keys, more than two blocks, ``parent`` (settled) may chain.
        Returns False, having changed nothing, when the first block's content is held
        (a spare: ``store``'s loop records it)."""
        chunk, extra = chunks[0], extras[0]
        c = parent.child if parent is not None else NO_CHILD  # (``_held``, inline)
        if c.key == chunk and c.parent_cid == cid and c.extra == extra and not c.twin:
            return False
        k = self._by_chunk.get(chunk)
        if (k is not None and k.parent_cid == cid and k.extra == extra) or (
                self._by_key and (cid, chunk, extra) in self._by_key):
            return False
        blocks = req.blocks
        b = blocks[first]
        b.parent_cid = cid
        b.extra = extra
        if parent is None:  # a first block: keyed, not noted as a child (``Kids``)
            self._key_first(b, chunk)
        else:  # (``_chain``, inline)
            if c.chained and c.parent_cid == cid:  # the chained child it displaces: keyed
                # (``_enter``, inline: a chained block's key is its token bytes)
                self._num_chained -= 1
                key: Key = self._key_first(c, c.key)  # type: ignore[arg-type]
                self._kids.note(cid, key, self._by_chunk, self._by_key)
            parent.child = b
            b.key = chunk
            b.chained = True
            self._num_chained += 1
        b.content_id = nid = self._next_id
        self._next_id = self._record_run(blocks[first:first + len(chunks)], chunks,
                                         joined(chunks) if data is None else data, extra,
                                         nid, nid + 1)
        if self.lazy:  # announced when the log is taken: one StoredRun for the run
            self._sink.defer(StoredRun(self._hasher, parent, blocks[first:first + len(chunks)],
                                       chunks, extras, req.keys.extra, first, self._bs, None))
        return True

    def _record_run(self, span: list[Block], chunks: Sequence[bytes], data: bytes,
                    extra: bytes, cid: int, nid: int) -> int:
        """``store``'s chained rest as a run: ``span[0]``, new content ``cid``, heads the
        rest of ``span`` (``chunks``: the head's token bytes, then theirs; ``data``: the
        same in one piece), each the chained
        child of the one before under a new id from ``nid`` on (returns the next). The
        blocks ``store`` records are held by the storing request alone (new blocks, or
        ones it reserved: a fork shares full blocks only, which are recorded already), so
        they are one count from here on (``shared``, ``n`` 1), linked in the order a
        release frees them (the tail first: ``fwd`` False): the release that frees them
        links the run's two ends alone, and the eviction takes them as one list."""
        head = parent = span[0]
        del span[0]  # (a move of the pointers: no count touched)
        run = head.starts = Run(span, data, extra, self._epoch, self.losses,
                                self.run_counts, cid)
        run.shared = run.linked = True
        run.n = 1
        self.run_counts.shared += 1
        if self.pending_runs and not self.hashing:  # (no event reads the blocks' content)
            return record_pending(head, span, cid, nid, run)
        end = nid + len(span)
        for b, chunk, c in zip(span, islice(chunks, 1, None), range(nid, end), strict=False):
            b.parent_cid = cid
            b.extra = extra
            parent.child = b
            b.key = chunk
            b.chained = True
            b.content_id = cid = c
            b.counted = run
            b.next = parent  # (the head's links too: harmless, it is held and is linked
            parent.prev = b  # anew when released)
            parent = b
        self._num_chained += len(span)  # (``store`` counts the ids minted: a pending
        return end  # run's blocks are counted through ``RunCounts.pending`` instead)

    def adopt(self, blocks: Sequence[Block], slots: Sequence[Block], chunks: Sequence[bytes],
              parent: Block | None, run: bool) -> None:
        """Record in each fresh device block of ``blocks`` the content of the host slot
        beside it in ``slots`` (whose copies the tier states): the same content ids, so
        the chain goes on below them. ``chunks``: those contents' token bytes (each slot
        key's), in the same order. The device holds none of these contents. ``run``:
        ``blocks`` follow ``parent`` (None: from the first block on) in one request, so
        each is chained under the one before (``parent`` may refuse, as in ``store``);
        else each is keyed. Without events no block's ``event`` is read (every reader
        asks ``sink.active`` first): it is written only with them."""
        step = self.step
        if parent is not None and self.run_counts.pending:  # (its ``child`` is written)
            self._settle_near(parent)
        prev = parent
        first = 1 if run else len(blocks)  # recorded as ``store`` records them; the rest of
        for b, s, chunk in zip(islice(blocks, first), islice(slots, first), chunks,  # a run:
                               strict=False):  # chained below
            b.parent_cid, b.extra = s.parent_cid, s.extra
            b.content_id, b.hash, b.step = s.content_id, s.hash, step
            if run and prev is not None and self._may_chain(prev):
                self._chain(prev, b, chunk)
            else:
                self._key(b, chunk)
                if run and prev is not None:
                    prev.child = b
            prev = b
        if run and len(blocks) > 1:
            assert prev is not None
            # (hashes exist only when hashes are consumed: else the slots' and the blocks'
            # are None alike)
            for b, s, chunk in zip(islice(blocks, 1, None), islice(slots, 1, None),
                                   islice(chunks, 1, None), strict=False):
                b.key = chunk
                b.chained = True
                b.parent_cid = s.parent_cid
                b.extra = s.extra
                b.content_id = s.content_id
                b.hash = s.hash
                b.step = step
                prev.child = b
                prev = b
            self._num_chained += len(blocks) - 1
        if self._sink.active:  # each announced again, on the device
            self._announce_up(blocks, slots)

    def _announce_up(self, blocks: Sequence[Block], slots: Sequence[Block]) -> None:
        """Each of device ``blocks`` announced again, on the device, with the event of
        the host slot beside it in ``slots`` (their contents); none for a slot without."""
        sink = self._sink
        for b, s in zip(blocks, slots, strict=False):
            if s.event is None:
                b.event = None
            else:
                assert s.hash is not None, f"host slot {s!r} was announced without its hash"
                b.event = s.event.block_of(s.hash, b.block_id, DEVICE)
                sink.append(b.event)

    def pend_counts(self, mm: Sequence[bytes] | None) -> RunCounts | None:
        """The run counts a store fetch's device run may land as one pending run under
        (``core.store_landing.fill_pending``), for a request with multimodal extra keys
        ``mm``; None when it may not (events, spares, keys per block, runs off). Hashes
        alone allow it (a store's keys): ``fill_pending`` writes each block's."""
        ok = self.runs and self.pending_runs and not self._sink.active and not self._twins
        return self.run_counts if ok and mm is None else None

    def land_run(self, blocks: Sequence[Block], chunk: bytes, parent: Block | None,
                 slots: Sequence[Block], run: Run | None = None) -> None:
        """Make findable, in one write, a run of held device ``blocks`` whose content
        fields a store fetch wrote (``core.store_landing.fill_device``): each block after
        the first chained under the one before (key and ``chained`` set) under content ids
        nothing findable holds, the first with no key. Key the first (token bytes
        ``chunk``), or chain it under ``parent`` (the device block before it, None from
        the first block; the device holds none of the run's contents); count the rest as
        chained, or, given ``run`` (``fill_pending`` wrote them as pending ``run``, the
        first block its head), record ``run`` as pending. ``slots``: host slots holding
        the same contents (landed), whose events announce each block again, on the
        device, when events are recorded."""
        b = blocks[0]
        if parent is not None and self.run_counts.pending:  # (its ``child`` is written)
            self._settle_near(parent)
        if parent is not None and self._may_chain(parent):
            self._chain(parent, b, chunk)
        else:
            self._key(b, chunk)
            if parent is not None:
                parent.child = b
        if run is None:
            self._num_chained += len(blocks) - 1
        else:  # (``pend_counts`` allowed it at the start; the caller checked it still does)
            run.ok, run.seen = self._epoch, self.losses
            b.starts = run
            self.run_counts.shared += 1
            self.run_counts.pending.add(run)
        if self._sink.active:
            self._announce_up(blocks, slots)

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
        with spares is keyed in the dicts, and so are its children (see ``_may_chain``)."""
        if self.run_counts.pending:
            self.settle_all()
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
