"""The chained host index: a run of slots offloaded together (children first) keys only
its head; each other slot is found only as its parent slot's ``child``. block_size 4."""

import pytest

from prefixkv import BlockOffloads, BlockStored, ExtraKeys, KVCacheManager
from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier

A = list(range(1, 14))   # blocks A0, A1, A2 + 1 token
B = list(range(20, 33))  # three other blocks + 1


def chained_a(host_blocks=6):
    """A manager whose tier holds A0, A1, A2, offloaded in one batch (A2 first)."""
    m = KVCacheManager(4, 4, seed=0, host_blocks=host_blocks)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)  # evicts A2, A1, A0 (tail first): one demote call
    assert [len(op.src) for op in m.take_kv_ops() if isinstance(op, BlockOffloads)] == [3]
    m.free("b")
    return m, m._host


def chunk(tokens):
    return bytes(KVCacheManager(1, 4)._encode(tokens))


def slots_of(tier, tokens):
    """The slots holding the full blocks of ``tokens`` (found by the walk)."""
    hits = []
    tier.walk(hits, [chunk(tokens[i:i + 4]) for i in range(0, len(tokens) - 3, 4)], 0, b"",
              None, Block(-1))
    return hits


def test_a_chained_runs_head_alone_is_keyed_and_the_walk_finds_the_rest():
    m, tier = chained_a()
    s0, s1, s2 = slots_of(tier, A[:12])
    assert list(tier.by_chunk.values()) == [s0] and not tier.by_key
    assert (s1.chained, s2.chained, s0.chained) == (True, True, False)
    assert s0.child is s1 and s1.child is s2
    assert len(tier) == 3 and tier.num_chained == 2
    assert tier.find(s0.content_id, chunk(A[4:8]), b"") is None  # a probe misses it
    assert m.lookup(A) == 12                                      # the walk does not
    m.check_invariants()


def test_a_loaded_slot_is_keyed_and_keys_its_chained_child():
    m, tier = chained_a()
    s0, s1, s2 = slots_of(tier, A[:12])
    assert m.add_request("d", A[:7]).num_cached_tokens == 4  # A0 loads (hold)
    assert tier.find(s0.content_id, chunk(A[4:8]), b"") is s1   # A0's content is on the
    assert (s1.chained, s2.chained, tier.num_chained) == (False, True, 1)  # device now
    m.check_invariants()
    m.take_kv_ops()
    assert m.lookup(A) == 12
    m.free("d")
    m.check_invariants()


def test_a_recompute_that_takes_a_chained_slots_id_keys_its_child():
    m, tier = chained_a()
    s0, s1, s2 = slots_of(tier, A[:12])
    m.add_request("d", A, read_cache=False)  # recomputes A0, A1, A2 on the device
    d = m._requests["d"].blocks
    assert [b.content_id for b in d[:3]] == [s0.content_id, s1.content_id, s2.content_id]
    assert not s1.chained and not s2.chained  # (B's run, evicted for d, is chained now)
    assert tier.find(s1.content_id, chunk(A[8:12]), b"") is s2
    m.check_invariants()
    m.take_kv_ops()
    m.free("d")
    assert m.add_request("e", B).num_cached_tokens == 12  # B loads; it evicts A's blocks,
    assert [op for op in m.take_kv_ops() if isinstance(op, BlockOffloads)] == []  # whose
    assert len(tier) == 6  # slots are refreshed: no second slot for one content
    m.check_invariants()


@pytest.mark.parametrize("on_device", [False, True])
def test_evicting_a_parent_slot_keys_its_chained_child_or_withdraws_it(on_device):
    """s0's content (1) leaves its slot: its chained child s1 is keyed when the device
    holds content 1 (the block it last went up to, ``up``), else no lookup can reach it:
    it is withdrawn, its slot empty."""
    tier = HostTier(3, EventLog(0))
    blocks = []
    for i, c in enumerate([b"a0", b"a1", b"a2"]):
        b = Block(i, key=c, parent_cid=i, content_id=i + 1)
        blocks.append(b)
    tier.demote(blocks[::-1], 1)
    tier.end_step()
    s2, s1, s0 = tier._cached  # the LRU order: children first
    assert (s1.chained, s2.chained) == (True, True) and s0.child is s1
    tier._cached.remove(s1)  # (no eviction makes a chained slot outlive its parent's slot:
    tier._cached.append(s1)  # the order is forced here, the rule holds anyway)
    if on_device:
        tier.on_device(s0, Block(9, key=b"a0", content_id=1))
    tier.demote([Block(7, key=b"x", parent_cid=0, content_id=10),
                 Block(8, key=b"y", parent_cid=0, content_id=11)], 2)  # take s2, then s0
    assert tier.check() is None and tier.num_chained == 0
    if on_device:
        assert tier.find(1, b"a1", b"") is s1 and len(tier) == 3
    else:
        assert tier.find(1, b"a1", b"") is None and s1.key is None and s1 in tier._empty
        assert len(tier) == 2


def test_a_run_ends_at_a_block_whose_slot_is_refreshed():
    tier = HostTier(4, EventLog(0))
    a0, a1 = Block(0, key=b"a0", parent_cid=0, content_id=1), Block(1, key=b"a1", parent_cid=1, content_id=2)
    tier.demote([a0], 1)
    tier.end_step()
    tier.demote([a1, a0], 2)  # a0's slot is refreshed: a1's new slot is keyed, not chained
    assert tier.num_chained == 0 and tier.find(1, b"a1", b"") is not None
    assert tier.check() is None


def run_of_three(tier, events=False):
    """Offload contents 1 <- 2 <- 3 (a0, a1, a2) in one batch, children first; their slots."""
    blocks = [Block(i, key=c, parent_cid=i, content_id=i + 1, hash=bytes([i]) * 4,
                    event=BlockStored([bytes([i]) * 4], None, bytes(16), [i], None, i)
                    if events else None)
              for i, c in enumerate([b"a0", b"a1", b"a2"])]
    tier.demote(blocks[::-1], 1)
    return [tier.find(0, b"a0", b"")] + slots_below(tier)


def slots_below(tier):
    s0 = tier.find(0, b"a0", b"")
    return [s0.child, s0.child.child]


def test_a_run_cut_short_by_pinned_slots_keys_its_last_slot():
    tier = HostTier(2, EventLog(0))
    blocks = [Block(i, key=c, parent_cid=i, content_id=i + 1) for i, c in enumerate([b"a0", b"a1", b"a2"])]
    other = Block(3, key=b"b0", parent_cid=0, content_id=9)
    tier.demote([blocks[2], blocks[1], other], 1)  # a2, a1 take both slots (pinned); b0 is lost
    assert tier.check() is None and tier.num_chained == 1
    assert tier.find(1, b"a1", b"") is not None  # the run's last slot is keyed


def test_slots_whose_ancestor_is_lost_in_the_batch_are_withdrawn():
    """a0 is lost (every slot pinned) after its children took slots: kept, they were
    announced and never found (their parent's content, computed again, gets a new id)."""
    tier = HostTier(2, EventLog(100))
    blocks = [Block(i, key=c, parent_cid=i, content_id=i + 1) for i, c in enumerate([b"a0", b"a1", b"a2"])]
    for b in blocks:
        b.hash, b.event = bytes([b.content_id]) * 4, BlockStored((bytes([b.content_id]) * 4,), None,
                                                               b"", (b.block_id,), None, 0)
    tier.demote(blocks[::-1], 1)
    assert tier.check() is None and tier.num_free == 2 and tier.take_offloads() == []
    assert tier.find(1, b"a1", b"") is None and tier.find(2, b"a2", b"") is None
    events = tier._sink.take()
    stored = [e.block_hashes for e in events if isinstance(e, BlockStored)]
    removed = [e.block_hashes for e in events if not isinstance(e, BlockStored)]
    assert stored == [(b"\x03" * 4,), (b"\x02" * 4,)] and removed == [(b"\x02" * 4,), (b"\x03" * 4,)]


class _Sliced(list):
    """A list that records the slices taken of it and the positions read alone."""

    def __init__(self, items):
        super().__init__(items)
        self.slices = []
        self.reads = []

    def __getitem__(self, k):
        (self.slices if isinstance(k, slice) else self.reads).append(k)
        return super().__getitem__(k)


def test_a_step_that_offloads_first_blocks_alone_does_not_list_the_lost_ones():
    """The orphan check asks whether a lost content is the parent of a slot the step
    filled; a first block's parent (0) is no content. With one slot free, the first
    block b0 takes it and a run's 64 blocks are lost: none of them is looked at (a
    2048-block store hit's start listed 2047 content ids for this, issue 25)."""
    tier = HostTier(2, EventLog(0))
    tier.reserve(1)  # one slot left
    run = [Block(10 + i, key=bytes([i]) * 2, parent_cid=100 + i, content_id=101 + i)
           for i in range(64)][::-1]
    first = Block(9, key=b"b0", parent_cid=0, content_id=99)
    blocks = _Sliced([first] + run)
    tier.demote(blocks, 1)
    assert tier.offload_src == [9] and tier.find(0, b"b0", b"") is not None
    assert blocks.slices == [] == blocks.reads and tier.check() is None
    tier = HostTier(2, EventLog(0))
    tier.reserve(1)
    sliced = _Sliced([Block(9, key=b"c0", parent_cid=1, content_id=98)] + run)  # not first:
    tier.demote(sliced, 1)  # its parent (content 1) might be lost: they are looked at
    assert tier.offload_src == [9] and sliced.reads == list(range(1, 65))
    assert tier.check() is None


def test_a_lost_parent_in_the_manager_leaves_no_announced_orphan_in_the_tier():
    """The pool evicts A2, A1, A0 into a tier of two slots: A0 is lost. A prompt that
    computes A0 again must not find, nor be told of, A1 and A2 (kept, they were
    announced CPU blocks whose parent's content came back under a new id: a router
    mirroring the events counted 3 blocks where ``lookup`` found 1)."""
    m = KVCacheManager(4, 4, seed=0, host_blocks=2, enable_events=True)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)  # evicts A2, A1 (slots), then A0 (lost)
    m.take_kv_ops()
    m.free("b")
    m.check_invariants()
    assert m.lookup(A) == 0 and len(m._host) == 0
    mirror = set()
    for e in m.take_events():
        for h in e.block_hashes:
            (mirror.add if isinstance(e, BlockStored) else mirror.discard)(h)
    assert len(mirror) == 3  # B0, B1, B2 on the device; nothing of A


def test_a_slot_taken_for_a_fetched_block_drops_its_chain_link():
    tier = HostTier(3, EventLog(0))
    s0, s1, s2 = run_of_three(tier)
    tier.end_step()
    tier._cached.remove(s1)  # (forced order, as above: s2, s0, s1)
    tier._cached.append(s1)
    landing = tier.reserve(2)  # takes s2 (chained), then s0: s1 is under content 1,
    assert landing == [s2, s0] and tier.check() is None  # which no tier holds: withdrawn
    assert s1.key is None and tier._empty == [s1]
    tier.land([s2, s0], 0, [b"x", b"y"], [b"", b""], [10, 11], [b"h" * 4, b"i" * 4], None)
    assert tier.check() is None and tier.num_chained == 0 and tier.find(1, b"a1", b"") is None
    assert tier.find(0, b"x", b"") is s2 and s2.child is s0  # a landed run, keyed


def test_slots_reserved_for_a_fetch_drop_their_content_announced_and_keyed_children_stay():
    tier = HostTier(3, EventLog(100))
    s0, s1, s2 = run_of_three(tier, events=True)     # a0 <- a1 <- a2: a1, a2 chained
    tier.end_step()
    tier._sink.take()
    assert tier.reserve(2) == [s2, s1]               # the LRU order: a2 first, then a1
    gone = tier._sink.take()
    assert [(type(e).__name__, e.block_ids, e.block_hashes) for e in gone] == [
        ("BlockRemoved", (s2.block_id,), (b"\x02" * 4,)),
        ("BlockRemoved", (s1.block_id,), (b"\x01" * 4,))]
    assert tier.check() is None and tier.num_chained == 0 and len(tier) == 1
    assert tier.find(0, b"a0", b"") is s0 and tier.reserve(5) == [s0]   # pinned ones stay
    tier.unreserve([s2, s1, s0])
    assert tier.check() is None and len(tier) == 0 and tier.num_free == 3


def test_the_snapshot_announces_chained_slots_too():
    tier = HostTier(3, EventLog(100))
    run_of_three(tier, events=True)
    assert tier.num_chained == 2
    assert [e.block_hashes for e in tier.snapshot()] == [(bytes([i]) * 4,) for i in range(3)]


def test_a_lookup_with_triple_keys_on_the_device_walks_a_slots_chained_child():
    m = KVCacheManager(8, 4, seed=0, host_blocks=8)
    m.add_request("s", [1, 2, 3, 4, 9], extra=ExtraKeys(cache_salt="a"))
    m.add_request("u", [1, 2, 3, 4, 9])  # the same token bytes: keyed by its triple
    assert m._index._by_key  # (so ``match`` takes its general loop, not the host walk)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)  # evicts A2, A1 (A0 is u's block): A2 chained under A1's slot
    m.free("b")
    assert m._host.num_chained == 1
    assert m.lookup(A) == 12
    m.check_invariants()


def test_a_filled_landing_whose_chunk_a_slot_holds_is_keyed_by_content():
    from prefixkv.tiers.host_landing import fill_landing

    tier = HostTier(3, EventLog(0))
    [s0] = tier.reserve(1)
    tier.land([s0], 0, [b"x"], [b""], [10], [b"h" * 4], None)        # x under the root
    tier.end_step()
    landing = tier.reserve(2)                        # the empty slots
    fill_landing(landing, 5, [b"", b""], [11, 12], [b"i" * 4, b"j" * 4])
    tier.land(landing, 7, [b"x", b"y"], [b"", b""], [11, 12], [b"i" * 4, b"j" * 4], None,
              filled=True, unique=True)              # x again, under content 7
    assert tier.check() is None
    assert tier.find(0, b"x", b"") is s0 and tier.find(7, b"x", b"") is landing[0]
    assert landing[0].key == (7, b"x", b"") and tier.find(11, b"y", b"") is landing[1]


def test_reserving_plain_slots_drops_chunk_and_content_keys():
    tier = HostTier(3, EventLog(0))                  # no events, nothing chained
    landing = tier.reserve(3)
    tier.land(landing, 0, [b"x", b"x", b"y"], [b"", b"", b""], [1, 2, 3], [b"h"] * 3, None)
    tier.end_step()
    assert len(tier.by_key) == 1 and tier.num_chained == 0
    again = tier.reserve(2)                          # the two least recently used: a
    assert again == landing[:0:-1] and tier.check() is None  # landed run's, leaves first
    assert not tier.by_key and list(tier.by_chunk) == [b"x"]   # (y's chunk key, x's triple)
    assert tier.find(1, b"x", b"") is None and tier.find(2, b"y", b"") is None
    assert tier.find(0, b"x", b"") is landing[0]
    tier.unreserve(again)
    assert tier.check() is None and tier.num_free == 3 and len(tier) == 1


def test_the_check_counts_landing_slots():
    tier = HostTier(3, EventLog(0))
    landing = tier.reserve(2)
    assert tier.check() is None and tier.num_landing == 2
    tier.num_landing = 1                             # a slot lost from every list
    assert "2 host slots are in no list, 1 are landing" in tier.check()
    tier.num_landing = 2
    landing[0].chained = True                        # a landing slot must be findable by nothing
    assert "bad landing host slot" in tier.check()


def test_a_slot_is_pinned_once_however_often_it_is_held():
    tier = HostTier(2, EventLog(0))
    [s] = tier.reserve(1)
    tier.land([s], 0, [b"x"], [b""], [1], [b"h"], None)
    tier.hold([s])                                   # landed in this step: pinned already
    assert s.ref_cnt == 1 and tier._pinned == [s] and tier.check() is None
    tier.end_step()
    tier.hold([s])                                   # cached: leaves the LRU, pinned
    tier.hold([s])
    assert s.ref_cnt == 1 and tier._pinned == [s] and tier.check() is None
    s.ref_cnt = 2                                    # a pin counted twice
    assert "bad pinned host slot" in tier.check()


def test_the_check_reports_a_slot_counted_through_a_run():
    """The tier writes a slot's ``refs`` itself (no property call): a slot that a run
    counted would be miscounted, so ``check`` names it."""
    from prefixkv.core.run import RunCounts, new_run
    tier = HostTier(2, EventLog(0))
    assert tier.check() is None
    tier.slots[1].counted = new_run([tier.slots[1]], b"xy", b"", 0, 0, RunCounts(), 0)
    assert "counted through a run" in tier.check()


def test_slots_in_transit_are_pinned_keyless_then_empty():
    """A store run that lands in device blocks leaves its slots in transit: pinned until
    the plan is drained (or its copies reported done), in no map, then empty."""
    tier = HostTier(3, EventLog(0))
    slots = tier.reserve(2)
    tier.transit(slots)
    assert tier.check() is None and tier.num_free == 1 and len(tier) == 0
    slots[0].key = b"x"                             # content in transit: found by nothing
    assert "in transit" in tier.check()
    slots[0].key = None
    tier.end_step(pending=True)                     # the copies run
    assert tier.check() is None and tier.num_free == 1
    tier.copies_done()
    assert tier.check() is None and tier.num_free == 3 and not any(s.ref_cnt for s in slots)


def test_two_runs_in_transit_in_one_step_leave_the_first_runs_list_as_it_was():
    """``transit`` keeps the first run's list itself (no copy: each entry copied touches
    a cold slot, store-r17.md); a second run in the same step joins a new list, so the
    caller's (a store fetch's ``slots``) is never grown in place."""
    tier = HostTier(5, EventLog(0))
    first, second = tier.reserve(2), tier.reserve(2)
    tier.transit(first)
    assert tier._transit is first
    tier.transit(second)
    assert len(first) == 2 and tier._transit == first + second
    assert tier.check() is None and tier.num_free == 1 and len(tier) == 0
    tier.end_step()
    assert tier.check() is None and tier.num_free == 5 and len(first) == 2
