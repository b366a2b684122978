"""How store fetches land in the host tier (``HostTier`` is a ``SlotLanding``): slots
reserved for a fetch to write into, filled by a fetcher's thread, keyed when the
scheduler lands the run, or given back empty.

    free slot --reserve--> landing --fill_landing (fetcher)--> filled --land--> pinned
                                   |                                  \\--transit--> in transit
                                   \\--unreserve (nothing came)--> empty     (empty once
                                                                            unpinned)

A slot in transit holds the payload of a run that landed in device blocks until the
loads out of it ran: keyless, in no map, in a list the tier takes nothing from.

A landing slot is in no map and in no list of the tier (``num_landing`` counts them),
with a count of 0: nothing takes it all the same. Nothing finds it either: no probe (it
is in no map), and no guess through a stale ``child`` link, which compares the key and the
parent's content id: the run's first slot has no key until it lands, and every other
slot's parent id is one of the ids the fetch was given at its start, which nothing
findable holds before that first slot lands.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from operator import attrgetter

from ..core.block import Block, Key
from ..core.free_queue import FreeBlockQueue
from ..events import BlockStored
from .host_index import HOST
from .host_orphans import SlotOrphans

_CID = attrgetter("content_id")


def fill_landing(slots: Sequence[Block], parent_cid: int, extras: Sequence[bytes],
                 cids: Sequence[int], hashes: Sequence[bytes],
                 chunks: Sequence[bytes] | None = None) -> None:
    """Write the content fields of landing ``slots`` for ``land``: slot i's parent (slot
    i - 1's content, or ``parent_cid``), ``extras[i]``, ``cids[i]``, ``hashes[i]``, no
    event, each slot its predecessor's ``child`` and, given ``chunks``, the key of every
    slot but the first: ``chunks[i]``, written after its parent id. May run on a fetcher's
    thread while the scheduler's runs: a landing slot is in no map, the first one has no
    key, and each other one's parent id (written before its key) is one of ``cids``,
    fresh ids that nothing findable holds until the first slot lands, so every find and
    every guess (which compares the key and the parent id) passes them by, and nothing
    else writes them until they land."""
    prev: Block | None = None
    for s, extra, cid, h in zip(slots, extras, cids, hashes, strict=True):
        s.parent_cid, s.extra, s.content_id, s.hash, s.event = parent_cid, extra, cid, h, None
        if prev is not None:
            prev.child = s
        parent_cid, prev = cid, s
    if chunks is not None:  # (after every parent id: see above)
        for s, chunk in zip(islice(slots, 1, None), islice(chunks, 1, None), strict=True):
            s.key = chunk


class SlotLanding(SlotOrphans):
    """``HostTier``'s calls for store fetches (its ``_empty`` stack, ``_cached`` LRU,
    ``_pinned`` list and ``num_landing`` count, besides ``SlotIndex``'s maps)."""

    _empty: list[Block]
    _cached: FreeBlockQueue
    _pinned: list[Block]
    num_landing: int
    _transit: list[Block]  # slots in transit (``transit``): pinned, keyless, empty once unpinned
    # the runs landed in this step with the fetcher's list of their slot ids (pinned
    # since: only ``end_step`` unpins a landed slot), for ``hold`` and ``load``
    _landed: list[tuple[list[Block], list[int]]]

    def reserve(self, n: int) -> list[Block]:
        """Up to ``n`` free slots for a store fetch to write into (empty ones first, then
        the least recently used cached ones, their content dropped): each is *landing*
        (no content, in no map, in no list of the tier, so nothing takes it across steps;
        named by no op) until ``land``, ``transit`` or ``unreserve``. Its count stays 0
        (no loop writes one per slot). Pinned slots are never taken, so fewer may be
        returned."""
        empty = self._empty
        k = len(empty)
        if n < k:  # (not ``min``: its keyword parsing is cold machine code, store25-r23.md)
            k = n
        if k == len(empty):  # every empty slot (a fetch as large as the last one): the
            out = empty  # list itself, reversed in place (no copy, no count touched)
            out.reverse()  # (the order ``_take`` would give)
            self._empty = []
        else:
            out = empty[:len(empty) - k - 1:-1]
            del empty[len(empty) - k:]
        if len(out) < n and self._cached.size:
            k = len(out)
            if not self.num_chained and not self._sink.active and not self.by_key:
                keys = self._take_plain(out, n - k)
            else:
                keys = self._take_lru(out, n - k)
            by_parent = self.kids.by_parent  # (their contents left the tier: in C, whether
            if not by_parent.keys().isdisjoint(map(_CID, islice(out, k, None))):  # any has
                self.cut_off([self.orphan(s, key)  # notes under it)
                              for s, key in zip(islice(out, k, None), keys, strict=True)
                              if s.content_id in by_parent])
        self.num_landing += len(out)
        return out

    def land(self, slots: list[Block], parent_cid: int, chunks: Sequence[bytes],
             extras: Sequence[bytes], cids: Sequence[int], hashes: Sequence[bytes],
             event: BlockStored | None, *, filled: bool = False, unique: bool = False,
             keyed: dict[bytes, Block] | None = None, ids: list[int] | None = None) -> None:
        """Landing ``slots`` hold a checked run now: slot i the content (parent: slot
        i - 1's, or ``parent_cid`` for the first; ``chunks[i]``, ``extras[i]``), content id
        ``cids[i]``, chain hash ``hashes[i]``, announced by ``event`` (the run in these
        slots; None: no events), each keyed (not chained: the admission that loads them would
        key them as they go up, which costs more than keying them now) and each its
        predecessor's ``child`` (the walk's guess). All are pinned until the plan is
        drained (a ``StoreFetched`` writing them may be pending, which no offload of the
        same plan may precede), then unpinned leaves first (the LRU takes the run's last
        slot first, as the device evicts a request's tail first). The caller made sure
        no slot holds the first content already (the others' parents are new).
        ``filled``: ``fill_landing`` wrote these slots' fields already (on a fetcher's
        thread), from a parent that may have been another, with ``chunks`` (keys): only
        the first slot's parent and key are set here (``extras``, ``cids`` and
        ``hashes`` are not read). ``unique``: no two of ``chunks`` are equal (then, when
        no slot's key is one of them either, the slots enter the map in one C call).
        ``keyed``: ``dict(zip(chunks, slots))``, built where it cost the scheduler
        nothing (a fetcher's thread), given only when ``unique``: the dicts' stored
        hashes serve the check and the keying (no token bytes is hashed or read again,
        and the check probes the smaller of the two maps); it may become the tier's map
        (the other merged into it, when it is the larger): the caller makes no other use
        of it. ``ids``: the slots' ids, listed where it cost the scheduler nothing: an
        admission that loads exactly these slots in this step neither pins them again
        nor lists their ids (``hold``, ``load``)."""
        if filled:
            slots[0].parent_cid = parent_cid
        else:
            fill_landing(slots, parent_cid, extras, cids, hashes)
        by_chunk = self.by_chunk
        self.num_landing -= len(slots)
        if unique and keyed is None:
            keyed = dict(zip(chunks, slots, strict=True))
        if keyed is not None and by_chunk.keys().isdisjoint(keyed.keys()):
            if filled:  # (the others' keys were written with their fields)
                slots[0].key = chunks[0]
            else:
                for s, chunk in zip(slots, chunks, strict=True):
                    s.key = chunk
            # (each setdefault below would succeed) the smaller map merged into the larger,
            # in C: no entry of the larger is inserted again (each, cold objects touched)
            if len(keyed) > len(by_chunk):
                keyed.update(by_chunk)
                self.by_chunk = keyed
            else:
                by_chunk.update(keyed)
        else:
            by_key = self.by_key
            for s, chunk in zip(slots, chunks, strict=True):  # (as _enter, inlined)
                if by_chunk.setdefault(chunk, s) is s:
                    s.key = chunk
                else:
                    s.key = key = (s.parent_cid, chunk, s.extra)
                    by_key[key] = s
        self.kids.note_run(slots, self.by_chunk, self.by_key)  # (each under its parent)
        for s in slots:  # pinned from now on (a landing slot's count is 0)
            s.refs = 1
        self._pinned += reversed(slots)  # (leaves first, as ``hold``'s: a parent taken
        # first would cut the slots after it off: tests/store/test_landing_gaps.py)
        if ids is not None:
            self._landed.append((slots, ids))
        if event is not None:
            self._sink.append(event)
            for i, s in enumerate(slots):  # (each slot's own, for its removal and copies)
                s.event = event.block(i, s.block_id, HOST)

    def transit(self, slots: list[Block]) -> None:
        """Landing ``slots`` hold a checked run that lands in device blocks (the store
        fetch's): they only hold its payload until the loads out of them ran, in no map
        (no key), and go empty once the plan is drained (``end_step``), or once its
        copies are done (``copies_done``). Nothing finds them: the host tier does not keep
        content the device holds that it would otherwise unkey at the next reservation."""
        self.num_landing -= len(slots)
        # (their counts stay 0: in this list, nothing takes them; the first run's list
        # itself, not a copy: each entry copied touches a cold slot. Never changed in
        # place: the caller's list may be it)
        self._transit = self._transit + slots if self._transit else slots

    def _take_lru(self, out: list[Block], n: int) -> list[Key]:
        """Append to ``out`` up to ``n`` least recently used cached slots, their content
        dropped (as ``_take_cached`` n times; the common case in one
        loop of its own: ``_take_plain``, which ``reserve`` calls then). Returns the keys
        they had (for ``orphan``)."""
        head, tail = self._cached.ends()
        s = head.next  # (a slot until ``tail``)
        keys: list[Key] = []
        taken = 0
        while taken < n and s is not tail:
            keys.append(s.key)  # type: ignore[arg-type]  # (cached: it has content)
            self._drop(s)  # (links untouched: the run is unlinked at once below)
            out.append(s)
            taken += 1
            s = s.next
        head.next = s
        s.prev = head
        self._cached.forget(taken)
        return keys

    def _take_plain(self, out: list[Block], n: int) -> list[Key]:
        """``_take_lru`` in the common case, when no slot is chained (so no slot's child
        is), none is keyed by its triple (each is ``by_chunk``'s entry for its key) and
        no removal is announced: each slot only leaves ``by_chunk``, in one loop. Returns
        the keys they had (for ``orphan``)."""
        cached, by_chunk = self._cached, self.by_chunk
        k = min(n, cached.size)
        head, _ = cached.ends()
        s = head.next  # (a slot: ``k`` of them are linked)
        taken = [s] * k  # (each entry set below: a store, no call, per slot)
        keys: list[Key] = [b""] * k
        for i in range(k):
            keys[i] = key = s.key  # type: ignore[assignment]  # (KeyError below: none)
            del by_chunk[key]  # type: ignore[arg-type]
            s.key = None
            taken[i] = s
            s = s.next
        head.next, s.prev = s, head
        cached.forget(k)
        out += taken
        return keys

    def unreserve(self, slots: list[Block]) -> None:
        """Landing ``slots`` that got nothing (or were filled, keys too, and not landed):
        empty again."""
        self.num_landing -= len(slots)
        for s in slots:
            s.key = None
        self._empty += slots
