"""The host tier's index of its slots (``HostTier`` is one): a slot is found by its
content (parent content id, token bytes, extra bytes), keyed by its token bytes and
verified against the parent id and extra bytes (a content whose token bytes another
slot's content has is keyed by the whole triple), or *chained*: found only as the
``child`` of the slot holding its parent's content, in no map (as the device index's
chained blocks). A run of slots offloaded together, children first, keys only its head.
The rule that keeps ``find`` (a probe of the maps) exact where it is used: every slot
whose parent's content is on the device is keyed (``on_device``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from ..core.block import NO_CHILD, Block, ContentKey
from ..core.free_queue import FreeBlockQueue
from ..event_log import EventSink
from ..events import BlockRemoved, BlockStored
from .host_kids import SlotKids

HOST = "CPU"
"""The medium of host slots in events (vLLM's spelling)."""


def withdrawn(announced: BlockStored, slot_id: int) -> BlockRemoved:
    """The ``BlockRemoved`` of host slot ``slot_id``'s content, which ``announced`` (the
    slot's own one-block event) stored: the hash it names is the one a consumer mirrors,
    whatever the slot's other fields hold."""
    return BlockRemoved(announced.block_hashes, (slot_id,), HOST)


@dataclass(slots=True, eq=False, repr=False)  # (its own ``__init__``: a wrong argument's
class HostSlot(Block):  # error names this class; Block's fields, eq and repr)
    """A host slot: a Block whose ``block_id`` is the slot index and whose ``ref_cnt``
    is 1 while the slot is pinned (a copy stated for it is pending), else 0 (a slot a
    store fetch writes into, or in transit, is in no list the tier takes from: its count
    is 0, and nothing takes it). A slot is never one of a ``Run``'s (``counted`` stays
    None): the tier reads and writes its own count, ``refs``, with no property call.
    ``key``: the token bytes, or the content triple when another slot's content is keyed
    by those bytes (as in the device index). A slot with
    content is cached (in the LRU, ``ref_cnt`` 0) or pinned (``ref_cnt`` > 0).
    ``chained``: found only as the ``child`` of the slot holding its parent's content
    (offloaded with it in one batch), in no map; its key is its token bytes."""


class SlotIndex:
    """The maps and chains of ``HostTier``'s slots (its ``slots``, ``by_chunk``,
    ``by_key``, ``kids``, ``num_chained``, ``chaining`` and ``_sink``)."""

    # A slot is typed as the Block it is (``HostSlot`` only marks it apart from a device
    # block, for ``type(hit) is HostSlot`` in admission).
    slots: list[Block]
    by_chunk: dict[bytes, Block]
    by_key: dict[ContentKey, Block]
    kids: SlotKids
    up: dict[int, Block]  # slot id -> the device block its content last went up to
    lent: bool  # a recompute took a slot's content id in this step (``on_device``)
    num_chained: int
    chaining: bool
    num_emptied: int
    _sink: EventSink
    _empty: list[Block]
    _cached: FreeBlockQueue

    def __len__(self) -> int:
        return len(self.by_chunk) + len(self.by_key) + self.num_chained

    def find(self, parent_cid: int, chunk: bytes, extra: bytes) -> Block | None:
        """The slot holding this content, if any, when its parent's content is on the
        device or in no slot (a chained slot is found through its parent slot only: see
        ``on_device``). Changes nothing."""
        s = self.by_chunk.get(chunk)
        if s is not None and s.parent_cid == parent_cid and s.extra == extra:
            return s
        return self.by_key.get((parent_cid, chunk, extra)) if self.by_key else None

    def walk(self, hits: list[Block], chunks: Sequence[bytes], cid: int, extra: bytes,
             device: Callable[[bytes], Block | None] | None, prev: Block) -> list[Block]:
        """``ContentIndex.match`` past the device's first miss, when no content is keyed
        by its triple on either side and every block's extra bytes are ``extra``: append
        to ``hits`` (ending in ``prev``, content ``cid``) the blocks of
        ``chunks[len(hits):]`` found on the device (a device block's chained child, else
        ``device``: its map's ``get``) or else in a slot, until both miss; ``device`` None:
        the device holds no child of a content it lacks, so past its first miss only slots
        can go on. A slot's ``child`` is tried before a probe (a chained slot is found
        only so). Returns ``hits``."""
        s: Block | None
        if device is None:
            get, g = self.by_chunk.get, NO_CHILD  # (a device block's child is no slot)
            for chunk in islice(chunks, len(hits), None):  # (no copy: the walk stops early)
                s = g
                if s.key != chunk or s.parent_cid != cid or s.extra != extra:
                    s = get(chunk)
                    if s is None or s.parent_cid != cid or s.extra != extra:
                        break
                hits.append(s)
                cid = s.content_id
                g = s.child
            return hits
        rest = chunks[len(hits):]
        none = NO_CHILD
        g = prev.child  # the guess: the previous hit's chained child (a device block's
        for chunk, c, s in zip(rest, map(device, rest), map(self.by_chunk.get, rest), strict=True):
            if c is None or c.parent_cid != cid or c.extra != extra:  # or a slot's)
                if g is not none and g.parent_cid == cid and g.key == chunk and \
                        g.extra == extra and not g.twin:
                    c = g
                elif s is None or s.parent_cid != cid or s.extra != extra:
                    break
                else:
                    hits.append(s)
                    cid = s.content_id
                    g = s.child
                    continue
            hits.append(c)
            cid = c.content_id
            g = c.child
        return hits

    def on_device(self, s: Block, device: Block | None = None) -> None:
        """Slot ``s``'s content is on the device now (loaded, or recomputed under the
        slot's id, in block ``device`` when given: remembered, ``up``): key it and its
        chained child, so that ``find`` (which probes only the maps) finds every slot
        whose parent's content is on the device."""
        if device is not None:  # (a block recorded in this step: evicted in it, it is
            self.up[s.block_id] = device  # never offloaded, ``demote`` looks at it: ``lent``)
            self.lent = True
        if s.chained:
            s.chained = False
            self.num_chained -= 1
            self._enter(s)
        self._key_child(s)

    def stop_chaining(self) -> None:
        """Key every chained slot and chain no more (the device holds a block cut off
        from its parent's content, see ``ContentIndex.cut``: content may then come up to
        the device under a parent whose slot was never loaded)."""
        self.chaining = False
        if not self.num_chained:  # (none chained: no pass over the slots, each cut)
            return
        for s in self.slots:
            if s.chained:
                s.chained = False
                self._enter(s)
        self.num_chained = 0
        self.kids.grown(self.by_chunk, self.by_key)

    def forget_under(self, lost: set[int]) -> list[Block]:
        """Drop, announced gone, every slot holding a content recorded under one of the
        content ids ``lost`` (contents no tier holds any more, e.g. the device forgot them:
        ``ContentIndex.uncache``), and the slots chained below each (found only through
        it); a slot keyed under a dropped one is left for the caller's next call with the
        dropped slots' ids. A cached slot goes empty; a pinned one keeps its pin,
        with no content, and goes empty when unpinned (``num_emptied`` counts those).
        Returns the slots dropped. A slot under a content the device held is keyed, so
        noted under it (``kids``): the cost is the slots dropped, and a C pass over the
        smaller of ``lost`` and the contents with notes."""
        out: list[Block] = []
        for s in self.kids.take(lost, self.by_chunk, self.by_key):
            chain = [s]  # s and the slots chained below it, dropped deepest first (so no
            c = s.child  # child is keyed on the way, nor noted)
            while c.chained and c.parent_cid == chain[-1].content_id:
                chain.append(c)
                c = c.child
            for x in reversed(chain):
                self._drop(x)
                if x.ref_cnt:
                    self.num_emptied += 1
                else:
                    self._cached.remove(x)
                    self._empty.append(x)
            out += chain
        return out

    def _unpinned(self, slots: list[Block]) -> list[Block]:
        """Of ``slots``, just unpinned, those with content (for the LRU); the rest,
        dropped while pinned (``forget_under``), go empty."""
        if not self.num_emptied:
            return slots
        kept = []
        for s in slots:
            if s.key is None:
                self._empty.append(s)
                self.num_emptied -= 1
            else:
                kept.append(s)
        return kept

    def _enter(self, s: Block) -> None:
        """Key slot ``s`` (its key: its token bytes) in the maps: by those bytes, or by
        its triple when they are another slot's key."""
        chunk = s.key
        assert isinstance(chunk, bytes), f"slot {s!r} is keyed already"
        if self.by_chunk.setdefault(chunk, s) is not s:
            s.key = key = (s.parent_cid, chunk, s.extra)
            self.by_key[key] = s
        if s.parent_cid:  # (noted under its parent; the callers check the sweep: ``grown``)
            kids = self.kids
            kids.by_parent.setdefault(s.parent_cid, []).append(s)
            kids.noted += 1

    def _key_child(self, s: Block) -> None:
        """Key ``s``'s chained child, if it has one (it is about to be found by a probe)."""
        c = s.child
        if c.chained and c.parent_cid == s.content_id and c.key is not None:
            c.chained = False
            self.num_chained -= 1
            self._enter(c)

    def _drop(self, s: Block) -> None:
        """Drop slot ``s``'s content (taken for reuse), announced gone: unkey it, or
        unchain it; key its chained child."""
        if s.chained:
            s.chained = False
            self.num_chained -= 1
        else:
            key = s.key
            if isinstance(key, bytes):
                del self.by_chunk[key]
            else:
                assert key is not None, f"slot {s!r} holds no content to drop"
                del self.by_key[key]
        self._key_child(s)
        if self._sink.active and s.event is not None:
            self._sink.append(withdrawn(s.event, s.block_id))
        s.key = None
