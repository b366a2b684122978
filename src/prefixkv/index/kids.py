"""The keyed children of each content, for ``uncache``'s walk of a forgotten content's
descendants (``SpareIndex._forget_below``): without them the walk would pass over every
keyed content to find the few recorded under one (chained children are found through
``Block.child`` already).

``Kids`` maps a parent content id to the index keys (token bytes, or a content triple)
under which a content recorded under it was keyed in the device index's dicts. A key is
noted when its block is keyed (``ContentChains._key``, the one place a dict entry is
made; a spare taking a primary's place keeps the key) and never removed when its entry
goes: eviction, the hot path, writes nothing here. So a noted key may be stale (its entry
gone, or holding another parent's content); a reader checks each against the dicts.
Stale keys are swept out once the keys noted reach twice those live at the last sweep
(at least ``FLOOR``): a sweep costs the keys it passes, paid for by the notes that came
before it. A first block's parent, 0, is never forgotten: its children are not noted, so
a new first content (every new prompt's) notes nothing.

The rule ``check`` verifies: every keyed content with a parent is noted under its parent.
"""

from __future__ import annotations

from ..core.block import Block, ContentKey, Key

FLOOR = 1024
"""Keys noted before the first sweep (and the least allowance after one)."""


class Kids:
    """Keys of keyed contents by their parent's content id (see the module)."""

    __slots__ = ("by_parent", "noted", "limit")

    def __init__(self) -> None:
        self.by_parent: dict[int, list[Key]] = {}
        self.noted = 0  # keys in ``by_parent`` (stale ones and repeats included)
        self.limit = FLOOR  # ``noted`` past this: sweep

    def note(self, cid: int, key: Key, by_chunk: dict[bytes, Block],
             by_key: dict[ContentKey, Block]) -> None:
        """A content recorded under content ``cid`` (not 0) was keyed under ``key``."""
        keys = self.by_parent.get(cid)
        if keys is None:
            self.by_parent[cid] = [key]
        else:
            keys.append(key)
        self.noted += 1
        if self.noted > self.limit:
            self.sweep(by_chunk, by_key)

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
        n = 0
        for cid, keys in self.by_parent.items():
            live = [k for k in dict.fromkeys(keys)
                    if (e := _entry(k, by_chunk, by_key)) is not None and e.parent_cid == cid]
            if live:
                kept[cid] = live
                n += len(live)
        self.by_parent.clear()
        self.by_parent.update(kept)
        self.noted = n
        self.limit = max(FLOOR, 2 * n)

    def clear(self) -> None:
        """The index was emptied."""
        self.by_parent.clear()
        self.noted = 0
        self.limit = FLOOR

    def check(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> str | None:
        """The first keyed content with a parent not noted under it; a wrong count."""
        if self.noted != sum(map(len, self.by_parent.values())):
            return f"{self.noted} child keys counted, {sum(map(len, self.by_parent.values()))} held"
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
