"""The keyed children of each content, for ``uncache``'s walk of a forgotten content's
descendants (``SpareIndex._forget_below``): without them the walk would pass over every
keyed content to find the few recorded under one (chained children are found through
``Block.child`` already).

``Kids`` maps a parent content id to the index keys (token bytes, or a content triple)
under which a content recorded under it was keyed in the device index's dicts: notes,
swept once they outgrow the live ones (``ParentNotes``, core/parent_notes.py, states the
allowance). A key is noted when its block is keyed (``ContentChains._key``, the one
place a dict entry is made; a spare taking a primary's place keeps the key) and never
removed when its entry goes: eviction, the hot path, writes nothing here. So a noted key
may be stale (its entry gone, or holding another parent's content); a reader checks each
against the dicts, and a sweep keeps the live keys alone, passing the keys noted. A first
block's parent, 0, is never forgotten: its children are not noted, so a new first content
(every new prompt's) notes nothing.

The rule ``check`` verifies: every keyed content with a parent is noted under its parent.
"""

from __future__ import annotations

from ..core.block import Block, ContentKey, Key
from ..core.parent_notes import ParentNotes


class Kids(ParentNotes[Key]):
    """Keys of keyed contents by their parent's content id (see the module); ``note``
    (``ParentNotes.note``) on each keying under a parent."""

    __slots__ = ()

    def live(self, cid: int, keys: list[Key], by_chunk: dict[bytes, Block],
             by_key: dict[ContentKey, Block]) -> list[Block]:
        """The blocks keyed for contents recorded under ``cid``, which is being forgotten:
        ``keys``, its keys, the caller just popped from ``by_parent`` (it forgets each
        block returned; one may come twice, its key noted twice)."""
        self.noted -= len(keys)
        out = []
        for key in keys:
            e = _entry(key, by_chunk, by_key)
            if e is not None and e.parent_cid == cid:
                out.append(e)
        return out

    def sweep(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        """Drop stale and repeated keys; parents left with none go. In place: a caller may
        hold ``by_parent`` across a call that keys a block."""
        kept: dict[int, list[Key]] = {}
        for cid, keys in self.by_parent.items():
            live = [k for k in dict.fromkeys(keys)
                    if (e := _entry(k, by_chunk, by_key)) is not None and e.parent_cid == cid]
            if live:
                kept[cid] = live
        self.by_parent.clear()
        self.by_parent.update(kept)
        self.swept()

    def check(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> str | None:
        """The first keyed content with a parent not noted under it; a wrong count."""
        if wrong := self.miscounted("child keys"):
            return wrong
        noted = {cid: set(keys) for cid, keys in self.by_parent.items()}
        homes: tuple[dict[bytes, Block] | dict[ContentKey, Block], ...] = (by_chunk, by_key)
        for home in homes:
            for key, b in home.items():
                if b.parent_cid and key not in noted.get(b.parent_cid, ()):
                    return f"keyed block {b!r} is not noted as its parent's child"
        return None


def _entry(key: Key, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> Block | None:
    """The block keyed under ``key`` in the dicts, if any."""
    return by_chunk.get(key) if type(key) is bytes else by_key.get(key)  # type: ignore[arg-type]
