"""Partial entries of full-attention groups larger than the hash block (vLLM's
fine-grained full attention: ``FullAttentionManager._cache_partial_tail_block``), the
second findable entry a block may hold (docs/groups.md "A second findable entry per
block").

    tokens        | 0 .. h-1 | h .. 2h-1 | 2h .. 3h-1 | 3h .. 4h-1 |
    full (4h)     |                 block 0                       |  its own key W (once whole)
                                          ^ P: a partial entry of block 0 (holders[(g, P)])

A block holds at most one partial entry ``P``. While the block is not whole, ``P`` is its
only content (``GroupIndex.nodes`` names it, and the group's ``entries`` do not list
it); once whole, its whole key is its content and ``P`` stays beside it. Each entry
lists its holders per group in the order they got it, the first being the one vLLM
finds (its hash map keeps insertion order); each holder announces it and withdraws it,
as vLLM's ``cache_partial_block`` and eviction do per block (session 28; before, the
first announced it and the last withdrew it).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.block import Block
from ..event_log import EventSink
from ..extra_keys import ExtraKeys
from ..hashing import token_bytes
from .events import GroupBlockRemoved, GroupBlockStored
from .prefixes import Prefix, PrefixTable

if TYPE_CHECKING:
    from .index import GroupIndex


class FineEntries(dict[int, tuple[int, Prefix]]):
    """Block id -> the partial entry the block holds (its group and prefix): a plain
    dict to read (false while empty: the index's hot paths test it so, at C speed);
    ``holders[(g, pid)]``: the blocks of group ``g`` holding the partial entry of prefix
    ``pid``, the first found first; ``announced[(g, pid)]``: its first holder's
    ``GroupBlockStored`` (events on), restated once by a snapshot."""

    __slots__ = ("holders", "announced", "_sink", "_table", "_groups")

    def __init__(self, sink: EventSink, table: PrefixTable, num_groups: int) -> None:
        super().__init__()
        self.holders: dict[tuple[int, int], list[Block]] = {}
        self.announced: dict[tuple[int, int], GroupBlockStored] = {}
        self._sink = sink
        self._table = table
        self._groups = range(num_groups)

    def find(self, g: int, node: Prefix) -> Block | None:
        """The block of group ``g`` vLLM finds under ``node``'s partial entry, if any."""
        listed = self.holders.get((g, node.pid))
        return listed[0] if listed else None

    def holds(self, b: Block, node: Prefix) -> bool:
        """Whether ``b`` holds ``node``'s partial entry."""
        got = self.get(b.block_id)
        return got is not None and got[1] is node

    def add(self, g: int, b: Block, node: Prefix, event: GroupBlockStored | None) -> None:
        """``b`` (of group ``g``, holding no partial entry) gets ``node``'s as its last
        holder; ``event`` announces it (None: events off), for each holder, as vLLM's
        ``cache_partial_block`` announces each block it gives the entry."""
        assert b.block_id not in self, b
        self[b.block_id] = (g, node)
        node.refs += 1
        listed = self.holders.setdefault((g, node.pid), [])
        listed.append(b)
        if event is not None:
            self.announced.setdefault((g, node.pid), event)
            self._sink.append(event)

    def drop(self, b: Block) -> Prefix | None:
        """``b`` loses its partial entry, if any (withdrawn for each holder, as vLLM's
        eviction removes each hash a block holds); returns the entry's prefix."""
        got = self.pop(b.block_id, None)
        if got is None:
            return None
        g, node = got
        key = (g, node.pid)
        listed = self.holders[key]
        listed.remove(b)
        ev = self.announced.get(key)
        if not listed:
            del self.holders[key]
            self.announced.pop(key, None)
        if ev is not None:
            self._sink.append(GroupBlockRemoved(ev.block_hashes, (b.block_id,), group_idx=g,
                                                spec_kind=ev.spec_kind, spec_tokens=ev.spec_tokens))
        self._table.unhold(node)
        return node

    def holders_of(self, node: Prefix) -> list[Block]:
        """Every block of any group holding ``node``'s partial entry."""
        get, pid = self.holders.get, node.pid
        return [b for g in self._groups for b in get((g, pid), ())]

    def of_group(self, g: int) -> list[GroupBlockStored]:
        """The entries of group ``g`` that were announced, each once (for a snapshot),
        naming their first holder."""
        return [replace(ev, block_ids=(self.holders[key][0].block_id,))
                for key, ev in self.announced.items() if key[0] == g]

    def clear(self) -> None:
        super().clear()
        self.holders.clear()
        self.announced.clear()

    def mismatch(self, nodes: Sequence[Prefix | None], owner: Sequence[int]) -> str | None:
        """The first entry whose holders and blocks disagree, None when sound: every
        holder lists its block under the entry it holds, in the entry's group, once, and
        holds content; every listed entry has holders."""
        seen = 0
        for (g, pid), listed in self.holders.items():
            if not listed or len({b.block_id for b in listed}) != len(listed):
                return f"group {g}: partial entry {pid} has holders {listed!r}"
            for b in listed:
                got = self.get(b.block_id)
                if got is None or got[0] != g or got[1].pid != pid or owner[b.block_id] != g \
                        or nodes[b.block_id] is None:
                    return f"group {g}: block {b.block_id} listed under partial entry {pid} holds {got!r}"
            seen += len(listed)
        if seen != len(self):
            return "a block holds a partial entry that lists no such holder"
        if any(k not in self.holders for k in self.announced):
            return "an announced partial entry has no holder"
        return None




def hold(index: GroupIndex, g: int, b: Block, node: Prefix, i: int, tokens: array[int],
         extra: ExtraKeys | None, h: int) -> None:
    """Block ``b`` of full-attention group ``g`` gets the partial entry of ``node``, the
    prefix of the request's hash blocks ``0..i`` (a boundary inside ``b``; ``tokens``,
    ``extra``: the request's, for the event), as its last holder; its only content when
    it holds none. A block holding the entry already is left as it is; one holding
    another loses that first (under lookahead keys a request's entry moves up inside
    the block as its tokens after the prompt become known: partial_full.py ``_last``;
    vLLM's ``cache_partial_block`` drops the shorter entry of a block so).
    Announced, when events are on, as vLLM's ``cache_partial_block`` announces it: one
    hash block, the last before the boundary, the prefix one hash block shorter as
    parent."""
    fine = index.fine
    if node.lost or fine.holds(b, node):
        return
    got = fine.get(b.block_id)
    if got is not None:
        index.drop_one(b) if index.nodes[b.block_id] is got[1] else fine.drop(b)
    if index.nodes[b.block_id] is None:  # (not whole: the entry is its only content)
        index.nodes[b.block_id] = node
        b.key, b.content_id, b.hash, b.twin = node.key, node.pid, node.hash, False
    event = None
    if index.hashing:
        assert node.hash is not None, f"{node!r}: events need its chain hash"
        spec = index.specs[g]
        parent = node.parent.hash if node.parent is not None else None
        event = GroupBlockStored((node.hash,), parent, token_bytes(tokens[i * h:(i + 1) * h]),
                                 (b.block_id,), extra, i, group_idx=g,
                                 spec_kind=spec.kind, spec_tokens=spec.tokens)
    fine.add(g, b, node, event)
