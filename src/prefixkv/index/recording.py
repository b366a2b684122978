"""The recording half of ``ContentIndex``: how the content of blocks that became full is
recorded (``store``, ``store_filled``): chained or keyed, spares for equal content, a
miss's chained rest as a run (``_record_run``, pending: ``pending.py``). The index's state
and the parts these share are in ``chains.py``; content from the tier below (``adopt``)
or a store fetch (``land_run``) in ``landed.py``; the blocks to record with their hashes
(``prepare``), events and store writes in ``announce.py``; spares leaving the index
(``uncache``, ``release_spare``) in ``spares.py``; finding (``match``, ``claim``) in
``content.py``, eviction and checks in ``dropping.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, islice

from ..chunks import joined
from ..core.block import NO_CHILD, Block, Key
from ..core.request import Request
from ..core.run import Run
from .announce import Prepared, StoredRun, stored_run
from .cut_off import cut_off, record_cut_off
from .landed import LandedRecorder


class ContentRecorder(LandedRecorder):
    """``ContentIndex``'s recording calls for a miss's blocks (see ``ContentIndex``)."""

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
        if (self.hashing and not self.lazy) or parent is None:  # (deferred: as below)
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
            lower.on_device(slot, b)
        if self.lazy:  # announced when the log is taken (``store``'s StoredRun, one block)
            self._sink.defer(stored_run(self._hasher, parent, [b], [chunk], [extra],
                                        req.keys.extra, j, bs, None))

    def store(self, req: Request, first: int, prepared: Prepared, data: bytes | None = None) -> None:
        """``Index.store``; ``data``: the chunks' bytes in one piece, if the caller has
        them (a prepared prompt's: no join)."""
        chunks, extras, hashes = prepared
        if hashes is None and len(chunks) > 2 and self._lower is None \
                and self._store_run(req, first, chunks, extras, data):
            return
        blocks = req.blocks
        parent = blocks[first - 1] if first else None
        if parent is not None and self.run_counts.pending:  # (``_settle_near``'s tests,
            pr = parent.counted  # inline: a parent that is a pending run's last block, or
            ps = parent.starts  # in a run written already, needs no write)
            if (pr is not None and pr.pending and parent is not pr.blocks[-1]) or (
                    ps is not None and ps.pending):
                self._settle_near(parent)
        if parent is not None and (parent.key is None or parent.twin) \
                and cut_off(parent, self._by_chunk, self._by_key):  # (rare: ``cut_off.py``)
            self._next_id = record_cut_off(blocks[first:first + len(chunks)], parent, extras,
                                           hashes, self._next_id, self.step)
            return
        cid = parent.content_id if parent is not None else 0
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
                lower.on_device(slot, b)  # its chained child must be found by ``find`` now
        if new and len(span) > 2 and span[0].content_id >= fresh and self.runs \
                and lower is None and req.keys.mm is None:
            # a new first content: every block after it is chained, a run (``Run``; the
            # span, the head's first, not copied again)
            at = nid
            nid = self._record_run(span[0], span[1:], chunks, joined(chunks), extras[0], cid, nid)
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
            self._sink.defer(stored_run(self._hasher, blocks[first - 1] if first else None,
                                        blocks[first:first + len(chunks)], chunks, extras,
                                        req.keys.extra, first, self._bs, spares))

    def _store_run(self, req: Request, first: int, chunks: Sequence[bytes], extras: list[bytes],
                   data: bytes | None) -> bool:
        """``store``'s common case in one pass, without its loop, with no hashes now
        (``store(req, first, (chunks, extras, None), data)``; ``add_request``'s common
        case calls it first, with no ``store`` frame): a miss's first block is new
        content (so is every block after it) chained under its parent (or keyed: a first
        block), and the rest are a run (``_record_run``); no multimodal keys, a parent
        (settled) that may chain; no tier below and more than two blocks (its callers'
        tests: ``add_request``'s common case has no tier). Returns False,
        having changed nothing but settling the parent (as ``store`` does first), when
        that is not the case or the first block's content is held (a spare: ``store``'s
        loop records it)."""
        blocks = req.blocks
        parent = blocks[first - 1] if first else None
        if parent is not None and self.run_counts.pending:  # (``_settle_near``'s tests,
            # inline: a chat turn's parent, the last block of the pending run the turn
            # before stored, needs no write, and a call is a cold frame a step)
            r = parent.counted
            if (r is not None and r.pending and parent is not r.blocks[-1]) or (
                    parent.starts is not None and parent.starts.pending):
                self._settle_near(parent)
        cid = parent.content_id if parent is not None else 0
        if not self.runs or req.keys.mm is not None or (parent is not None and (
                parent.key is None or parent.twin or (self._twins and cid in self._twins))):
            return False
        chunk, extra = chunks[0], extras[0]
        c = parent.child if parent is not None else NO_CHILD  # (``_held``, inline)
        if c.key == chunk and c.parent_cid == cid and c.extra == extra and not c.twin:
            return False
        k = self._by_chunk.get(chunk)
        if (k is not None and k.parent_cid == cid and k.extra == extra) or (
                self._by_key and (cid, chunk, extra) in self._by_key):
            return False
        b = blocks[first]
        b.parent_cid = cid
        b.extra = extra
        if parent is None:  # a first block: keyed, not noted as a child (``Kids``)
            self._key_first(b, chunk)
        else:  # (``_chain``, inline)
            if c.chained and c.parent_cid == cid:  # the chained child it displaces: keyed
                # (``_enter`` and its ``_key_first``, inline: a chained block's key is its
                # token bytes; one a request under a shared prefix, events-r17)
                self._num_chained -= 1
                cbytes: bytes = c.key  # type: ignore[assignment]
                key: Key = cbytes
                c.chained = False
                by_chunk = self._by_chunk
                if by_chunk.setdefault(cbytes, c) is not c:  # (its bytes taken: the triple)
                    c.key = key = (cid, cbytes, c.extra)
                    self._by_key[key] = c
                self._kids.note(cid, key, by_chunk, self._by_key)
            parent.child = b
            b.key = chunk
            b.chained = True
            self._num_chained += 1
        b.content_id = nid = self._next_id
        self._next_id = self._record_run(b, blocks[first + 1:first + len(chunks)], chunks,
                                         joined(chunks) if data is None else data, extra,
                                         nid, nid + 1)
        if self.lazy:  # announced when the log is taken: one StoredRun for the run
            sr = StoredRun()  # (``stored_run`` inline, no spares: as ``Run()`` above)
            sr.count = 1
            sr.hasher, sr.parent, sr.blocks = self._hasher, parent, blocks[first:first + len(chunks)]
            sr.chunks, sr.extras, sr.extra = chunks, extras, req.keys.extra
            sr.first, sr.bs, sr.spares = first, self._bs, None
            log = self._sink  # (``EventLog.defer``, inline: one StoredRun counts as one event)
            log._events.append(sr)  # type: ignore[union-attr]
            log._deferred += 1  # type: ignore[union-attr]
            if len(log._events) + log._extra > log.max_events:  # type: ignore[union-attr]
                log._overflow()  # type: ignore[union-attr]
        return True

    def _record_run(self, head: Block, span: list[Block], chunks: Sequence[bytes], data: bytes,
                    extra: bytes, cid: int, nid: int) -> int:
        """``store``'s chained rest as a run: ``head``, new content ``cid``, heads ``span``,
        the blocks after it (the run's list from now on; ``chunks``: the head's token
        bytes, then theirs; ``data``: the same in one piece), each the chained
        child of the one before under a new id from ``nid`` on (returns the next). The
        blocks ``store`` records are held by the storing request alone (new blocks, or
        ones it reserved: a fork shares full blocks only, which are recorded already), so
        they are one count from here on (``shared``, ``n`` 1), linked in the order a
        release frees them (the tail first: ``fwd`` False): the release that frees them
        links the run's two ends alone, and the eviction takes them as one list."""
        parent = head  # (``span`` comes without it: no ``del``, whose C path is cold a step)
        counts = self.run_counts
        # (``new_run`` inline, shared and linked already: a class called with an
        # ``__init__`` enters the interpreter again from C, paths cold after the forward
        # pass; a call of the factory is a frame and a code object more)
        run = head.starts = Run()
        run.blocks, run.data, run.extra = span, data, extra
        run.ok, run.seen, run.counts = self._epoch, self.losses, counts
        run.shared = run.linked = True
        run.n = 1
        run.fwd = run.pending = False
        run.pcid, run.cid0 = cid, 0
        counts.shared += 1
        if self.pending_runs and (not self.hashing or self.lazy):  # (no hash computed now;
            # a deferred build reads none) pending (``pending.py``): ``counted`` and the
            # links a block, tail first; the head's ``child``; the last block's content
            for b in span:
                b.counted = run
                b.next = parent  # (the head's links too: harmless, as below)
                parent.prev = b
                parent = b
            head.child = span[0]
            run.pending = True
            run.cid0 = nid
            nid += len(span)
            parent.content_id = nid - 1  # (``Run.write_last``, its chunk at hand)
            parent.parent_cid = nid - 2 if len(span) > 1 else cid
            parent.extra = extra
            parent.key = chunks[-1]
            parent.chained = True
            counts.pending[run] = None
            return nid
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
