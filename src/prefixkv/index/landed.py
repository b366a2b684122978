"""Recording content that came from below (``ContentIndex``): a host tier's slots loaded
into fresh device blocks (``adopt``), and a store fetch's device run made findable in one
write (``land_run``, under ``pend_counts``' run counts when it lands pending).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from ..core.block import Block
from ..core.run import Run, RunCounts
from ..events import DEVICE
from .chains import ContentChains


class LandedRecorder(ContentChains):
    """``ContentIndex``'s calls that record content the tier or store below kept (see
    ``ContentIndex``)."""

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
        for b, s, chunk in zip(islice(blocks, first), islice(slots, first), chunks):  # noqa: B905
            # (the rest of a run: chained below) (no ``strict``: a keyword C parses on a
            # path of its own, cold at a store start's promotion: store25-r23.md)
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
        (``core.store_fill.fill_pending``), for a request with multimodal extra keys
        ``mm``; None when it may not (events, spares, keys per block, runs off). Hashes
        alone allow it (a store's keys): ``fill_pending`` writes each block's."""
        ok = self.runs and self.pending_runs and not self._sink.active and not self._twins
        return self.run_counts if ok and mm is None else None

    def land_run(self, blocks: Sequence[Block], chunk: bytes, parent: Block | None,
                 slots: Sequence[Block], run: Run | None = None) -> None:
        """Make findable, in one write, a run of held device ``blocks`` whose content
        fields a store fetch wrote (``core.store_fill.fill_device``): each block after
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
            self.run_counts.pending[run] = None
        if self._sink.active:
            self._announce_up(blocks, slots)
