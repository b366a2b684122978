"""The groups' indexes: per group, which block holds the KV of a prefix id.

One ``GroupIndex`` serves the shared ``BlockPool`` as its index (eviction and reset come
here) and keeps one dict per group, ``pid -> block``: keys of different groups never meet,
because each group looks only in its own dict. ``owner[block_id]`` is the group a block
was last handed to, which routes an eviction to the right dict.

A block holds content when ``nodes[block_id]`` is its ``Prefix`` node, whose key its
``key`` is (``content_id`` its pid, ``hash`` the node's chain hash). A group finds one
block per prefix, its primary (``entries``); a second block that computes a prefix the
group already holds (two requests decoding the same text) is a spare (``twin``, listed in
``twins``), as the core's ``ContentIndex`` keeps them: when the primary is evicted or
uncached, the first held twin made takes its place, so the prefix stays findable while
any block of the group holds it (vLLM keeps every copy under its hash and finds the one
it cached first). A twin whose last reference goes returns empty, and the primary, if
free, takes the twin's place in the LRU order (``release_spare``). Events announce a
prefix once per group (its first block) and withdraw it once (its last). How content
leaves a group (eviction, invalid KV, a spare's last reference) is unindex.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from operator import attrgetter

from ..core.block import Block
from ..event_log import EventSink
from ..events import Event
from ..extra_keys import ExtraKeys
from ..hashing import token_bytes
from . import unindex
from .events import GroupBlockStored
from .fine import FineEntries
from .prefixes import Prefix, PrefixTable
from .spec import GroupSpec
from .tails import PartialTails

_PID = attrgetter("pid")


def _up(node: Prefix, n: int) -> Prefix | None:
    """``node``'s ancestor ``n`` generations up (None past the first block)."""
    up: Prefix | None = node
    for _ in range(n):
        up = up.parent if up is not None else None
    return up


class GroupIndex:
    """Satisfies what ``BlockPool`` asks of an index (``drop``, ``release_spare``,
    ``clear``, ``check``); the manager records and finds content through the rest."""

    def __init__(self, specs: Sequence[GroupSpec], num_blocks: int, table: PrefixTable,
                 sink: EventSink, records: bool = True) -> None:
        self.specs = tuple(specs)
        self.records = records
        """False: the manager records no content here (caching off): nothing is found."""
        self.entries: list[dict[int, Block]] = [{} for _ in specs]
        self.twins: list[dict[int, list[Block]]] = [{} for _ in specs]  # pid -> held spares
        self.owner = [-1] * num_blocks
        self.nodes: list[Prefix | None] = [None] * num_blocks  # block id -> the prefix held
        self.table = table
        self._sink = sink
        self.hashing = sink.active
        self.tails = PartialTails(sink)  # (vLLM's partial tail entries: tails.py)
        self.fine = FineEntries(sink, table, len(specs))  # (findable partial entries: fine.py)
        # ``uncache`` calls that took content from a held block (``GroupRequest.losses``)
        self.losses = 0

    def __len__(self) -> int:
        return sum(len(e) for e in self.entries)

    def find(self, g: int, node: Prefix) -> Block | None:
        """The block of group ``g`` holding ``node``'s prefix, if any."""
        return self.entries[g].get(node.pid)

    def finds(self, g: int, nodes: Sequence[Prefix]) -> Iterator[bool]:
        """Whether group ``g`` finds each of ``nodes`` (``find`` is not None), in order,
        at C speed (free_order.py asks it of a long request's whole prefix)."""
        return map(self.entries[g].__contains__, map(_PID, nodes))

    def num_blocks_of(self, node: Prefix) -> int:
        """Blocks of every group that hold ``node``'s prefix (primaries and spares)."""
        pid = node.pid
        n = sum((pid in e) + len(t.get(pid, ())) for e, t in zip(self.entries, self.twins, strict=True))
        return n + len(self.fine.holders_of(node)) if self.fine else n

    def own(self, g: int, blocks: Sequence[Block]) -> None:
        """Blocks just taken from the pool now belong to group ``g``."""
        owner = self.owner
        for b in blocks:
            owner[b.block_id] = g

    def store(self, g: int, blocks: Sequence[Block | None], nodes: Sequence[Prefix], first: int,
              tokens: array[int], extras: Sequence[ExtraKeys | None], block_size: int,
              fine: int = 1) -> None:
        """Record that ``blocks`` (group ``g``'s blocks ``first..``) hold ``nodes``;
        ``tokens``/``extras[i]`` (ExtraKeys or None) are for the events, whose parent
        is the chain hash of the prefix ``fine`` nodes up (the group's block before,
        whose node is ``fine`` hash blocks shorter: ``BlockSizes.key_index``). A block whose
        prefix the group holds already becomes a spare of it (no event); one of a lost
        prefix (computed after KV found invalid) holds none."""
        entries, sink, spec, held = self.entries[g], self._sink, self.specs[g], self.nodes
        for i, (b, node) in enumerate(zip(blocks, nodes, strict=True)):
            if b is None or node.lost:
                continue  # released (by a rewound request), or lost
            if held[b.block_id] is not None:  # recorded already, or (fine.py) promoted
                if not self.fine or self.fine.get(b.block_id, (0, None))[1] is not held[b.block_id]:
                    continue
                unindex.unindex(self, b)  # (its only content was its partial entry: vLLM's promotion)
            held[b.block_id] = node
            b.key = node.key
            b.content_id, b.hash = node.pid, node.hash
            node.refs += 1
            if node.pid in entries:  # the group holds this prefix already: a spare
                b.twin = True
                self.twins[g].setdefault(node.pid, []).append(b)
                continue
            b.twin = False
            entries[node.pid] = b
            if sink.active:
                assert node.hash is not None, f"{node!r}: events need its chain hash"
                j = first + i
                up = node.parent if fine == 1 else _up(node, fine)
                parent = up.hash if up is not None else None
                ids = token_bytes(tokens[j * block_size:(j + 1) * block_size])
                b.event = ev = GroupBlockStored(
                    (node.hash,), parent, ids, (b.block_id,), extras[i], j,
                    group_idx=g, spec_kind=spec.kind, spec_tokens=spec.tokens)
                sink.append(ev)

    # ---- content leaving a group (eviction, invalid KV, a spare's last reference):
    # groups/unindex.py
    drop = unindex.drop
    drop_one = unindex.drop_one
    uncache = unindex.uncache
    cut_off = unindex.cut_off
    release_spare = unindex.release_spare

    def snapshot(self) -> list[Event]:
        """One GroupBlockStored per indexed block, group by group, parents first."""
        out: list[Event] = []
        for g, entries in enumerate(self.entries):
            for pid in sorted(entries):
                b = entries[pid]
                if b.event is not None:
                    out.append(b.event)
            out += self.tails.of_group(g)
            out += self.fine.of_group(g)
        return out

    def clear(self) -> None:
        for e in self.entries:
            e.clear()
        for t in self.twins:
            t.clear()
        self.tails.clear()
        self.fine.clear()
        self.nodes = [None] * len(self.nodes)
        self.table.clear()

    def check(self, blocks: Sequence[Block]) -> str | None:
        """The first block, entry or spare that disagrees, None when sound."""
        for g, entries in enumerate(self.entries):
            for pid, b in entries.items():
                if self._holds(b, g, pid) or b.twin:
                    return f"group {g}: entry {pid} -> {b!r} does not match the block"
            for pid, listed in self.twins[g].items():
                if pid not in entries or not listed:
                    return f"group {g}: spares {listed!r} of prefix {pid}, which it does not find"
                for b in listed:
                    if self._holds(b, g, pid) or not b.twin or not b.ref_cnt \
                            or listed.count(b) != 1:
                        return f"group {g}: spare {b!r} of prefix {pid} does not match the block"
        tails = self.tails.mismatch(self.nodes, self.entries, self.twins) \
            or self.fine.mismatch(self.nodes, self.owner)
        if tails is not None:
            return tails
        for b in blocks:
            node = self.nodes[b.block_id]
            if (b.key is None) != (node is None):
                return f"block {b.block_id}: key {b.key!r} but prefix {node!r}"
            if node is not None and not self.fine.holds(b, node):
                g = self.owner[b.block_id]
                if g < 0 or (b not in self.twins[g].get(node.pid, ()) if b.twin
                             else self.entries[g].get(node.pid) is not b):
                    return f"block {b.block_id} has content but is not indexed in its group {g}"
        return None

    def _holds(self, b: Block, g: int, pid: int) -> str | None:
        """Why ``b``, listed under prefix ``pid`` of group ``g``, does not hold it."""
        node = self.nodes[b.block_id]
        if node is None or node.pid != pid or b.key is not node.key \
                or self.owner[b.block_id] != g or b.content_id != pid:
            return f"{b!r} holds {node!r}"
        return None

    def node_refs(self) -> dict[int, int]:
        """pid -> blocks holding it (primaries and spares), over every group."""
        refs: dict[int, int] = {}
        for entries, twins in zip(self.entries, self.twins, strict=True):
            for pid in entries:
                refs[pid] = refs.get(pid, 0) + 1
            for pid, listed in twins.items():
                refs[pid] = refs.get(pid, 0) + len(listed)
        for (_, pid), listed in self.fine.holders.items():
            refs[pid] = refs.get(pid, 0) + len(listed)
        return refs

