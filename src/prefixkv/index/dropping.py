"""Eviction and the checks of ``ContentIndex``: cached blocks the pool evicts leave the
index (``drop``, ``drop_one``: a held spare takes a content over, or it goes, announced
gone and, with a tier below, demoted to it), the events that state what the device holds
(``snapshot``), ``clear``, and the invariant checks (``check``, ``check_request``). Finding
(``match``, ``claim``) is in ``content.py``; spares leaving the index in ``spares.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block
from ..core.keyless import Keyless
from ..core.request import Request
from ..events import DEVICE, Event
from .announce import RemovedRun, removed
from .content_check import check_index, check_lower_chains, check_request
from .run_check import check_runs
from .spares import SpareIndex


class DroppingIndex(SpareIndex):
    """``ContentIndex``'s eviction, snapshot, clear and checks (see ``ContentIndex``)."""


    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None:
        """The eviction step for cached blocks the pool takes from its free queue (each
        the index's entry for its key): a held twin takes over the content, or the
        content goes (and is announced gone). ``skip``: the spans of pending runs'
        blocks, which no dict holds; ``keyless``: their records (the tier below reads
        their content there)."""
        twins, sink, lower = self._twins, self._sink, self._lower
        self.losses += 1  # (``Run.seen``)
        if lower is not None and (twins or sink.active):  # per block: events in tier order
            assert not skip, "a pending run with spares or events below a tier"
            if lower.load_dst:  # (a load of the step into one is dead; else ``demote``
                lower.unload(blocks)  # looks, at the blocks recorded in this step alone)
            for b in blocks:
                self._unindex(b, evicting=True)
                b.key = None
            return
        # Each evicted content computed before this step goes down to the tier. No chained
        # child stays behind cut off from its parent's content: a child's use is its
        # parent's use and a request releases its tail first, so the pool evicts children
        # first (``check`` verifies it when a tier is below).
        if lower is not None:
            lower.demote(blocks, self.step, keyless)
        evicted = blocks  # (each content goes: pending runs' blocks are announced too)
        if skip:  # (their blocks: nothing to unkey; their hashes, set by their run's
            out: list[Block] = []  # build, are announced): the slices between the spans
            at = 0
            for lo, hi in skip:
                out += blocks[at:lo]
                at = hi
            out += blocks[at:]
            blocks = out
        if not twins:  # the common case: each content goes
            by_chunk, by_key = self._by_chunk, self._by_key
            keyed = 0
            for b in blocks:  # (a chained block leaves no dict entry)
                if b.chained:
                    b.chained = False
                else:
                    key = b.key  # (``_unkey``, inlined: a call a keyed block)
                    if type(key) is bytes:
                        del by_chunk[key]
                    else:
                        assert isinstance(key, tuple), f"a keyed block without a key: {b!r}"
                        del by_key[key]
                    keyed += 1
                b.key = None
            self._num_chained -= len(blocks) - keyed
            if sink.active and evicted:  # one BlockRemoved, built now (eager) or when taken
                if self.lazy:
                    item = _new_removed(RemovedRun)  # (``RemovedRun(...)`` inlined: no
                    item.count, item.blocks = 1, list(evicted)  # ``__init__`` frame)
                    sink.defer(item)
                else:
                    sink.append(removed(list(evicted)))
            return
        # spares held: the blocks whose content goes (all of them unless a spare takes one
        # over), announced as above
        gone: list[Block] | None = [] if sink.active else None
        chained = 0
        for b in evicted:  # the common case: a chained block leaves no dict entry
            if b.key is None:  # a pending run's (``keyless``): no spare of it, it goes
                if gone is not None:
                    gone.append(b)
                continue
            if b.chained:
                b.chained = False
                chained += 1
            elif twins and b.content_id in twins:  # a held spare takes over: nothing goes
                self._unindex(b, evicting=True)
                b.key = None
                continue
            else:
                self._unkey(b.key)
            if gone is not None:
                gone.append(b)
            b.key = None
        self._num_chained -= chained
        if not sink.active:
            return
        if not gone:
            return
        if self.lazy:
            sink.defer(RemovedRun(gone))
        else:
            sink.append(removed(gone))

    def drop_one(self, b: Block) -> None:
        """``drop((b,))``: in the common case, without the tuple and the loop."""
        if self._twins or self._sink.active or self._lower is not None:
            self.drop((b,))
            return
        self.losses += 1  # (``Run.seen``)
        if b.chained:
            b.chained = False
            self._num_chained -= 1
            b.key = None
        else:
            self._unkey(b.key)
            b.key = None

    def snapshot(self, blocks: Sequence[Block]) -> list[Event]:
        if self.run_counts.pending:  # (each block's content and id read below)
            self.settle_all()
        primaries = sorted([b for b in blocks if b.key is not None and not b.twin],
                           key=lambda b: b.content_id)  # parents were stored first
        out: list[Event] = []
        for b in primaries:  # (a spare that took over has its primary's event)
            ev = b.event
            if ev is not None:
                assert b.hash is not None, f"{b!r} was announced without its chain hash"
                out.append(ev.block_of(b.hash, b.block_id, DEVICE))
        return out

    def clear(self) -> None:
        self._epoch += 1  # (every run recorded so far is not ``ok``)
        self.cut = 0
        self._by_chunk.clear()
        self._by_key.clear()
        self._twins.clear()
        self._kids.clear()
        self._num_chained = 0
        assert not self.run_counts.pending, "clear while a pending run is held or cached"
        assert not self.landing, "clear while a store fetch fills device blocks"

    def check(self, blocks: Sequence[Block]) -> str | None:
        # (deferred events: a block's hash is set when the log is taken)
        if self.landing:  # (filled on a fetcher's thread: not the index's until landed)
            apart = {id(b) for run in self.landing.values() for b in run}
            blocks = [b for b in blocks if id(b) not in apart]
        return check_index(self._by_chunk, self._by_key, self._twins,
                           self.hashing and not self.lazy, blocks,
                           self._num_chained, self._lower is not None,
                           self.run_counts.pending) or (
            check_lower_chains(self._lower, blocks, self.run_counts.pending)
            if self._lower is not None else None) or (
            check_runs(blocks, self._epoch, self.run_counts, self.losses)) or (
            self._kids.check(self._by_chunk, self._by_key))

    def check_request(self, req: Request, block_size: int) -> str | None:
        """The first full scheduled block of ``req`` whose content is not its own."""
        return check_request(req, block_size)


_new_removed = object.__new__
