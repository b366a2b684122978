"""How content leaves a group's index (``GroupIndex``'s calls that take it out):
eviction (``drop``), KV found invalid (``uncache``, and ``cut_off`` for what a request
computes after it), and a spare's last reference (``release_spare``), each through
``unindex``, the one step that takes a block's content out of its group:

    a spare (twin)                  unlisted; its primary still finds the prefix
    a primary with a held spare     the first spare made takes its place (still announced)
    a primary alone                 the prefix goes from the group (withdrawn)

A block holds no content after, and its node loses the reference the block held
(``PrefixTable.unhold``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.block import Block
from ..core.keyless import Keyless
from .events import GroupBlockRemoved
from .prefixes import Prefix

if TYPE_CHECKING:
    from .index import GroupIndex


def drop(self: GroupIndex, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
         keyless: Keyless | None = None) -> None:
    """The eviction step: each free cached block loses its content (no run is
    pending here: ``skip`` is empty, ``keyless`` None)."""
    assert not skip and keyless is None, "a group index records no pending run"
    for b in blocks:
        unindex(self, b)


def drop_one(self: GroupIndex, block: Block) -> None:
    """``drop((block,))``."""
    unindex(self, block)


def uncache(self: GroupIndex, blocks: Sequence[Block]) -> list[Block]:
    """Held ``blocks`` whose KV is invalid (never computed, or a failed load) lose
    their content. A block of a prefix its group holds in another block too (a spare,
    or a primary with a spare) is unlisted (``unindex``: the other keeps it found);
    the other prefixes are forgotten (``PrefixTable.forget``) with every descendant,
    and each block of any group holding one loses its content (withdrawn). Returns
    the free blocks that lost it (the pool moves them to its empty tier:
    ``BlockPool.emptied``)."""
    held, owner = self.nodes, self.owner
    roots: list[Prefix] = []
    for b in blocks:
        node = held[b.block_id]
        if node is None:
            continue
        self.losses += 1
        if b.twin or self.twins[owner[b.block_id]].get(node.pid) \
                or self.fine and len(self.fine.holders_of(node)) > 1:  # (others keep it found)
            unindex(self, b)
        else:
            roots.append(node)
    freed: list[Block] = []
    for node in self.table.forget([n for n in roots if not n.lost]) if roots else ():
        for x in self.fine.holders_of(node) if self.fine else ():  # (fine.py)
            if held[x.block_id] is node:
                unindex(self, x)
                if not x.ref_cnt:
                    freed.append(x)
            else:
                self.fine.drop(x)
        for g, entries in enumerate(self.entries):
            for spare in self.twins[g].get(node.pid, ())[::-1]:
                unindex(self, spare)
            primary = entries.get(node.pid)
            if primary is not None:
                unindex(self, primary)
                if not primary.ref_cnt:
                    freed.append(primary)
    return freed


def cut_off(self: GroupIndex, tables: Sequence[Sequence[Block | None]], j: int) -> bool:
    """Whether a request's block ``j`` (``tables``: its block table per group) holds
    no content in some group that keys every block it computes (cached, not sparse): its KV
    was found invalid (``uncache``), so what the request computes after it is lost
    (``PrefixTable.extend``'s ``cut``)."""
    for spec, t in zip(self.specs, tables, strict=True):
        if not spec.sparse and spec.cached and 0 <= j < len(t):
            b = t[j]
            if b is not None and b.key is None:
                return True
    return False


def unindex(self: GroupIndex, b: Block) -> None:
    """Take ``b``'s content out of its group: a spare is unlisted; a primary with a
    held spare hands the prefix to it (still announced); else the prefix goes from
    the group (withdrawn). ``b`` holds no content after."""
    g = self.owner[b.block_id]
    node = self.nodes[b.block_id]
    assert node is not None, b
    self.nodes[b.block_id] = None
    b.key = None
    twins = self.twins[g]
    if b.twin:
        b.twin = False
        listed = twins[node.pid]
        listed.remove(b)
        if not listed:
            del twins[node.pid]
        if self.tails:
            self.tails.drop(b)
        if self.fine:
            self.fine.drop(b)
        self.table.unhold(node)
        return
    entries = self.entries[g]
    if entries.get(node.pid) is not b:  # (its only content was a partial entry: fine.py)
        entry = self.fine.drop(b)
        assert entry is node, b
        return
    heirs = twins.get(node.pid)
    if heirs:
        heir = heirs.pop(0)  # (the first made: vLLM finds the copy it cached first)
        if not heirs:
            del twins[node.pid]
        heir.twin = False
        entries[node.pid] = heir
        # (the snapshot restates the announcement with the heir's id)
        heir.event = None if b.event is None else replace(b.event, block_ids=(heir.block_id,))
        self.table.unhold(node)
        if self.tails:
            self.tails.drop(b)
        if self.fine:
            self.fine.drop(b)
        return
    del entries[node.pid]
    if self._sink.active:
        assert node.hash is not None, f"{node!r} was announced without its chain hash"
        _withdraw(self, (node.hash,), b, g)
        if self.tails:
            self.tails.drop(b)
    if self.fine:  # (after the whole key: vLLM removes a block's primary hash first)
        self.fine.drop(b)
    self.table.unhold(node)


def _withdraw(self: GroupIndex, hashes: Sequence[bytes], b: Block, g: int) -> None:
    spec = self.specs[g]
    self._sink.append(GroupBlockRemoved(hashes, (b.block_id,), group_idx=g,
                                        spec_kind=spec.kind, spec_tokens=spec.tokens))


def release_spare(self: GroupIndex, block: Block) -> Block | None:
    """Forget a spare whose last reference went (it returns empty); the primary of
    its prefix in its group when that sits free (the pool moves it to the spare's
    place in the LRU order), else None."""
    g, node = self.owner[block.block_id], self.nodes[block.block_id]
    assert block.twin and node is not None, block
    unindex(self, block)
    primary = self.entries[g].get(node.pid)
    return primary if primary is not None and not primary.ref_cnt else None
