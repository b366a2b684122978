"""The keyed host slots of each parent content, for ``SlotIndex.forget_under`` (the device
forgot some contents: the slots recorded under them go): without them it would pass over
every slot in the maps to find the few under a forgotten content.

``SlotKids`` maps a parent content id to the slots keyed while recorded under it. A slot
is noted when it enters the maps (``SlotIndex._enter``, the offload's inlined keying,
the landing's ``note_run``; each a ``setdefault`` and an append, the sweep's check
once a batch: ``grown``) and never unnoted when its content goes (an eviction, the hot path,
writes nothing here). So a note may be stale: the slot since dropped, or holding another
content; a reader checks each against the maps (``keyed_under``). Once the notes reach
twice those live at the last sweep (at least ``FLOOR``), a sweep notes the maps' slots
anew: it costs the maps, paid for by the notes that came before it. A first block's
parent, 0, is never forgotten: slots under it are not noted.

The rule ``check`` verifies: every keyed slot with a parent is noted under its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

from ..core.block import Block, ContentKey

FLOOR = 1024
"""Notes before the first sweep (and the least allowance after one)."""

_CID = attrgetter("content_id")


def keyed_under(s: Block, cid: int, by_chunk: dict[bytes, Block],
                by_key: dict[ContentKey, Block]) -> bool:
    """Whether slot ``s`` is its key's entry in the maps, recorded under content ``cid``."""
    key = s.key
    if s.parent_cid != cid or key is None:
        return False
    return (by_chunk.get(key) if type(key) is bytes else by_key.get(key)) is s  # type: ignore[arg-type]


class SlotKids:
    """Keyed slots by their parent's content id (see the module)."""

    __slots__ = ("by_parent", "noted", "limit")

    def __init__(self) -> None:
        self.by_parent: dict[int, list[Block]] = {}
        self.noted = 0  # slots in ``by_parent`` (stale ones and repeats included)
        self.limit = FLOOR  # ``noted`` past this: sweep

    def grown(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        """Sweep when the notes outgrew the allowance: called after the callers' notes
        (``by_parent.setdefault(cid, []).append(slot)`` and ``noted`` counted, inlined),
        once a batch."""
        if self.noted > self.limit:
            self.sweep(by_chunk, by_key)

    def note_run(self, slots: Sequence[Block], by_chunk: dict[bytes, Block],
                 by_key: dict[ContentKey, Block]) -> None:
        """``slots``, a run just keyed: slot i recorded under slot i - 1's content (new
        ids, noted under no one yet), the first under its ``parent_cid``. In C past the
        first: one list per content id, no bytecode per slot."""
        first = slots[0]
        if first.parent_cid:
            kids = self.by_parent.get(first.parent_cid)
            if kids is None:
                self.by_parent[first.parent_cid] = [first]
            else:
                kids.append(first)
            self.noted += 1
        self.by_parent.update(zip(map(_CID, slots[:-1]), map(list, zip(slots[1:])), strict=True))
        self.noted += len(slots) - 1
        self.grown(by_chunk, by_key)

    def take(self, lost: set[int], by_chunk: dict[bytes, Block],
             by_key: dict[ContentKey, Block]) -> list[Block]:
        """The slots keyed under one of ``lost``'s contents, each once, their notes
        dropped (the caller drops them: nothing is recorded under a lost content again)."""
        by_parent = self.by_parent
        out: list[Block] = []
        for cid in by_parent.keys() & lost:  # (C: passes the smaller of the two)
            kids = by_parent.pop(cid)
            self.noted -= len(kids)
            out += [s for s in dict.fromkeys(kids) if keyed_under(s, cid, by_chunk, by_key)]
        return out

    def sweep(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        """Note anew every keyed slot under its parent, from the maps (stale and repeated
        notes gone). The maps grew by a note at most per slot keyed since the last sweep,
        and they were at most half the notes then: the pass is paid for by the notes."""
        by_parent = self.by_parent
        by_parent.clear()  # (in place: a caller may hold ``by_parent`` across it)
        for s in chain(by_chunk.values(), by_key.values()):
            if s.parent_cid:
                by_parent.setdefault(s.parent_cid, []).append(s)
        self.noted = n = sum(map(len, by_parent.values()))
        self.limit = max(FLOOR, 2 * n)

    def clear(self) -> None:
        """The tier was emptied."""
        self.by_parent.clear()
        self.noted = 0
        self.limit = FLOOR

    def check(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> str | None:
        """The first keyed slot with a parent not noted under it; a wrong count."""
        pairs = [(cid, id(s)) for cid, kids in self.by_parent.items() for s in kids]
        if self.noted != len(pairs):
            return f"{self.noted} host slot notes counted, {len(pairs)} held"
        noted = set(pairs)
        missing = [s for s in chain(by_chunk.values(), by_key.values())
                   if s.parent_cid and (s.parent_cid, id(s)) not in noted]
        return f"keyed host slot {missing[0]!r} is not noted under its parent" if missing else None
