"""The group index's second findable entry per block (groups/fine.py; docs/groups.md "A
second findable entry per block"): full attention's partial entries, found in vLLM's
order, promoted, withdrawn with their block's content, announced once per group."""

from __future__ import annotations

from array import array

from prefixkv.core.pool import BlockPool
from prefixkv.event_log import EventLog
from prefixkv.groups.events import GroupBlockRemoved, GroupBlockStored
from prefixkv.groups.fine import hold
from prefixkv.groups.index import GroupIndex
from prefixkv.groups.prefixes import PrefixTable
from prefixkv.groups.spec import full_attention, mamba

H = 2  # hash block; full attention's block is 4 tokens (two hash blocks)


class Scene:
    """A full-attention group of 4 tokens (group 0) beside a Mamba group, hash block 2."""

    def __init__(self) -> None:
        self.log = EventLog(1000)
        self.table = PrefixTable()
        self.index = GroupIndex([full_attention(), mamba()], 8, self.table, self.log)
        self.pool = BlockPool(8, self.index)

    def nodes(self, tokens: list[int]):
        chunks = [array("I", tokens[i:i + H]).tobytes() for i in range(0, len(tokens), H)]
        return self.table.extend(None, chunks, [b""] * len(chunks),
                                 [b"h%d:" % i + c for i, c in enumerate(chunks)])

    def take(self):
        b = self.pool.take(1)[0]
        self.index.own(0, [b])
        return b

    def hold(self, b, nodes, i, tokens):
        hold(self.index, 0, b, nodes[i], i, array("I", tokens), None, H)

    def whole(self, b, nodes, j, tokens):
        """``b`` cached whole as block ``j`` (promoted: ``store`` drops its own partial entry first)."""
        self.index.store(0, [b], [nodes[2 * j + 1]], j, array("I", tokens), [None], 4, fine=2)

    def held(self):
        """A prompt's nodes, and block a holding its partial entry at the first hash block."""
        tokens = [1, 2, 3, 4, 5]
        nodes = self.nodes(tokens)
        a = self.take()
        self.hold(a, nodes, 0, tokens)
        return tokens, nodes, a

    def promoted_and_copied(self):
        """Block a whole (its key beside its partial entry), block c holding the entry
        after it."""
        tokens, nodes, a = self.held()
        c = self.take()
        self.whole(a, nodes, 0, tokens)
        self.hold(a, nodes, 0, tokens)
        self.hold(c, nodes, 0, tokens)
        return nodes, a, c

    def events(self):
        out = [(type(e).__name__[10:], e.block_hashes[0]) for e in self.log._events]
        self.log.clear()
        return out

    def sound(self):
        assert self.index.check(self.pool.blocks) is None, self.index.check(self.pool.blocks)


def test_a_partial_entry_is_a_blocks_only_content_until_it_is_whole():
    s = Scene()
    tokens, nodes, a = s.held()
    s.sound()
    assert s.index.fine.find(0, nodes[0]) is a
    assert s.index.nodes[a.block_id] is nodes[0] and a.key is nodes[0].key
    assert s.index.find(0, nodes[0]) is None  # (whole keys only)
    assert s.events() == [("Stored", nodes[0].hash)]
    ev = s.index.snapshot()[0]
    assert isinstance(ev, GroupBlockStored) and ev.parent_block_hash is None
    assert ev.token_ids == [1, 2] and ev.block_size == H


def test_promotion_keeps_the_entry_beside_the_whole_key_last_in_vllms_order():
    s = Scene()
    tokens, nodes, a = s.held()
    c = s.take()
    s.hold(c, nodes, 0, tokens)  # (a copy on write's block, cached by its request)
    assert s.index.fine.holders[(0, nodes[0].pid)] == [a, c]
    s.events()
    s.whole(a, nodes, 0, tokens)
    s.hold(a, nodes, 0, tokens)
    s.sound()
    assert s.index.find(0, nodes[1]) is a
    assert s.index.fine.holders[(0, nodes[0].pid)] == [c, a]  # (vLLM re-adds it: last)
    assert s.index.fine.find(0, nodes[0]) is c
    # (vLLM's promotion: the entry removed from a, the whole key stored, the entry again)
    assert s.events() == [("Removed", nodes[0].hash), ("Stored", nodes[1].hash), ("Stored", nodes[0].hash)]
    assert s.index.num_blocks_of(nodes[0]) == 2


def test_a_lone_holders_promotion_is_removed_stored_stored():
    s = Scene()
    tokens, nodes, a = s.held()
    s.events()
    s.whole(a, nodes, 0, tokens)
    s.hold(a, nodes, 0, tokens)
    s.sound()
    assert s.events() == [("Removed", nodes[0].hash), ("Stored", nodes[1].hash), ("Stored", nodes[0].hash)]
    assert {e.block_hashes[0] for e in s.index.snapshot()} == {nodes[0].hash, nodes[1].hash}


def test_eviction_takes_every_entry_of_the_block_and_the_next_holder_is_found():
    s = Scene()
    nodes, a, c = s.promoted_and_copied()
    s.pool.release([a])
    s.events()
    s.pool.take(7)  # (every free block: a is evicted)
    s.sound()
    assert s.index.find(0, nodes[1]) is None and a.key is None
    assert s.index.fine.find(0, nodes[0]) is c
    # (each hash a holds, the whole key first, as vLLM's eviction; c still holds the entry)
    assert s.events() == [("Removed", nodes[1].hash), ("Removed", nodes[0].hash)]
    s.index.drop_one(c)
    assert s.events() == [("Removed", nodes[0].hash)]
    assert not s.index.fine and not s.index.fine.holders
    s.sound()


def test_a_forgotten_prefix_takes_its_partial_entries_with_it():
    s = Scene()
    nodes, a, c = s.promoted_and_copied()
    s.pool.release([c])
    freed = s.index.uncache([a])  # (a's whole KV invalid: W forgotten, P stays on c)
    assert freed == [] and a.key is None and not s.index.fine.holds(a, nodes[0])
    assert s.index.fine.find(0, nodes[0]) is c
    s.sound()
    freed = s.index.uncache([c])  # (P invalid: c, free, loses it)
    assert freed == [c] and c.key is None and not s.index.fine
    assert s.index.check(s.pool.blocks) is None


def test_clear_forgets_every_partial_entry():
    s = Scene()
    tokens, nodes, a = s.held()
    s.index.clear()
    assert not s.index.fine and s.index.fine.find(0, nodes[0]) is None


def test_check_names_a_holder_the_entry_does_not_list():
    s = Scene()
    tokens, nodes, a = s.held()
    c = s.take()
    s.hold(c, nodes, 0, tokens)
    s.index.fine.holders[(0, nodes[0].pid)].remove(c)
    assert "partial entry" in s.index.check(s.pool.blocks)
    s.index.fine.holders[(0, nodes[0].pid)].append(a)
    assert "partial entry" in s.index.check(s.pool.blocks)


def test_removed_events_name_the_group():
    s = Scene()
    tokens, nodes, a = s.held()
    s.index.drop_one(a)
    gone = [e for e in s.log._events if isinstance(e, GroupBlockRemoved)]
    assert len(gone) == 1 and gone[0].group_idx == 0 and gone[0].block_hashes == (nodes[0].hash,)
