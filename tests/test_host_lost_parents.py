"""``demote``'s lost path (every slot pinned: the evicted content is lost, and so are
the slots under it) reads the pinned slots' parents once a step, then only the slots
pinned since (``SlotOffload._pinned_parents``, hostlru-r18): before, each call that
lost a content read every pinned slot, so an eviction a block a call (events on) cost
the pinned slots per block (benchmarks/results/hostlru-r18.md). Exact slot ids."""

from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier


def block(block_id: int, key: bytes, parent_cid: int, cid: int, step: int = 0) -> Block:
    """An evicted device block with content ``cid`` under ``parent_cid``."""
    return Block(block_id, key=key, parent_cid=parent_cid, content_id=cid, step=step)


def test_a_lost_content_finds_a_slot_pinned_under_it_after_an_earlier_loss_of_the_step():
    """``demote``'s lost path (every slot pinned) reads the pinned slots' parents once a
    step and then only the slots pinned since (``_pinned_parents``): a slot pinned after
    an earlier loss of the same step, under the content lost now, is withdrawn with it."""
    tier = HostTier(3, EventLog(100))
    landing = tier.reserve(1)                                  # slot 0: a store fetch's
    tier.demote([block(5, b"y", 0, 20), block(6, b"w", 0, 21)], 2)  # slots 1, 2
    tier.demote([block(7, b"z", 0, 30)], 2)                    # lost: every slot pinned
    tier.unreserve(landing)                                    # nothing came: slot 0 empty
    tier.demote([block(8, b"c", 50, 40)], 2)                   # slot 0, under content 50
    assert tier.find(50, b"c", b"") is tier.slots[0]
    tier.demote([block(9, b"p", 0, 50)], 2)                    # lost: content 50 left
    assert tier.find(50, b"c", b"") is None and tier.check() is None
    assert tier.offload_dst == [1, 2]                          # slot 0's offload withdrawn
    tier.end_step()
    assert tier.check() is None and tier.slots[0] in tier._empty


def test_a_lost_content_finds_a_slot_of_the_plan_in_flight_under_it():
    """The parents are read again once the plan in flight is done (another list)."""
    tier = HostTier(2, EventLog(100))
    tier.demote([block(5, b"c", 50, 40)], 2)                   # slot 0, under content 50
    tier.take_offloads()
    tier.end_step(pending=True)                                # its copy runs: pinned
    tier.demote([block(6, b"y", 0, 20, 1)], 3)                 # slot 1
    tier.demote([block(7, b"z", 0, 30, 1)], 3)                 # lost (parents read)
    assert tier.find(50, b"c", b"") is tier.slots[0]
    tier.demote([block(8, b"p", 0, 50, 1)], 3)                 # lost: content 50 left
    assert tier.find(50, b"c", b"") is None and tier.check() is None
    tier.copies_done()
    tier.end_step()
    assert tier.check() is None and tier.slots[0] in tier._empty


def test_a_content_evicted_past_a_loss_but_held_in_a_slot_keeps_the_slots_under_it():
    """Every block after a lost one is passed as lost (``lost``: no slot is looked for
    them), but a content a slot still holds is not gone: the pinned slot under it stays
    (mutants-r28: the ``find`` check of ``_withdraw_orphans``)."""
    tier = HostTier(3, EventLog(100))
    tier.demote([block(5, b"p", 0, 50)], 2)                    # slot 0: content 50
    tier.demote([block(8, b"c", 50, 40)], 2)                   # slot 1, under content 50
    tier.demote([block(6, b"y", 0, 20)], 2)                    # slot 2: every slot pinned
    tier.demote([block(7, b"z", 0, 30), block(9, b"p", 0, 50)], 2)  # 30 lost; 50 held
    assert tier.find(0, b"p", b"") is tier.slots[0]
    assert tier.find(50, b"c", b"") is tier.slots[1] and tier.check() is None
    assert tier.offload_dst == [0, 1, 2]
    tier.end_step()
    assert tier.check() is None and tier.find(50, b"c", b"") is tier.slots[1]
