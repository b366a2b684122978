"""The publisher thread's mirror of what a replica holds, and the snapshot that restates it.

``HeldMirror`` follows every batch the thread takes, in publishing order: per (medium,
layer group), the digests stored and not removed since the last ``AllBlocksCleared``. A
hybrid manager announces one hash once per group that caches it and withdraws it per
group, so a hash is kept per group. ``snapshot_events`` states such a copy as vLLM's own
snapshots look: ``AllBlocksCleared``, then one ``BlockStored`` per medium and group
holding every held hash (parent nil, no tokens, the group's fields).
"""

from __future__ import annotations

from typing import Any

from ..event_log import PendingEvents
from ..events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from .wire import group_fields, group_of, wire_hash

Held = dict[tuple[str, tuple[int, str, int | None]], set[bytes]]
"""(medium, group) -> digests held."""


class HeldMirror:
    """The digests a replica holds, per medium and group, as the batches followed say.
    One thread follows (the publisher's); ``sorted_copy`` is what a snapshot states."""

    def __init__(self) -> None:
        self.held: Held = {}

    def follow(self, item: list[Event] | PendingEvents) -> list[Event]:
        """Follow ``item`` (built now if pending) in the mirror; returns its events."""
        events = item.build() if isinstance(item, PendingEvents) else item
        held = self.held
        for ev in events:
            if isinstance(ev, BlockStored):
                held.setdefault((ev.medium, group_of(ev)), set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.get((ev.medium, group_of(ev)), set()).difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
        return events

    def sorted_copy(self) -> dict[tuple[str, tuple[int, str, int | None]], list[bytes]]:
        """Per (medium, group) holding any, its digests in sorted order."""
        return {m: sorted(s) for m, s in self.held.items() if s}


def snapshot_events(held: dict[tuple[str, tuple[int, str, int | None]], list[bytes]],
                    block_size: int, hash_format: str) -> list[dict[str, Any]]:
    """The wire events of a snapshot of ``held`` (``HeldMirror.sorted_copy``):
    ``AllBlocksCleared``, then one ``BlockStored`` per medium and group."""
    events: list[dict[str, Any]] = [{"type": "AllBlocksCleared"}]
    for (medium, group), digests in held.items():
        events.append({
            "type": "BlockStored",
            "block_hashes": [wire_hash(d, hash_format) for d in digests],
            "parent_block_hash": None, "token_ids": [], "block_size": block_size,
            "lora_id": None, "medium": medium, "lora_name": None, **group_fields(group),
        })
    return events
