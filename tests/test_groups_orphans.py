"""The hybrid manager's side of tests/test_orphans.py: a prefix whose KV turned out invalid
(``uncache_blocks``: a failed load; ``rewind``; ``free(num_computed_tokens=...)``) is
forgotten in every group with its cached descendants (each withdrawn: GroupBlockRemoved),
and the blocks a request fills after it get no prefix (never found, never announced).
Before, the groups' index withdrew the uncached block alone: its prefix node stayed in the
table (its children referred to it), a recomputation of the same tokens was indexed under
it again, and the blocks computed on top of the invalid KV were served again (lookup 12
of 13 tokens, the last block read a's invalid block 1)."""

from __future__ import annotations

import pytest

from prefixkv import AllBlocksCleared, BlockRemoved, BlockStored
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes

BS = 4
FULL = full_attention()


class Mirror:
    """A router's view: the (group, chain hash) pairs the events say are held."""

    def __init__(self, m: HybridKVCacheManager) -> None:
        self.m = m
        self.fn, self.root = make_hash_fn("sha256", 0)
        self.held: set[tuple[int, bytes]] = set()

    def drain(self) -> None:
        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
            elif isinstance(ev, BlockStored):
                assert (ev.group_idx, ev.block_hashes[0]) not in self.held
                self.held.add((ev.group_idx, ev.block_hashes[0]))
            else:
                assert isinstance(ev, BlockRemoved)
                self.held.remove((ev.group_idx, ev.block_hashes[0]))

    def announced(self, g: int, prompt: list[int]) -> list[bool]:
        """Per full block of ``prompt``: whether group ``g`` holds it, by the events."""
        self.drain()
        n = len(prompt) // BS
        hashes = chain(self.fn, self.root, token_bytes(encode_tokens(prompt[:n * BS])), [b""] * n)[0]
        return [(g, h) in self.held for h in hashes]


def _manager(groups=(FULL,), num_blocks=16):
    m = HybridKVCacheManager(list(groups), num_blocks, BS, hash_mode="sha256", seed=0,
                             enable_events=True)
    return m, Mirror(m)


def test_blocks_a_request_fills_after_its_uncached_block_are_not_served():
    m, mirror = _manager()
    m.add_request("a", list(range(9)))
    (ids,) = m.get_block_ids("a")
    assert ids == (0, 1, 2)
    m.uncache_blocks([1])  # a failed load into a's block 1
    assert m.append_tokens("a", [9, 10, 11, 12]) is not None  # block 2, computed on block 1
    m.free("a")
    m.add_request("c", list(range(8)) + [77])  # recomputes block 1
    m.check_invariants()
    assert m.lookup(list(range(13)) + [0]) == 8  # before: 12 (a's block 2 served)
    assert m.get_block_ids("c") == ((0, 3, 2),)  # the emptied blocks, reused first, a's tail first
    assert mirror.announced(0, list(range(13))) == [True, True, False]  # before: block 2 too
    m.free("c")
    m.check_invariants()


def test_a_forgotten_prefix_takes_its_cached_descendants_in_every_group():
    m, mirror = _manager([sliding_window(8), full_attention()], 20)
    m.add_request("gone", list(range(17)))  # four full blocks
    m.free("gone")
    assert mirror.announced(0, list(range(17))) == [True] * 4
    assert mirror.announced(1, list(range(17))) == [True] * 4
    m.add_request("a", list(range(8)) + [99])  # hits blocks 0 and 1
    w, f = m.get_block_ids("a")
    m.uncache_blocks([f[1]])  # its full group's block 1 failed to load
    m.check_invariants()
    # blocks 1..3 go in both groups (block 0 stays), withdrawn before any recompute
    assert mirror.announced(0, list(range(17))) == [True, False, False, False]
    assert mirror.announced(1, list(range(17))) == [True, False, False, False]
    assert m.lookup(list(range(17)) + [0]) == 4  # before: 16
    m.rewind("a", 4)  # a recomputes block 1
    assert m.append_tokens("a", [4, 5, 6, 7, 99]) is not None
    m.check_invariants()
    assert m.lookup(list(range(17)) + [0]) == 8
    assert mirror.announced(1, list(range(17))) == [True, True, False, False]
    m.free("a")
    m.check_invariants()


def test_a_window_group_does_not_serve_past_an_uncached_block_it_no_longer_reads():
    m, mirror = _manager([sliding_window(4), full_attention()], 24)
    m.add_request("a", list(range(9)))
    w, f = m.get_block_ids("a")
    m.uncache_blocks([w[1], f[1]])  # the load of block 1 failed in both groups
    assert m.append_tokens("a", list(range(9, 21))) is not None  # blocks 2..4 computed on it
    m.free("a")
    m.add_request("c", list(range(8)) + [77])  # recomputes block 1
    m.check_invariants()
    prompt = list(range(21)) + [0]
    # the window at 20 reads block 4 alone, the full group every block: before, 20
    assert m.lookup(prompt) == 8
    assert mirror.announced(0, prompt) == [True, True, False, False, False]
    assert mirror.announced(1, prompt) == [True, True, False, False, False]
    m.free("c")
    m.check_invariants()


def test_free_with_num_computed_tokens_forgets_what_another_request_built_on_it():
    m, mirror = _manager()
    m.add_request("a", list(range(9)))
    m.add_request("b", list(range(13)) + [5])  # hits a's blocks 0 and 1, computes block 2
    (a_ids,), (b_ids,) = m.get_block_ids("a"), m.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2]
    m.free("a", num_computed_tokens=4)  # a's step never ran: block 1 was never written
    m.check_invariants()
    assert m.lookup(list(range(13)) + [0]) == 4  # before: 12
    assert mirror.announced(0, list(range(13))) == [True, False, False]
    assert m.append_tokens("b", [6, 7, 8]) is not None  # b's block 3: no prefix either
    m.check_invariants()
    assert mirror.announced(0, list(range(13)) + [5, 6, 7, 8]) == [True, False, False, False]
    m.free("b")
    m.check_invariants()
    assert m.lookup(list(range(13)) + [5, 6, 7, 8, 0]) == 4


def test_a_request_whose_block_lost_its_kv_while_a_spare_keeps_the_prefix_computes_nothing_found():
    # a and b decode the same text: b's block 1 is a spare of a's. a's block 1 fails to
    # load: b's copy keeps the prefix found, but what a computes after it read a's block
    m, mirror = _manager([full_attention(), sliding_window(8)], 16)
    for rid in ("a", "b"):
        m.add_request(rid, [1, 2, 3, 4, 5, 6])
    for rid in ("a", "b"):
        m.append_tokens(rid, [7, 8])
    a1 = [t[1] for t in m.get_block_ids("a")]
    m.uncache_blocks(a1)
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8  # b's copies
    assert m.append_tokens("a", [9, 10, 11, 12]) is not None  # a's block 2: read a1
    m.check_invariants()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]
    assert m.lookup(prompt) == 8  # before: 12
    assert mirror.announced(0, prompt) == [True, True, False]
    m.free("a")
    m.check_invariants()
    assert m.lookup(prompt) == 8
    assert m.append_tokens("b", [9, 10, 11, 12]) is not None  # b's own block 2 is found
    assert m.lookup(prompt) == 12
    assert mirror.announced(0, prompt) == [True, True, True]
    m.free("b")
    m.check_invariants()


def test_the_blocks_a_request_computed_after_a_block_that_failed_to_load_go_with_it():
    # found by the groups state machine's fail_load rule: b's block 0 is a spare of a's
    # (the prefix stays found); b's block 1, computed on b's block 0, stayed found
    m, mirror = _manager()
    m.add_request("a", [1, 2, 3, 4, 0])
    m.add_request("b", [1, 2, 3, 4])  # no hit (the block holding its last token)
    assert m.append_tokens("b", [0, 5, 6, 7, 8]) is not None  # b's block 1
    (a_ids,), (b_ids,) = m.get_block_ids("a"), m.get_block_ids("b")
    assert a_ids[0] != b_ids[0]
    m.uncache_blocks([b_ids[0]])  # its load failed
    m.check_invariants()
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 0]
    assert m.lookup(prompt) == 4  # a's block 0; before: 8 (b's block 1)
    assert mirror.announced(0, prompt) == [True, False]
    m.free("b")
    m.check_invariants()
    assert m.lookup(prompt) == 4


def test_a_prefix_whose_only_reference_was_a_forgotten_child_stays_for_the_request_rewound_to_it():
    # found by the groups state machine (rewind_past_released, then rewind_and_recompute):
    # r1's tainted blocks hold no prefix, so its node before the forgotten one was held by
    # that child alone; forget let go of it (out of the table) while r1 still listed it,
    # and the rewind to it then held a node outside the table: KeyError in unhold
    from test_groups_state_machine import HybridMachine

    class Draws:
        def __init__(self, *vals):
            self.vals = list(vals)

        def draw(self, strategy):
            return self.vals.pop(0)

    machine = HybridMachine()
    machine.setup()
    r1 = machine.add_known_prefix(0, 0)
    r2 = machine.fork(r1)
    machine.step(Draws([r1], [0]))
    machine.free(r2)
    machine.rewind_past_released(r1, 0, [0, 0])
    machine.consistent()
    machine.rewind_and_recompute(r1, 1)  # before: KeyError
    machine.consistent()
    machine.hits_hold_sound_kv()
    machine.events_predict_lookup()


LAYOUTS = {"full": (FULL,), "full+window": (FULL, sliding_window(8))}


def _spare_chain(groups):
    """a's block 0, b's spare of it and b's block 1 on it; c hits b's block 1 and computes
    its block 2 on it; d's block 1 is a spare of b's (computed on a's sound block 0)."""
    m, mirror = _manager(groups, 40)
    m.add_request("a", [1, 2, 3, 4, 0])
    m.add_request("b", [1, 2, 3, 4])  # no hit (the block holding its last token)
    assert m.append_tokens("b", [0, 5, 6, 7, 8]) is not None  # b's block 1
    assert m.add_request("c", [1, 2, 3, 4, 0, 5, 6, 7, 9, 9, 9, 9, 1]).num_cached_tokens == 8
    assert m.add_request("d", [1, 2, 3, 4, 0, 5, 6, 7]).num_cached_tokens == 4
    ids = {r: m.get_block_ids(r) for r in "abcd"}
    for t in range(len(groups)):
        assert ids["c"][t][:2] == (ids["a"][t][0], ids["b"][t][1])  # c read b's block 1
        assert ids["d"][t][0] == ids["a"][t][0] and ids["b"][t][0] != ids["a"][t][0]
    return m, mirror, ids


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_that_hit_a_block_computed_on_a_failed_spare_loses_its_later_blocks(layout):
    # as the core's test (tests/test_orphans.py): uncache_blocks took the blocks after a
    # named one only from the requests holding a named block, so c's block 2 (computed
    # on b's block 1, computed on b's failed block 0) stayed found: d's spare keeps the
    # prefix of block 1, and with it its child
    groups = LAYOUTS[layout]
    m, mirror, ids = _spare_chain(groups)
    m.uncache_blocks([t[0] for t in ids["b"]])  # the load into b's block 0 failed
    m.check_invariants()
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 9, 9, 9, 9, 0]
    assert m.lookup(prompt) == 8  # d's block 1; before: 12 (c's block 2)
    for g in range(len(groups)):
        assert mirror.announced(g, prompt) == [True, True, False]  # before: c's block 2 too
    m.free("b")
    m.free("c")
    m.check_invariants()
    assert m.add_request("e", prompt).num_cached_tokens == 8  # before: 12
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_chain_of_hits_on_blocks_computed_on_a_failed_one_goes_to_its_end(layout):
    # e hit c's block 2 (itself on b's block 1, on b's failed block 0) and computed its
    # block 3; d's block 2, on its sound block 1, is a spare of c's: the chain is followed
    # until nothing new joins it
    groups = LAYOUTS[layout]
    m, mirror, ids = _spare_chain(groups)
    deep = [1, 2, 3, 4, 0, 5, 6, 7, 9, 9, 9, 9, 3, 3, 3, 3, 1]
    assert m.append_tokens("d", [9, 9, 9, 9, 3]) is not None  # d's block 2
    assert m.add_request("e", deep).num_cached_tokens == 12
    assert m.get_block_ids("e")[0][2] == m.get_block_ids("c")[0][2]
    m.uncache_blocks([t[0] for t in ids["b"]])
    m.check_invariants()
    assert m.lookup(deep[:16] + [0]) == 12  # d's blocks 1 and 2; before: 16 (e's block 3)
    for g in range(len(groups)):
        assert mirror.announced(g, deep[:16]) == [True, True, True, False]
    m.free("e")
    m.check_invariants()
    assert m.add_request("g", deep[:16] + [0]).num_cached_tokens == 12
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_holding_no_failed_block_keeps_what_it_computed(layout):
    # d computed its block 1 on a's sound block 0: the failure of b's spare of it takes
    # b's blocks after it and c's, not d's
    groups = LAYOUTS[layout]
    m, mirror, ids = _spare_chain(groups)
    assert m.append_tokens("d", [2, 2, 2, 2, 2]) is not None  # d's block 2, on d's block 1
    m.uncache_blocks([t[0] for t in ids["b"]])
    m.check_invariants()
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 2, 2, 2, 2, 0]
    assert m.lookup(prompt) == 12
    for g in range(len(groups)):
        assert mirror.announced(g, prompt) == [True, True, True]
    m.free("d")
    m.check_invariants()


def test_a_prefix_lists_its_children_within_a_bound_and_forgets_them_all():
    # forget walks a forgotten prefix's descendants through its children (kids); children
    # that left the table (their blocks evicted) stay listed until the list outgrows
    # twice the prefix's references (as one is listed), then are swept
    m, mirror = _manager([full_attention(), sliding_window(8)], 12)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    m.add_request("a", shared + [0])
    node = m._requests["a"].nodes[1]  # the prefix of block 1, held by a
    for i in range(60):  # a child each under block 1; a small pool evicts the older ones
        m.add_request(i, shared + [100 + i] * 4 + [0])
        assert len(node.kids) <= 20  # (unswept: every child ever, 60; 12 blocks hold few)
        m.free(i)
        m.check_invariants()  # (every child in the table is listed)
    assert m.lookup(shared + [159] * 4 + [0]) == 12
    w, f = m.get_block_ids("a")
    m.uncache_blocks([w[1], f[1]])  # a's load of block 1 failed: every child goes
    m.check_invariants()
    assert m.lookup(shared + [159] * 4 + [0]) == 4
    assert mirror.announced(1, shared + [159] * 4) == [True, False, False]
    m.free("a")
    m.check_invariants()
