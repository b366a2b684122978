"""The keyed host slots of each parent content, for ``SlotIndex.forget_under`` (the device
forgot some contents: the slots recorded under them go): without them it would pass over
every slot in the maps to find the few under a forgotten content.

``SlotKids`` maps a parent content id to the slots keyed while recorded under it: notes,
swept once they outgrow the live ones (``ParentNotes``, core/parent_notes.py, states the
allowance). A slot is noted when it enters the maps (``SlotIndex._enter``, the offload's
inlined keying, the landing's ``note_run``; each a ``setdefault`` and an append, the
sweep's check once a batch: ``grown``) and never unnoted when its content goes (an
eviction, the hot path, writes nothing here). So a note may be stale: the slot since
dropped, or holding another content; a reader checks each against the maps
(``keyed_under``). A sweep notes the maps' slots anew: it costs the maps, which grew by
a note at most per slot keyed since the last sweep and were at most half the notes then,
so the notes pay for it. A first block's parent, 0, is never forgotten: slots under it
are not noted.

The rule ``check`` verifies: every keyed slot with a parent is noted under its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter

from ..core.block import Block, ContentKey
from ..core.parent_notes import ParentNotes

_CID = attrgetter("content_id")


def keyed_under(s: Block, cid: int, by_chunk: dict[bytes, Block],
                by_key: dict[ContentKey, Block]) -> bool:
    """Whether slot ``s`` is its key's entry in the maps, recorded under content ``cid``."""
    key = s.key
    if s.parent_cid != cid or key is None:
        return False
    return (by_chunk.get(key) if type(key) is bytes else by_key.get(key)) is s  # type: ignore[arg-type]


class SlotKids(ParentNotes[Block]):
    """Keyed slots by their parent's content id (see the module)."""

    __slots__ = ()

    def note_run(self, slots: Sequence[Block], by_chunk: dict[bytes, Block],
                 by_key: dict[ContentKey, Block]) -> None:
        """``slots``, a run just keyed: slot i recorded under slot i - 1's content (new
        ids, noted under no one yet), the first under its ``parent_cid``. In C past the
        first: one list per content id, no bytecode per slot."""
        self.by_parent.update(zip(map(_CID, slots[:-1]), map(list, zip(slots[1:])), strict=True))
        self.noted += len(slots) - 1
        first = slots[0]
        if first.parent_cid:  # (last: a sweep reads the maps, where the run is keyed)
            self.note(first.parent_cid, first, by_chunk, by_key)
        else:
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
        notes gone)."""
        by_parent = self.by_parent
        by_parent.clear()  # (in place: a caller may hold ``by_parent`` across it)
        for s in chain(by_chunk.values(), by_key.values()):
            if s.parent_cid:
                by_parent.setdefault(s.parent_cid, []).append(s)
        self.swept()

    def check(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> str | None:
        """The first keyed slot with a parent not noted under it; a wrong count."""
        if wrong := self.miscounted("host slot notes"):
            return wrong
        noted = {(cid, id(s)) for cid, kids in self.by_parent.items() for s in kids}
        missing = [s for s in chain(by_chunk.values(), by_key.values())
                   if s.parent_cid and (s.parent_cid, id(s)) not in noted]
        return f"keyed host slot {missing[0]!r} is not noted under its parent" if missing else None
