"""Partial tail entries of a hybrid index (vLLM's ``_cache_partial_tail_block``).

Where a full-attention group's block is larger than the hash block, vLLM announces, for
a prompt whose last hash boundary before its last token falls inside a block of the
group, one more entry for that block: the hash block before the boundary
(``BlockSizes.stored``; groups/sized.py finds it). Such an entry never serves a hit
(hits look at whole blocks). vLLM caches it on every block that computed it, a spare
(a twin) too, so several blocks may hold one entry: it is announced by the first and
withdrawn when the last loses it (``unindex.unindex``: evicted, or a spare emptied
when its request frees it, where vLLM keeps the copy cached until it evicts it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..core.block import Block
from ..event_log import EventSink
from .events import GroupBlockRemoved, GroupBlockStored
from .prefixes import Prefix


class PartialTails(dict[int, GroupBlockStored]):
    """Block id -> the partial tail entry that block holds besides its own prefix, in
    the order stored (the first holder of an entry first). A plain dict to read (false
    while empty: the index's hot paths test it so); ``store`` and ``drop`` also count
    each entry's holders (``held``: by group and hash) and announce and withdraw it
    through ``sink``."""

    __slots__ = ("_sink", "held")

    def __init__(self, sink: EventSink) -> None:
        super().__init__()
        self._sink = sink
        self.held: Counter[tuple[int, bytes]] = Counter()

    def store(self, b: Block, event: GroupBlockStored, nodes: Sequence[Prefix | None]) -> None:
        """``b`` holds ``event``, a partial tail entry (one hash block), once, if ``b``
        holds content (``nodes[b.block_id]``: as its group's primary or a spare);
        announced when no other block holds it."""
        if b.block_id not in self and nodes[b.block_id] is not None:
            self[b.block_id] = event
            key = (event.group_idx, event.block_hashes[0])
            if not self.held[key]:
                self._sink.append(event)
            self.held[key] += 1

    def drop(self, b: Block) -> None:
        """``b`` loses its content: the partial tail entry it holds, if any, withdrawn
        when no other block holds it."""
        tail = self.pop(b.block_id, None)
        if tail is not None:
            key = (tail.group_idx, tail.block_hashes[0])
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
                self._sink.append(GroupBlockRemoved(tail.block_hashes, (b.block_id,),
                                                    group_idx=tail.group_idx, spec_kind=tail.spec_kind,
                                                    spec_tokens=tail.spec_tokens))

    def clear(self) -> None:
        super().clear()
        self.held.clear()

    def of_group(self, g: int) -> list[GroupBlockStored]:
        """The entries held by blocks of group ``g``, each once (for a snapshot)."""
        out: dict[bytes, GroupBlockStored] = {}
        for e in self.values():
            if e.group_idx == g:
                out.setdefault(e.block_hashes[0], e)
        return list(out.values())

    def mismatch(self, nodes: Sequence[Prefix | None], entries: Sequence[dict[int, Block]],
                 twins: Sequence[dict[int, list[Block]]]) -> str | None:
        """The first entry held by a block that holds no prefix of its group (``entries``:
        per group, prefix id -> primary; ``twins``: prefix id -> held spares), or counts
        that are not the holders', None when sound."""
        for i, tail in self.items():
            node, g = nodes[i], tail.group_idx
            holders = [] if node is None else [entries[g].get(node.pid), *twins[g].get(node.pid, ())]
            if all(b is None or b.block_id != i for b in holders):
                return f"block {i} holds a partial tail entry but not its group's prefix"
        if self.held != Counter((t.group_idx, t.block_hashes[0]) for t in self.values()):
            return "the partial tail entries' holder counts are not their holders'"
        return None
