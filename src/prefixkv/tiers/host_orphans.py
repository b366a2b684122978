"""Host slots cut off from their parent's content: a slot with a parent is found only
after a block or a slot holding that parent's content (a walk reaches it through its
parent), so once that content leaves every tier the slots under it, and theirs, are
reached by no lookup, and their ``BlockStored`` would stand (a router counts hits that
are not there). ``SlotOrphans`` withdraws them (``BlockRemoved``, medium CPU; a cached
slot goes empty, a pinned one at its unpin) where a content leaves its last tier:

- a slot's content is dropped for reuse (``demote``'s offload, a store fetch's
  ``reserve``) while no device block holds it (the slot was the last copy);
- ``demote`` loses an evicted content (every slot pinned), or evicts one recorded in
  this step (never computed, so never offloaded) that no slot holds.

The device forgetting a content (``uncache``) takes the slots under it through
``forget_under``, in the device index's own rounds.

Whether the device holds a slot's content: the block it last went up to (a load, or a
recompute under the slot's content id: ``up``, a guess), verified: it holds that content
id (its key set, or a pending run's that spans the id), and is not one the caller is
evicting right now; else the block the device's maps key for that content (``device``,
the index's ``ContentIndex.keyed``), with that id, not being evicted. The guess alone
goes stale once a held spare takes the content over from the block it names (the block
evicted, its spare keyed in its place): the maps find the spare. A chained device block
has no spare, so the guess finds it while it holds the content. So the slots under a
content go only when it left every tier: cache kept, and a kept orphan cannot happen
(a block holding the id holds the content).
The slots under a content are found through
its notes (``SlotKids``); only contents with notes are looked at, so an eviction whose
taken slots have none under them costs one dict probe each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.block import Block, Key, key_chunk
from .host_index import SlotIndex
from .host_kids import keyed_under

Orphan = tuple[int, int, Key, bytes, Block | None]
"""A content dropped from a slot that slots may be noted under: its content id, its
parent's, its key (token bytes, or its triple), its extra bytes, and the device block it
last went up to (None: none known)."""


def no_device(parent_cid: int, chunk: bytes, extra: bytes) -> None:
    """``SlotOrphans.device`` of a tier under no device index: no block is keyed."""
    return None


def held_by(d: Block, cid: int) -> bool:
    """Whether device block ``d`` holds content ``cid`` (its key set, or in the record of
    a pending run it is one of)."""
    if d.key is not None:
        return d.content_id == cid
    r = d.counted
    return r is not None and r.pending and r.cid0 <= cid < r.cid0 + len(r.blocks)


class SlotOrphans(SlotIndex):
    """The withdrawal of slots whose parent's content left every tier (see the module);
    ``up``: slot id -> the device block its content last went up to."""

    up: dict[int, Block]
    device: Callable[[int, bytes, bytes], Block | None]  # the device's keyed block, if any

    def orphan(self, s: Block, key: Key | None = None) -> Orphan:
        """The record of cached slot ``s``'s content, about to be dropped (or dropped:
        then ``key`` is the key it had), for ``cut_off``."""
        k = s.key if key is None else key
        assert k is not None, f"slot {s!r} has no content to record"
        return (s.content_id, s.parent_cid, k, s.extra, self.up.get(s.block_id))

    def cut_off(self, dropped: Sequence[Orphan], leaving: Sequence[Block] = ()) -> None:
        """Withdraw the slots under each of the contents ``dropped`` from slots (see
        ``orphan``) that neither a slot (taken again by the same eviction) nor the
        device holds now, and theirs. ``leaving``: the device blocks being evicted (their
        contents are leaving the device, though still keyed there)."""
        by_parent, by_chunk, by_key = self.kids.by_parent, self.by_chunk, self.by_key
        gone = set()
        apart: set[int] | None = None
        for cid, pcid, key, extra, d in dropped:
            notes = by_parent.get(cid)
            if notes is None or not any(keyed_under(s, cid, by_chunk, by_key) for s in notes):
                continue  # (nothing found under it: stale notes)
            chunk = key_chunk(key)
            if self.find(pcid, chunk, extra) is not None:
                continue  # kept in a slot again
            if d is None or not held_by(d, cid):  # (where it went up, else where the maps
                d = self.device(pcid, chunk, extra)  # key it: a spare took it over)
                if d is not None and d.content_id != cid:
                    d = None
            if d is not None:  # on the device, unless evicted now
                if apart is None:
                    apart = {id(b) for b in leaving}
                if id(d) not in apart:
                    continue
            gone.add(cid)
        if gone:
            self.withdraw_under(gone)

    def left(self, blocks: Sequence[Block]) -> None:
        """Device ``blocks`` (with content) are evicted and no slot took their contents
        (lost, or recorded in this step): withdraw the slots under those no slot holds,
        and theirs. One C pass over the contents with notes, unless none of ``blocks``'
        has any."""
        by_parent = self.kids.by_parent
        cids = by_parent.keys() & {b.content_id for b in blocks}
        if cids:
            gone = {b.content_id for b in blocks if b.content_id in cids
                    and self.find(b.parent_cid, key_chunk(b.key), b.extra) is None}
            if gone:
                self.withdraw_under(gone)

    def withdraw_under(self, gone: set[int]) -> None:
        """Drop, announced gone, every slot keyed under one of the contents ``gone`` (held
        by no tier now), then those under theirs, and so on (``forget_under``'s rounds:
        a chained child of a slot dropped is keyed under its content, for the next)."""
        while gone:
            gone = {s.content_id for s in self.forget_under(gone)}
