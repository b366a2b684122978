"""The host LRU takes leaves before their parents (hostlru-r18): an eviction that offloads
children into new slots and finds their parent in its slot requeues the parent (and the
slots above it it finds) behind the new slots once they are unpinned, at the step's end or,
for a plan whose copies still run, at ``copies_done``; an admission's ``hold`` pins a
chain last first. Before, the parent's slot was the older one: an offload took it first,
and the children's slots were withdrawn with it (``tiers/host_orphans.py``), host copies
lost. Exact slot ids on bare tiers."""

import pytest

from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier


def block(block_id: int, key: bytes, parent_cid: int, cid: int, step: int = 0) -> Block:
    """An evicted device block with content ``cid`` under ``parent_cid``."""
    return Block(block_id, key=key, parent_cid=parent_cid, content_id=cid, step=step)


def lru(tier: HostTier) -> list[int]:
    return [s.block_id for s in tier._cached]


def prefix(tier: HostTier) -> None:
    """Slots 0, 1: contents 1 and 2 (under 1), offloaded, then loaded (keyed, as the slots
    of content that went up to the device are)."""
    tier.demote([block(5, b"b", 1, 2), block(6, b"a", 0, 1)], 1)
    tier.end_step()
    tier.hold([tier.slots[1], tier.slots[1].child])  # (content 1, then its child: slot 0)
    tier.end_step()
    assert lru(tier) == [0, 1] and len(tier.by_chunk) == 2  # (a chain: leaves first)


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("pending", [False, True])
def test_a_parent_found_by_the_eviction_of_its_children_is_taken_after_them(per_block, pending):
    tier = HostTier(6, EventLog(100))
    prefix(tier)
    tier.demote([block(9, b"z", 0, 9, 2)], 3)                  # slot 2: a bystander
    tier.end_step()
    assert lru(tier) == [0, 1, 2]
    evicted = [block(7, b"d", 3, 4, 2), block(8, b"c", 2, 3, 2),  # new, under content 2
               block(5, b"b", 1, 2, 1), block(6, b"a", 0, 1, 1)]  # found: slots 0, 1
    for batch in ([b] for b in evicted) if per_block else [evicted]:
        tier.demote(batch, 3)
    tier.end_step(pending=pending)
    if pending:
        assert lru(tier) == [2, 0, 1]                          # slots 3, 4 in flight
        tier.copies_done()
    assert lru(tier) == [2, 3, 4, 0, 1] and tier.check() is None
    order = [tier.slots[i].content_id for i in lru(tier)]
    assert order == [9, 4, 3, 2, 1]                            # leaves first, the root last
    tier.demote([block(20 + i, bytes([i]), 0, 20 + i, 2) for i in range(3)], 4)
    assert tier.offload_dst[-3:] == [5, 2, 3]                  # the empty slot, then the LRU's
    assert tier.find(3, b"d", b"") is None and tier.find(2, b"c", b"") is tier.slots[4]
    assert tier.find(1, b"b", b"") is tier.slots[0] and tier.find(0, b"a", b"") is tier.slots[1]
    assert tier.check() is None


def test_a_requeued_slot_taken_again_in_its_step_is_passed_by():
    """A slot requeued by one eviction and taken by a later offload of the same step holds
    another content, pinned until the step's end: ``_move_last`` moves only cached slots
    (their own key's entry), this one once it is unpinned; links and counts stay sound."""
    tier = HostTier(3, EventLog(100))
    prefix(tier)
    tier.demote([block(8, b"c", 2, 3, 2), block(5, b"b", 1, 2, 1), block(6, b"a", 0, 1, 1)], 3)
    assert [s.block_id for s in tier._requeue] == [0, 1]        # slot 2 pinned: content 3
    tier.demote([block(9, b"y", 0, 7, 2)], 3)                  # takes slot 0 (content 2 goes,
    tier.end_step()                                            # slot 2 under it too)
    assert tier.check() is None
    assert tier.find(1, b"b", b"") is None and tier.find(0, b"y", b"") is tier.slots[0]
    assert lru(tier) == [0, 1]



def test_a_parent_found_before_its_childs_plan_is_done_is_taken_after_it():
    """The child's slot is pinned by the plan in flight when the parent is found: the
    child is unpinned (``copies_done``) after the parent's refresh, in a step that pins
    nothing itself; the parent still moves behind it at the step's end."""
    tier = HostTier(4, EventLog(100))
    prefix(tier)                                               # slots 0 (content 2), 1 (1)
    tier.demote([block(7, b"c", 2, 3)], 3)                     # slot 2, under content 2
    tier.take_offloads()
    tier.end_step(pending=True)                                # its copy runs: pinned
    tier.demote([block(5, b"b", 1, 2, 1), block(6, b"a", 0, 1, 1)], 4)  # found: 0, 1
    tier.copies_done()                                         # slot 2 unpinned: the newest
    assert lru(tier) == [0, 1, 2]
    tier.end_step()
    assert lru(tier) == [2, 0, 1] and tier.check() is None
