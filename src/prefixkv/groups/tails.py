"""Partial tail entries of a hybrid index (vLLM's ``_cache_partial_tail_block``).

Where a full-attention group's block is larger than the hash block, vLLM announces, for
a prompt whose last hash boundary before its last token falls inside a block of the
group, one more entry for that block: the hash block before the boundary
(``BlockSizes.stored``; groups/sized.py finds it). Such an entry never serves a hit
(hits look at whole blocks); it is announced once, while the block is its group's
primary holder of its own prefix, and withdrawn after the block's own entry, when the
block loses it (``GroupIndex._unindex``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import Block
from ..event_log import EventSink
from .events import GroupBlockRemoved, GroupBlockStored
from .prefixes import Prefix


class PartialTails(dict[int, GroupBlockStored]):
    """Block id -> the announced partial tail entry that block holds besides its own
    prefix. A plain dict to read (false while empty: the index's hot paths test it
    so); ``store`` and ``drop`` also announce and withdraw through ``sink``."""

    __slots__ = ("_sink",)

    def __init__(self, sink: EventSink) -> None:
        super().__init__()
        self._sink = sink

    def store(self, b: Block, event: GroupBlockStored, nodes: Sequence[Prefix | None]) -> None:
        """Announce ``event``, a partial tail entry (one hash block) of ``b``, once, if
        ``b`` holds content (``nodes[b.block_id]``) as its group's primary (no twin)."""
        if b.block_id not in self and not b.twin and nodes[b.block_id] is not None:
            self[b.block_id] = event
            self._sink.append(event)

    def drop(self, b: Block) -> None:
        """``b`` loses its content: withdraw the partial tail entry it holds, if any."""
        tail = self.pop(b.block_id, None)
        if tail is not None:
            self._sink.append(GroupBlockRemoved(tail.block_hashes, (b.block_id,),
                                                group_idx=tail.group_idx, spec_kind=tail.spec_kind,
                                                spec_tokens=tail.spec_tokens))

    def of_group(self, g: int) -> list[GroupBlockStored]:
        """The entries held by blocks of group ``g`` (for a snapshot)."""
        return [e for e in self.values() if e.group_idx == g]

    def mismatch(self, nodes: Sequence[Prefix | None], entries: Sequence[dict[int, Block]]) -> str | None:
        """The first entry held by a block that is not its group's primary holder of
        its prefix (``entries``: per group, prefix id -> primary), None when sound."""
        for i, tail in self.items():
            node = nodes[i]
            primary = None if node is None else entries[tail.group_idx].get(node.pid)
            if primary is None or primary.block_id != i:
                return f"block {i} holds a partial tail entry but is not its group's primary"
        return None
