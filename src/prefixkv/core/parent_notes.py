"""Notes of what was keyed under each parent content, swept once they outgrow the live
ones: the frame the device index's ``Kids`` (index/kids.py: keys) and the host tier's
``SlotKids`` (tiers/host_kids.py: slots) share, so that a forgotten content's keyed
children are found without a pass over every keyed entry.

A note is made when an entry is keyed under a parent content (not 0: a first block's
parent is never forgotten) and never removed when the entry goes (eviction, the hot path,
writes nothing here), so a note may be stale; a reader checks each against the maps.
The allowance: once ``noted`` passes ``limit`` the notes are swept (``grown``) down to
the live ones, n, and the next sweep waits until they pass ``max(FLOOR, 2 * n)``
(``swept``): a sweep costs about what it passes, paid for by the notes made since the
last (at least n of them, or ``FLOOR``). What a sweep keeps, and how it reads the maps,
is each subclass's (``sweep``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from .block import Block, ContentKey

FLOOR = 1024
"""Notes allowed before the first sweep (and the least allowance after one)."""

T = TypeVar("T")


class ParentNotes(ABC, Generic[T]):
    """Items (keys or slots) noted by their parent's content id (see the module)."""

    __slots__ = ("by_parent", "noted", "limit")

    def __init__(self) -> None:
        self.by_parent: dict[int, list[T]] = {}
        self.noted = 0  # items in ``by_parent`` (stale ones and repeats included)
        self.limit = FLOOR  # ``noted`` past this: sweep

    def note(self, cid: int, item: T, by_chunk: dict[bytes, Block],
             by_key: dict[ContentKey, Block]) -> None:
        """``item`` was keyed under content ``cid`` (not 0); sweeps past the allowance."""
        items = self.by_parent.get(cid)
        if items is None:
            self.by_parent[cid] = [item]
        else:
            items.append(item)
        self.noted += 1
        if self.noted > self.limit:  # (``grown``, inline: a call fewer per note)
            self.sweep(by_chunk, by_key)

    def grown(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        """Sweep if the notes outgrew the allowance: for callers that note inline
        (``by_parent`` appended to, ``noted`` counted), once a batch."""
        if self.noted > self.limit:
            self.sweep(by_chunk, by_key)

    @abstractmethod
    def sweep(self, by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block]) -> None:
        """Leave in ``by_parent`` the live notes alone, each once (in place: a caller may
        hold ``by_parent`` across a call that keys an entry), then call ``swept``."""

    def swept(self) -> None:
        """A sweep left the live notes: count them, n, and allow up to
        ``max(FLOOR, 2 * n)`` before the next."""
        self.noted = n = sum(map(len, self.by_parent.values()))
        self.limit = max(FLOOR, 2 * n)

    def clear(self) -> None:
        """The maps were emptied."""
        self.by_parent.clear()
        self.noted = 0
        self.limit = FLOOR

    def miscounted(self, what: str) -> str | None:
        """A message if ``noted`` is not the number of notes held (``what``: their name)."""
        held = sum(map(len, self.by_parent.values()))
        return None if self.noted == held else f"{self.noted} {what} counted, {held} held"
