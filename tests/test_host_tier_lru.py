"""HostTier against a plain model of its slots: the batch calls (``demote`` of a whole
eviction, ``hold`` of a whole admission) must give exactly what one block at a time
gives: the same slots offloaded into, the same LRU order, the same pins, the same finds.

The model is the tier's contract written the slow way: a demoted content a slot holds
moves to the most recently used end at once; a new one takes an empty slot, else the
least recently used cached one, else it is lost; content recorded in the current step is
skipped; pinned slots are never taken; ``hold`` pins an admission's slots last first
(its chain's leaves before their parents); ``end_step`` appends the pinned slots, in
pinning order, as the most recently used. Events: a slot that gets a content announced on the
device announces it (medium "CPU"); a slot whose announced content is dropped withdraws it
first.
"""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixkv import BlockOffloads, BlockRemoved, BlockStored
from prefixkv.core.block import Block
from prefixkv.event_log import EventLog
from prefixkv.tiers import HostTier

SLOTS = 4
# (parent content id, token bytes, extra bytes): contents 0, 3 and 5 share token bytes
# (only the parent or the extra bytes tell them apart), so some are keyed by the triple
CONTENTS = [(0, b"aa", b""), (1, b"bb", b""), (1, b"cc", b""), (2, b"aa", b""),
            (2, b"dd", b""), (0, b"aa", b"x"), (3, b"ee", b""), (4, b"ff", b"")]
TOKENS = bytes(16)  # (one block of 4 tokens in every event)
HASH = [bytes([c]) * 4 for c in range(len(CONTENTS))]  # each content's chain hash


class Model:
    def __init__(self) -> None:
        self.empty = list(range(SLOTS))[::-1]
        self.lru: list[int] = []
        self.pinned: list[int] = []
        self.slot_of: dict[int, int] = {}   # content index -> slot
        self.content_of: dict[int, int] = {}
        self.announced: set[int] = set()     # slots whose content has an event
        self.events: list = []

    def demote(self, batch: list[tuple[int, int, bool, bool]]) -> list[tuple[int, int]]:
        offloads = []
        for content, block_id, computed, announced in batch:
            if not computed:
                continue
            s = self.slot_of.get(content)
            if s is not None:
                if s not in self.pinned:
                    self.lru.remove(s)
                    self.lru.append(s)
                continue
            if self.empty:
                s = self.empty.pop()
            elif self.lru:
                s = self.lru.pop(0)
                dropped = self.content_of.pop(s)
                del self.slot_of[dropped]
                if s in self.announced:
                    self.events.append(BlockRemoved((HASH[dropped],), (s,), "CPU"))
            else:
                continue
            self.announced.discard(s)
            if announced:
                self.announced.add(s)
                self.events.append(BlockStored((HASH[content],), None, TOKENS, (s,), None, 0,
                                               "CPU"))
            self.slot_of[content], self.content_of[s] = s, content
            self.pinned.append(s)
            offloads.append((block_id, s))
        return offloads

    def hold(self, contents: list[int]) -> None:
        fresh = []
        for c in contents:
            s = self.slot_of[c]
            if s not in self.pinned:
                self.lru.remove(s)
                fresh.append(s)
        self.pinned += fresh[::-1]  # (an admission's chain, leaves first)

    def end_step(self) -> None:
        self.lru += self.pinned
        self.pinned = []


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(SLOTS, EventLog(10_000))
        self.model = Model()
        self.step = 1
        self.next_block = 0
        self.offloads: list[tuple[int, int]] = []  # the step's, over its demote calls

    def _block(self, content: int, computed: bool, triple: bool, announced: bool) -> Block:
        parent, chunk, extra = CONTENTS[content]
        b = Block(self.next_block)
        self.next_block += 1
        b.key = (parent, chunk, extra) if triple else chunk  # the device's key, either kind
        b.parent_cid, b.extra, b.content_id = parent, extra, 100 + content
        b.step = self.step if not computed else self.step - 1
        b.hash = HASH[content]
        b.event = BlockStored([b.hash], None, TOKENS, [b.block_id], None, 0) if announced else None
        return b

    @rule(batch=st.lists(st.tuples(st.integers(0, len(CONTENTS) - 1), st.booleans(),
                                   st.booleans(), st.booleans()),
                         max_size=6, unique_by=lambda t: t[0]))
    def demote(self, batch):
        blocks = [self._block(*args) for args in batch]
        before = len(self.tier.offload_src)
        self.tier.demote(blocks, self.step)
        got = list(zip(self.tier.offload_src[before:], self.tier.offload_dst[before:], strict=True))
        want = self.model.demote([(c, b.block_id, computed, announced)
                                  for (c, computed, _, announced), b in zip(batch, blocks, strict=True)])
        assert got == want
        assert self.tier._sink.take() == self.model.events
        self.model.events = []
        self.offloads += got

    @rule(data=st.data())
    def hold(self, data):
        held = sorted(self.model.slot_of)
        if not held:
            return
        contents = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True))
        self.tier.hold([self.tier.find(*CONTENTS[c]) for c in contents])
        self.model.hold(contents)

    @rule()
    def end_step(self):
        self.tier.end_step()
        self.model.end_step()
        assert self.tier.take_offloads() == ([BlockOffloads(*map(tuple, zip(*self.offloads, strict=True)))]
                                             if self.offloads else [])
        self.offloads = []
        self.step += 1

    @invariant()
    def same_slots_order_and_pins(self):
        assert self.tier.check() is None
        assert [s.block_id for s in self.tier._cached] == self.model.lru
        assert [s.block_id for s in self.tier._pinned] == self.model.pinned
        for c, content in enumerate(CONTENTS):
            s = self.tier.find(*content)
            assert (s.block_id if s is not None else None) == self.model.slot_of.get(c)
            assert s is None or s.content_id == 100 + c


TestHostTierMachine = HostTierMachine.TestCase


@pytest.mark.parametrize("n", [1, 3, 4, 5])
@pytest.mark.parametrize("empties", [0, 1, 4])
def test_reserve_takes_empty_slots_in_the_order_take_gives_them(n, empties):
    """``reserve`` takes the empty slots first, in the order ``_take`` pops them (all of
    them: the stack itself, reversed in place), then cached ones; the tier's empty stack
    keeps the rest, and a later ``_take`` pops what it would have."""
    def tier():
        t = HostTier(4, EventLog(100))
        t._empty = t._empty[:empties]
        return t
    a, b = tier(), tier()
    got = [s.block_id for s in a.reserve(n)]
    want = [b._empty.pop().block_id for _ in range(min(n, empties))]
    assert got == want and a.num_landing == len(got)
    assert [s.block_id for s in a._empty] == [s.block_id for s in b._empty]
    if a._empty:
        assert a.reserve(1)[0].block_id == b._take().block_id


@pytest.mark.parametrize("before", [0, 1, 3, 5])
def test_load_ids_join_the_steps_loads_in_order(before):
    """``load_ids`` after ``before`` loads stated in the step: one ``BlockLoads``, the
    earlier ids first, whichever list the tier keeps (it takes the caller's longer ones)."""
    t = HostTier(8, EventLog(100))
    t.load_src, t.load_dst = list(range(before)), list(range(100, 100 + before))
    src, dst = [50, 51, 52], [150, 151, 152]
    t.load_ids(src, dst)
    (op,) = t.take_loads()
    assert op.src == (*range(before), 50, 51, 52)
    assert op.dst == (*range(100, 100 + before), 150, 151, 152)
    assert not t.take_loads()
    assert t.up == {}  # (slots in transit: they go empty, no guess of theirs is read)
