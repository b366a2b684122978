"""Found by the late-plan state machine with a host tier under a pool of 7 blocks
(``TightHostLatePlanManagerMachine``, 250 examples x 100 steps, ``--hypothesis-seed=36``;
session 16; fixed in session 17: ``tiers/host_orphans.py``). Before the fix, after the
last step the event stream announced both blocks of ``PREFIXES[0][:8]`` (the second in
a host slot, never withdrawn), but ``lookup`` found only the first. The last admission
(``[1, 2, 3, 4]``: a miss, its only block holds the prompt's last token) evicts a device
block whose offload reuses the LRU host slot holding the first block's content (content
id 1, on no device block); the second block's slot is keyed under parent id 1, which
then exists nowhere, and no ``BlockRemoved`` named it (the new block then stores that
content under a fresh id). No wrong KV: a router mirroring the events counted a block
``lookup`` cannot reach. The steps are the machine's, as Hypothesis shrank them."""

from prefixkv import BlockRemoved, BlockStored, ExtraKeys, KVCacheManager
from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier
from test_state_machine import PREFIXES
from test_state_machine_late_plan import TightHostLatePlanManagerMachine

prefixes = PREFIXES
LORA_A = ExtraKeys(lora="a")


def test_a_slot_under_a_content_id_gone_from_every_tier_is_withdrawn():
    state = TightHostLatePlanManagerMachine()
    state.setup()
    state.abort_before_step_ran()
    state.abort_before_step_ran()
    live_0 = state.add_known_prefix(pre=1, tail=0)
    live_1, live_2 = state.a_hit_goes_in_its_step(how='rewind', pre=1, prompt=[0], tail=11)
    (live_3,) = state.a_hit_goes_in_its_step(how='uncache', pre=1, prompt=[0, 0, 0, 11, 12], tail=0)
    (live_4,) = state.add_prepared(chunk=4, extra=LORA_A, prompt=prefixes[0][:8] + [0], times=2)
    state.a_load_fails(extra=None, ok=0, prompt=[0, 0, 0])
    state.free(counted=False, rid=live_1)
    state.append(rid=live_4, toks=[0])
    state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[0, 0], tail=0)
    state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[0, 0, 0], tail=0)
    state.free(counted=False, rid=live_3)
    state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[1, 0, 0, 0, 0, 0, 0, 12, 12], tail=0)
    live_5, live_6 = state.add_prepared(chunk=4, extra=LORA_A, prompt=prefixes[0][:6] + [0,
                                        0, 0, 0, 0, 0, 11, 11], times=3)
    state.preempt(counted=True, rid=live_5)
    state.preempt(counted=True, rid=live_0)
    state.reserve(n=0, rid=live_6)
    state.add_known_prefix(pre=0, tail=0)
    state.abort_before_step_ran()
    live_8 = state.readmit(prepare=False)
    state.free(counted=False, rid=live_6)
    state.preempt(counted=False, rid=live_8)
    state.abort_before_step_ran()
    state.a_load_fails(extra=None, ok=0, prompt=[0, 0, 0, 0, 0, 0, 0, 0, 0])
    live_9 = state.add_known_prefix(pre=0, tail=0)
    (live_10,) = state.add_prepared(chunk=None, extra=None, prompt=[0, 0], times=1)
    state.reset()
    state.readmit(prepare=False)
    state.preempt(counted=False, rid=live_4)
    state.free(counted=False, rid=live_9)
    live_11 = state.readmit(prepare=True)
    state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[0], tail=0)
    state.free(counted=True, rid=live_11)
    state.reserve(n=0, rid=live_10)
    (live_12,) = state.fork_fill_free(counted=False, fill_child=False, gone='',
     parent=live_10, prompt=None, tok=0)
    (live_13,) = state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[11], tail=0)
    (live_14,) = state.fork_fill_free(counted=False, fill_child=True, gone='cp',
     parent=live_12, prompt=prefixes[2][:6] + [0, 0, 0, 0, 0, 0, 12, 12], tok=0)
    state.reset()
    state.free(counted=False, rid=live_13)
    state.add_known_prefix(pre=0, tail=0)
    state.a_hit_goes_in_its_step(how='free', pre=0, prompt=[9, 0, 0, 0, 0, 0, 0, 0, 0], tail=0)
    state.abort_before_step_ran()
    state.free(counted=False, rid=live_14)
    state.readmit(prepare=False)
    state.add(chunk=None, extra=None, prompt=[1, 2, 3, 4])
    state.events_predict_lookup()


def test_an_offload_takes_a_child_slot_before_the_parent_slot_refreshed_with_it():
    """A0 comes up from slot 0 and A1 is computed on it; one eviction then offloads A1
    into slot 3 (keyed under A0's content id, 1) and finds A0 in slot 0. Before
    (orphan-r17's open risk, fixed by hostlru-r18), slot 0 was refreshed before slot 3
    was unpinned, so it was the older one: a later offload took it, content 1 left every
    tier, and slot 3 was withdrawn with it (two host copies lost for one slot). Now slot
    0 is requeued behind slot 3 at the unpin (``HostTier._move_last``): the leaf goes first,
    and A0 stays a host hit."""
    m = KVCacheManager(3, 4, seed=0, host_blocks=4, enable_events=True)
    h = m._host
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    mirror: set[bytes] = set()

    def step(rid, prompt, free=True):
        m.add_request(rid, prompt)
        m.take_kv_ops()
        events = m.take_events()
        for e in events:
            for x in e.block_hashes:
                (mirror.add if isinstance(e, BlockStored) else mirror.discard)(x)
        if free:
            m.free(rid)
        m.check_invariants()
        return events

    step("a", a[:4] + [99])
    step("b", list(range(20, 28)) + [98])        # evicts A0: slot 0
    step("c", a + [97])                          # A0 loads from slot 0; A1 computed
    step("d", list(range(30, 38)) + [96])        # A1 -> slot 3; A0's slot 0 found
    s0, s3 = h.slots[0], h.slots[3]
    assert (s0.content_id, s0.parent_cid, s3.content_id, s3.parent_cid) == (1, 0, 4, 1)
    assert [s.block_id for s in h._cached] == [1, 2, 3, 0] and m.lookup(a + [0]) == 8
    step("e", [40, 41, 42, 43, 44])              # takes slot 1
    hashes = (s0.hash, s3.hash)
    events = step("f", list(range(50, 59)))      # takes slot 2, then slot 3 (the leaf)
    removed = [(e.block_ids, e.block_hashes) for e in events
               if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed[1:] == [((3,), (hashes[1],))] and [ids for ids, _ in removed] == [(2,), (3,)]
    assert s0.content_id == 1 and len(h) == 4
    assert m.lookup(a + [0]) == 4
    hits = m.stats.host_hits
    step("g", a[:4] + [95], free=False)          # A0 a host hit (before: computed again)
    assert m.stats.host_hits == hits + 4 and h.check_parents(m._pool.blocks) is None
    assert m.lookup(a + [0]) == 4 and [x in mirror for x in hashes] == [True, False]


def test_an_offload_that_takes_a_parent_slot_withdraws_the_child_slot_under_it():
    """P's content (1) went down in step 1 into slot 0, C's (2, under 1) in step 2 into
    slot 1 (the more recent). In step 3, Y takes slot 2 and Z slot 0: content 1 is on no
    device block (none went up from it) and in no other slot, so slot 1 can never be
    reached: withdrawn (announced removed, empty). Before orphan-r17 it stayed announced:
    once P was computed again (a new content id, the same chain hash) a router mirroring
    the events counted it where ``lookup`` found nothing."""
    tier = HostTier(3, EventLog(100))
    tier.demote([announced(5, b"p", 0, 1)], 1)      # slot 0
    tier.end_step()
    tier.demote([announced(6, b"c", 1, 2)], 2)      # slot 1, keyed under content 1
    tier.end_step()
    tier._sink.take()
    tier.demote([announced(7, b"y", 0, 3), announced(8, b"z", 0, 4)], 3)  # slot 2, then 0
    assert tier.check() is None and tier.find(1, b"c", b"") is None
    removed = [(e.block_ids, e.block_hashes) for e in tier._sink.take() if isinstance(e, BlockRemoved)]
    assert removed == [((0,), (b"\x01" * 4,)), ((1,), (b"\x02" * 4,))]
    assert tier._empty == [tier.slots[1]]


def announced(block_id: int, key: bytes, parent_cid: int, cid: int) -> Block:
    """An evicted device block with content ``cid`` (token bytes ``key``), announced."""
    h = bytes([cid]) * 4
    return Block(block_id, key=key, parent_cid=parent_cid, content_id=cid, hash=h,
                 event=BlockStored((h,), None, b"", (block_id,), None, 0))


def test_a_lost_content_takes_an_earlier_steps_slot_under_it():
    """C (content 2, under X's content 1) went down in step 1 into slot 0, whose plan is
    still in flight (pinned); in step 2, Y takes slot 1 and X, evicted, finds every slot
    pinned: content 1 is lost. Slot 0 is under it: withdrawn (announced removed, empty
    once its plan is done). Before, only the step's own offloads under a lost content
    were: slot 0 stayed announced, and nothing could reach it."""
    tier = HostTier(2, EventLog(100))
    tier.demote([announced(5, b"c", 1, 2)], 1)      # slot 0, keyed under content 1
    assert tier.take_offloads()
    tier.end_step(pending=True)                     # its copy still runs: pinned
    tier.demote([announced(6, b"y", 0, 3), announced(7, b"x", 0, 1)], 2)  # y: slot 1; x: lost
    assert tier.check() is None and tier.find(1, b"c", b"") is None
    removed = [(e.block_ids, e.block_hashes) for e in tier._sink.take() if isinstance(e, BlockRemoved)]
    assert removed == [((0,), (b"\x02" * 4,))]
    assert tier.offload_src == [6] and tier.num_emptied == 1
    tier.copies_done()
    assert tier.check() is None and [s.block_id for s in tier._empty] == [0]


def test_a_block_recorded_in_its_step_under_a_slots_id_takes_the_slots_under_it_when_evicted():
    """P's content (1) is in slot 0 and C (2, under 1) in slot 1. In step 2 a recompute
    gives device block d P's content id (``on_device``); an offload then takes slot 0:
    d holds content 1, so slot 1 stays. d, recorded in this step (never computed), is
    evicted in the same step: not offloaded, so content 1 leaves every tier, and slot 1
    is withdrawn."""
    tier = HostTier(3, EventLog(100))
    tier.demote([announced(5, b"p", 0, 1)], 1)      # slot 0
    tier.demote([announced(6, b"c", 1, 2)], 1)      # slot 1, keyed under content 1
    tier.take_offloads()
    tier.end_step()
    tier._sink.take()
    d = Block(9, key=b"p", parent_cid=0, content_id=1, step=2)
    tier.on_device(tier.slots[0], d)                # recomputed under slot 0's id
    tier.demote([announced(7, b"y", 0, 3), announced(8, b"z", 0, 4)], 2)  # slot 2, then 0
    assert tier.check() is None and tier.find(1, b"c", b"") is tier.slots[1]
    assert [e.block_ids for e in tier._sink.take() if isinstance(e, BlockRemoved)] == [(0,)]
    tier.demote([d], 2)                             # recorded in step 2: not offloaded
    assert tier.check() is None and tier.find(1, b"c", b"") is None
    assert [e.block_ids for e in tier._sink.take() if isinstance(e, BlockRemoved)] == [(1,)]
    assert tier._empty == [tier.slots[1]]
