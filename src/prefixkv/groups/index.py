"""The groups' indexes: per group, which block holds the KV of a prefix id.

One ``GroupIndex`` serves the shared ``BlockPool`` as its index (eviction and reset come
here) and keeps one dict per group, ``pid -> block``: keys of different groups never meet,
because each group looks only in its own dict. ``owner[block_id]`` is the group a block
was last handed to, which routes an eviction to the right dict.

A block holds content when ``nodes[block_id]`` is its ``Prefix`` node, whose key its
``key`` is (``content_id`` its pid, ``hash`` the node's chain hash). A group keeps one
block per prefix: a second block that computes a prefix the group already holds (two
requests prefilling the same text at once) stays without content and goes back empty
when released (no spare copies, unlike the core's ``ContentIndex``: such a prefix becomes
unfindable in that group if the indexed block is evicted first, which can cost a hit,
never correctness).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ..core.block import Block
from ..event_log import EventSink
from ..events import Event
from ..extra_keys import ExtraKeys
from ..hashing import token_bytes
from .events import GroupBlockRemoved, GroupBlockStored
from .prefixes import Prefix, PrefixTable
from .spec import GroupSpec


class GroupIndex:
    """Satisfies what ``BlockPool`` asks of an index (``drop``, ``release_spare``,
    ``clear``, ``check``); the manager records and finds content through the rest."""

    def __init__(self, specs: Sequence[GroupSpec], num_blocks: int, table: PrefixTable,
                 sink: EventSink) -> None:
        self.specs = tuple(specs)
        self.entries: list[dict[int, Block]] = [{} for _ in specs]
        self.owner = [-1] * num_blocks
        self.nodes: list[Prefix | None] = [None] * num_blocks  # block id -> the prefix held
        self.table = table
        self._sink = sink
        self.hashing = sink.active

    def __len__(self) -> int:
        return sum(len(e) for e in self.entries)

    def find(self, g: int, node: Prefix) -> Block | None:
        """The block of group ``g`` holding ``node``'s prefix, if any."""
        return self.entries[g].get(node.pid)

    def own(self, g: int, blocks: Sequence[Block]) -> None:
        """Blocks just taken from the pool now belong to group ``g``."""
        owner = self.owner
        for b in blocks:
            owner[b.block_id] = g

    def store(self, g: int, blocks: Sequence[Block | None], nodes: Sequence[Prefix], first: int,
              tokens: array[int], extras: Sequence[ExtraKeys | None], block_size: int) -> None:
        """Record that ``blocks`` (group ``g``'s blocks ``first..``) hold ``nodes``;
        ``tokens``/``extras[i]`` (ExtraKeys or None) are for the events."""
        entries, sink, spec = self.entries[g], self._sink, self.specs[g]
        for i, (b, node) in enumerate(zip(blocks, nodes, strict=True)):
            if b is None or node.pid in entries:
                continue  # released (by a rewound request), or the group holds this prefix already
            entries[node.pid] = b
            self.nodes[b.block_id] = node
            b.key = node.key
            b.content_id, b.hash = node.pid, node.hash
            node.refs += 1
            if sink.active:
                assert node.hash is not None, f"{node!r}: events need its chain hash"
                j = first + i
                parent = node.parent.hash if node.parent is not None else None
                ids = token_bytes(tokens[j * block_size:(j + 1) * block_size])
                b.event = ev = GroupBlockStored(
                    (node.hash,), parent, ids, (b.block_id,), extras[i], j,
                    group_idx=g, spec_kind=spec.kind, spec_tokens=spec.tokens)
                sink.append(ev)

    def drop(self, blocks: Sequence[Block]) -> None:
        """The eviction step: each free cached block loses its content."""
        for b in blocks:
            self._unindex(b)

    def drop_one(self, block: Block) -> None:
        """``drop((block,))``."""
        self._unindex(block)

    def uncache(self, blocks: Sequence[Block]) -> None:
        """Held ``blocks`` whose KV was never computed lose their content."""
        for b in blocks:
            if b.key is not None:
                self._unindex(b)

    def _unindex(self, b: Block) -> None:
        g = self.owner[b.block_id]
        node = self.nodes[b.block_id]
        assert node is not None and self.entries[g].get(node.pid) is b, b
        del self.entries[g][node.pid]
        self.nodes[b.block_id] = None
        b.key = None
        if self._sink.active:
            assert node.hash is not None, f"{node!r} was announced without its chain hash"
            spec = self.specs[g]
            self._sink.append(GroupBlockRemoved(
                (node.hash,), (b.block_id,), group_idx=g,
                spec_kind=spec.kind, spec_tokens=spec.tokens))
        self.table.unhold(node)

    def release_spare(self, block: Block) -> Block | None:
        raise AssertionError(f"{block!r}: groups keep no spare copies")

    def snapshot(self) -> list[Event]:
        """One GroupBlockStored per indexed block, group by group, parents first."""
        out: list[Event] = []
        for entries in self.entries:
            for pid in sorted(entries):
                b = entries[pid]
                if b.event is not None:
                    out.append(b.event)
        return out

    def clear(self) -> None:
        for e in self.entries:
            e.clear()
        self.nodes = [None] * len(self.nodes)
        self.table.clear()

    def check(self, blocks: Sequence[Block]) -> str | None:
        """The first block or entry that disagrees, None when sound."""
        for g, entries in enumerate(self.entries):
            for pid, b in entries.items():
                node = self.nodes[b.block_id]
                if node is None or node.pid != pid or b.key is not node.key \
                        or self.owner[b.block_id] != g or b.content_id != pid or b.twin:
                    return f"group {g}: entry {pid} -> {b!r} does not match the block"
        for b in blocks:
            node = self.nodes[b.block_id]
            if (b.key is None) != (node is None):
                return f"block {b.block_id}: key {b.key!r} but prefix {node!r}"
            if node is not None:
                g = self.owner[b.block_id]
                if g < 0 or self.entries[g].get(node.pid) is not b:
                    return f"block {b.block_id} has content but is not indexed in its group {g}"
        return None

    def node_refs(self) -> dict[int, int]:
        """pid -> indexed blocks under it, over every group."""
        refs: dict[int, int] = {}
        for entries in self.entries:
            for pid in entries:
                refs[pid] = refs.get(pid, 0) + 1
        return refs

