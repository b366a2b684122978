"""How evicted device content goes down to the host tier (``HostTier`` is a
``SlotOffload``): ``demote`` keeps each content the pool evicts in a slot, stating the
offload copy, or refreshes the slot that holds it already; when every slot is pinned,
the content is lost, and so are the slots of its descendants (``_withdraw_orphans``).
A slot taken whose content no other tier holds takes the slots under it along
(``host_orphans``).

    evicted device block --demote--> new slot (pinned, offload stated) | held slot (refreshed) | lost
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import filterfalse

from ..core.block import Block
from ..core.free_queue import FreeBlockQueue
from ..core.keyless import Keyless, keyed_among
from .host_index import HOST, withdrawn
from .host_orphans import Orphan, SlotOrphans


class SlotOffload(SlotOrphans):
    """``HostTier``'s offloads (its ``_empty`` stack, ``_cached`` LRU, ``_pinned`` list and
    the step's offload and load ids, besides ``SlotIndex``'s maps)."""

    _empty: list[Block]
    _cached: FreeBlockQueue
    _pinned: list[Block]
    _flight: list[Block]
    _requeue: list[Block]  # found slots with slots under them, requeued (``end_step``)
    _above: int  # the parent content of the last of them (so requeued too)
    # (``_pinned_parents``: the lists it read, how much of ``_pinned``, and the ids)
    _lost_parents: tuple[list[Block], int, list[Block], set[int]] | None
    offload_src: list[int]
    offload_dst: list[int]
    load_src: list[int] | tuple[int, ...]
    load_dst: list[int] | tuple[int, ...]

    unload: Callable[[Sequence[Block]], None]  # (``SlotLoads``'s)

    def demote(self, blocks: Sequence[Block], step: int, keyless: Keyless | None = None) -> None:
        """The content of ``blocks`` (full blocks with content, keyed by their token
        bytes or triple) is leaving the device: their blocks are evicted for reuse. Of
        those recorded before ``step`` (computed by an earlier forward pass; the rest were
        never computed), keep each in a slot, stating the offload copy (its two ids join
        the step's one ``BlockOffloads``), unless a slot holds it already (then it becomes
        the most recently used; with slots under it, once more when the step's slots are
        unpinned, as do the slots above it found in this step, so that the LRU takes
        leaves first: ``HostTier._move_last``) or every slot is pinned (then it is lost).
        The slots taken
        are pinned until the plan is drained. A new slot is keyed one block late: when the
        next block offloaded is its parent and takes a new slot too (the pool evicts a
        request's tail first), it is chained, as that slot's child, in no map. The blocks
        at ``keyless``'s positions are pending runs' (``index/pending.py``): no key, their
        content read from the run's record there, for the blocks looked at alone. A load
        of this step into one of them (a block recorded in this step: never offloaded) is
        dead: it leaves the plan (``unload``)."""
        by_chunk, by_key, cached, sink = self.by_chunk, self.by_key, self._cached, self._sink
        get, empty, pin = by_chunk.get, self._empty, self._pinned.append
        kids = self.kids
        by_parent = kids.by_parent  # (keyed slots under their parents)
        note, noted = by_parent.setdefault, 0
        dropped: list[Orphan] = []  # contents dropped from slots with slots noted under them
        src, dst = self.offload_src, self.offload_dst
        active = sink.active  # (without events no slot ever has one: nothing to clear)
        head: Block | None = None  # the LRU's ends, once an empty slot is lacking
        tail: Block | None = None
        taken = 0  # cached slots unlinked from the head (inlined _take_cached), counted once
        # refreshed slots are unlinked here and appended, in order, at the end (or before
        # a slot must be taken from them): the order that moving each at once would give
        refreshed: list[Block] = []
        late: list[Block] = []  # held slots with slots under them: requeued at the unpin
        above = self._above  # (and above those: the parent content of the last one)
        pend: Block | None = None  # the last new slot, not keyed yet: chained if its parent
        pend_chunk = b""  # comes next; and its key, its token bytes
        s: Block | None
        chaining, chained = self.chaining, 0
        lost = -1  # where contents began to be lost
        now: list[Block] = []  # blocks recorded in this step: a load of the step may write one
        for i, b in enumerate(blocks):
            if b.step >= step:
                now.append(b)
                continue
            key, parent_cid, extra, cid = b.key, b.parent_cid, b.extra, b.content_id
            if key is None and keyless is not None:  # a pending run's block
                parent_cid, key, extra, cid = keyless.content(i)
            s = get(key) if type(key) is bytes else None  # the common case: one probe
            if s is None or s.parent_cid != parent_cid or s.extra != extra:
                if isinstance(key, bytes):
                    chunk = key  # (probed already)
                    s = by_key.get((parent_cid, chunk, extra)) if by_key else None
                else:
                    assert key is not None, f"evicted block {b!r} has no content"
                    chunk = key[1]
                    s = get(chunk)
                    if s is None or s.parent_cid != parent_cid or s.extra != extra:
                        s = by_key.get((parent_cid, chunk, extra)) if by_key else None
                if s is None:  # no slot holds it: take one, state the offload
                    if empty:
                        s = empty.pop()
                    else:  # the least recently used cached slot, its content dropped
                        if head is None:
                            head, tail = cached.ends()
                        s = head.next
                        if s is tail:
                            if not refreshed:  # every slot is pinned: the content is
                                lost = i  # lost, and so is every later block's (no slot can
                                break  # be refreshed or taken any more; a slot pending stays so)
                            cached.forget(len(refreshed))  # only refreshed ones left
                            cached.extend(refreshed)
                            refreshed = []
                            s = head.next
                        nxt = s.next
                        head.next = nxt
                        nxt.prev = head
                        taken += 1
                        old, c = s.key, s.child  # (as _drop, inlined)
                        if s.chained:
                            s.chained = False
                            chained -= 1
                        elif isinstance(old, bytes):
                            del by_chunk[old]
                        else:
                            assert old is not None, f"cached slot {s!r} has no content"
                            del by_key[old]
                        if c.chained and c.parent_cid == s.content_id:
                            c.chained = False
                            chained -= 1
                            self._enter(c)
                        if s.content_id in by_parent:  # (slots may be found through it)
                            dropped.append(self.orphan(s))
                        if active and s.event is not None:
                            sink.append(withdrawn(s.event, s.block_id))
                    if pend is not None:
                        if chaining and pend.parent_cid == cid:
                            s.child = pend  # (the run's head, its last block, is keyed)
                            pend.chained = True
                            chained += 1
                        else:
                            k = pend_chunk  # (as _enter, inlined: its key is its token bytes)
                            if by_chunk.setdefault(k, pend) is not pend:
                                pend.key = triple = (pend.parent_cid, k, pend.extra)
                                by_key[triple] = pend
                            if pend.parent_cid:  # (noted: as _enter)
                                note(pend.parent_cid, []).append(pend)
                                noted += 1
                    pend, pend_chunk = s, chunk
                    s.key, s.parent_cid, s.extra = chunk, parent_cid, extra
                    s.content_id, s.hash = cid, b.hash
                    s.refs = 1
                    pin(s)
                    src.append(b.block_id)
                    dst.append(s.block_id)
                    if active:
                        if b.event is not None:
                            assert b.hash is not None, f"{b!r} was announced without its hash"
                            s.event = b.event.block_of(b.hash, s.block_id, HOST)
                            sink.append(s.event)
                        else:
                            s.event = None
                    continue
            if pend is not None:  # held in a slot already: the run ends
                self._enter(pend)
                pend = None
            if cid == above or cid in by_parent:  # slots under it (the step's new ones,
                late.append(s)  # maybe), or its child is requeued: made more recent than
                above = s.parent_cid  # them once they are unpinned (``_move_last``)
            if not s.refs:  # held in a cached slot, not pinned: refresh
                prev, nxt = s.prev, s.next
                prev.next = nxt
                nxt.prev = prev
                refreshed.append(s)
        if pend is not None:
            self._enter(pend)
        if chained:
            self.num_chained += chained
        if noted:
            kids.noted += noted
        if kids.noted > kids.limit:  # (``grown``, inlined: ``_enter`` notes too)
            kids.sweep(by_chunk, by_key)
        if taken:
            cached.size -= taken  # (``forget``, inlined)
        if refreshed:
            cached.forget(len(refreshed))
            cached.extend(refreshed)
        if late:
            self._requeue += late
            self._above = above
        if lost >= 0 and (self.load_dst or self.lent):  # (past ``lost``, not looked at)
            now += [b for b in blocks[lost:] if b.step >= step]
        if now and self.load_dst:  # (their loads are dead: ``unload``)
            self.unload(now)
        if lost >= 0:  # (every slot is pinned: a slot under a lost content is one of the
            # step's or of the plan in flight; the common case checked here: none is, so
            # nothing is withdrawn, without a lookup of each)
            parents = self._pinned_parents()
            if parents:  # (only the lost contents among them are looked up)
                self._withdraw_orphans(blocks, lost, step, keyless, parents)
        if now and self.lent and by_parent:  # evicted, never computed: a slot may have
            self.left([b for b in now if b.key is not None])  # lent it its id
        if dropped:
            self.cut_off(dropped, blocks)

    def _pinned_parents(self) -> set[int]:
        """The parent content ids of the pinned slots, this step's and the plan in
        flight's (``demote``'s lost path), but 0 (a first block's parent: no content,
        never lost; when the step offloaded first blocks alone, the lost ones are not
        listed). Built once while those lists stay the lists they are, then extended by
        the slots pinned since: an eviction a block a call (events on) that loses each
        block costs the new pins, not every pinned slot, per block (a superset stays
        right: it only picks the lost contents looked up)."""
        pinned, flight, known = self._pinned, self._flight, self._lost_parents
        if known is not None and known[0] is pinned and known[2] is flight \
                and known[1] <= len(pinned):
            parents = known[3]
            parents.update([s.parent_cid for s in pinned[known[1]:]])
        else:
            parents = {s.parent_cid for s in pinned}
            if flight:
                parents.update([s.parent_cid for s in flight])
        parents.discard(0)
        self._lost_parents = (pinned, len(pinned), flight, parents)
        return parents

    def _withdraw_orphans(self, blocks: Sequence[Block], at: int, step: int,
                          keyless: Keyless | None, under: set[int]) -> None:
        """``demote`` lost the contents of ``blocks[at:]`` (every slot pinned; those at
        ``keyless``'s positions pending runs' blocks): withdraw the
        slots the step's offloads fill (pinned, so in no other use) that hold a
        descendant of one, then every other slot under one (``withdraw_under``). The
        pool evicts a request's tail first, so children were offloaded before their
        parent; kept, they would stay announced and never be found, even once their
        parent's content is computed again (a new content id). ``under``: the contents
        that a pinned slot (this step's, or the plan in flight's) names as its parent;
        only the lost ones among them are looked up, found by their ids (a pending run's
        blocks are not walked: ``Keyless.among``)."""
        src, dst = self.offload_src, self.offload_dst
        found = (keyless.among(blocks, at, under) if keyless is not None
                 else keyed_among(blocks, at, len(blocks), under))
        gone = {content[3] for i, content in found
                if blocks[i].step < step and self.find(*content[:3]) is None}
        if not gone:
            return
        dropped = set()
        for i in range(len(dst) - 1, -1, -1):  # parents first: their offloads came last
            s = self.slots[dst[i]]
            if s.parent_cid in gone:
                gone.add(s.content_id)
                dropped.add(i)
                self._drop(s)  # (announced gone: its BlockStored went out in this batch)
                s.refs = 0
                self._empty.append(s)
        if dropped:
            kept = [i for i in range(len(dst)) if i not in dropped]
            self.offload_src, self.offload_dst = [src[i] for i in kept], [dst[i] for i in kept]
            out = {self.slots[dst[i]] for i in dropped}  # (the others stay pinned: a slot
            self._pinned = list(filterfalse(out.__contains__, self._pinned))  # emptied too)
            # (a request loading one would hold its lost ancestor's content on the device)
            assert not {s.block_id for s in out}.intersection(self.load_src), \
                "a slot withdrawn with its lost ancestor is loaded in this step"
        self.withdraw_under(gone)
