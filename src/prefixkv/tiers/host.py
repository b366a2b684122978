"""The host-memory tier (L2): slots of host memory that keep content evicted from the
device pool one copy away.

    device pool  --evict (write-back)-->  host slot      BlockOffloads(devices, slots)
    host slot    --admission hit------->  fresh block    BlockLoads(slots, devices)

The tier never moves bytes: it states copies, which the manager hands to the engine with
``take_kv_ops()`` once a step, before that step's forward pass. A slot is *pinned* while a
copy stated for it is pending (it is the source of a load or the target of an offload),
so no later offload in the same plan overwrites it; ``end_step()`` unpins them when the
plan is drained, or, for a plan whose copies still run while the next step is scheduled
(``end_step(pending=True)``), ``copies_done()`` once the engine reports them done: until
then no reservation (a store fetch's thread writes the slot at once) or offload takes
them. Like the device index, a slot is found by its content (parent content
id, token bytes, extra bytes), keyed by its token bytes and verified against the parent
id and extra bytes (a content whose token bytes another slot's content has is keyed by
the whole triple), or chained under the slot holding its parent's content (see
``host_index``); content ids are the manager's, so a chain can pass from device blocks
to host slots and back. Free slots: an empty stack, then the cached slots in LRU
order (the same two tiers as the pool), leaves before their parents: an admission's
slots are pinned last first, and a slot an eviction finds with slots under it moves
behind the step's new ones when they are unpinned (a parent taken first takes the
slots under it along, ``host_orphans``). The calls take an admission's or an eviction's
blocks at once: one Python loop a batch, no call a block. Evicted content comes down
through ``host_offload`` (``SlotOffload.demote``); store fetches land in slots through
``host_landing`` (``SlotLanding``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import UNLINKED, Block
from ..core.free_queue import FreeBlockQueue
from ..errors import MAX_BLOCKS, check_positive
from ..event_log import EventSink
from ..events import BlockStored
from ..results import BlockOffloads, StoreFetched
from .host_check import check_parents, check_tier
from .host_index import HostSlot
from .host_kids import SlotKids
from .host_landing import SlotLanding
from .host_loads import SlotLoads
from .host_offload import SlotOffload
from .host_orphans import no_device


class HostTier(SlotOffload, SlotLanding, SlotLoads):
    """``num_slots`` host slots. ``sink``: where CPU-medium events go.
    ``by_chunk``/``by_key``: the slots with content, by token bytes and (the rest) by
    content triple; read by the device index's chain walk. Raises ConfigError unless
    ``num_slots`` is an int in ``[1, MAX_BLOCKS]``."""

    def __init__(self, num_slots: int, sink: EventSink) -> None:
        check_positive("num_slots", num_slots, MAX_BLOCKS)
        self.slots = [HostSlot(i) for i in range(num_slots)]
        self._empty = self.slots[::-1]
        self._cached = FreeBlockQueue()
        self.by_chunk = {}
        self.by_key = {}
        self.kids = SlotKids()  # keyed slots by parent content id (``forget_under``)
        self.up = {}  # slot id -> the device block its content last went up to (a guess)
        self.device = no_device  # the device's keyed block for a content (its index sets it)
        self.lent = False  # a recompute took a slot's content id in this step
        self._sink = sink
        self._pinned: list[Block] = []
        self.offload_src: list[int] = []  # the step's offloads: device block ids, slot ids
        self.offload_dst: list[int] = []
        # the step's loads: slot ids, device block ids (tuples: a landed run's alone)
        self.load_src: list[int] | tuple[int, ...] = []
        self.load_dst: list[int] | tuple[int, ...] = []
        self._loading = None  # (their targets as a set, once ``unload`` needs it)
        self.fetches: list[StoreFetched] = []  # the step's payloads to write (no attached memory)
        self._landed = []
        self._held: tuple[Sequence[Block], list[int] | None] = ((), None)  # ``hold``'s, for ``load``
        self.num_landing = 0  # slots a store fetch writes into (the slots nowhere else)
        self._transit = []  # a device run's payload, loaded from these in this step's plan
        self._flight_transit: list[Block] = []  # (and in the plan in flight)
        self.num_offloaded = self.num_loaded = 0
        # how many times pins were released (``end_step``) or content forgotten (``clear``):
        # a slot pinned while it stays the same is pinned still, and holds what it held
        self.num_unpins = 0
        # a plan handed out whose copies still run (``end_step(pending=True)``): its pinned
        # slots, and the ids of those not pinned again since (``hold``)
        self._flight: list[Block] = []
        self._flight_ids: set[int] = set()
        # slots an eviction found holding its content while slots are noted under it (the
        # step's new ones, maybe): moved behind the step's pinned slots once those are
        # unpinned (``_move_last``), so the LRU takes leaves first; for the plan in flight too
        self._requeue: list[Block] = []
        self._flight_requeue: list[Block] = []
        self._above = -1  # the parent content of the last slot requeued (``demote``)
        self._lost_parents = None  # (``demote``'s lost path: ``_pinned_parents``)
        self.num_chained = 0  # slots found only as their parent slot's child
        self.chaining = True  # False once the device cut a chain (``stop_chaining``)
        self.num_emptied = 0  # pinned slots with no content (``forget_under``)

    def take_offloads(self) -> list[BlockOffloads]:
        """The step's offloads as one op (none when there are none), and forget them
        (counted in ``num_offloaded`` now)."""
        self.num_offloaded += len(self.offload_src)
        src, dst = self.offload_src, self.offload_dst
        ops = [BlockOffloads(tuple(src), tuple(dst))] if src else []
        self.offload_src, self.offload_dst = [], []
        return ops

    @property
    def num_free(self) -> int:
        """Slots ``reserve`` could take now (empty, or cached and not pinned)."""
        return len(self._empty) + self._cached.size

    def hold(self, slots: Sequence[Block]) -> None:
        """Pin ``slots`` (they are about to be loaded), so that no offload stated while
        the device makes room for them can take them; a slot pinned already (landed, or
        offloaded into, in this step) stays pinned once. When ``slots`` end with a run
        landed in this step (a store fetch after host hits, or alone), that run is
        neither walked nor listed again: its pins and ids are the landing's."""
        if self.num_chained:  # (none chained, no child either: nothing to key)
            for s in slots:
                c = s.child  # (``on_device``, inlined: their contents go up to the device)
                if s.chained or (c.chained and c.parent_cid == s.content_id):
                    self.on_device(s)
        ids, pin = None, slots
        for run, run_ids in self._landed:  # (each comparison: one C loop of identity checks)
            k = len(slots) - len(run)
            if (slots[k:] == run if k > 0 else not k and slots == run):
                pin = slots[:k]  # the hits before the run (the run is pinned since it landed)
                ids = [s.block_id for s in pin] + run_ids if k else run_ids
                break
        self._held = (slots, ids)
        if not pin:
            return
        fresh = []
        flight = self._flight_ids
        again = []
        for s in pin:
            if not s.refs:  # cached: leaves the LRU (inlined unlink; links go stale)
                prev, nxt = s.prev, s.next
                prev.next = nxt
                nxt.prev = prev
                s.refs = 1
                fresh.append(s)
            elif flight and s.block_id in flight:  # pinned by the plan in flight only:
                flight.discard(s.block_id)  # this step's pin now (``copies_done`` keeps it)
                again.append(s)
        fresh.reverse()  # (unpinned leaves first: children before their parents)
        self._pinned += fresh + again if again else fresh
        self._cached.size -= len(fresh)  # (``forget``, inlined)

    def end_step(self, pending: bool = False) -> None:
        """The plan was handed to the engine: unpin, most recently used last; or,
        ``pending``, keep the plan's slots pinned until ``copies_done`` (the caller sees
        that the previous pending plan was reported done first)."""
        assert not self._flight and not self._flight_ids and not self._flight_transit, \
            "a plan in flight was not reported done"
        self.lent = False
        if pending:
            self._flight, self._flight_ids = self._pinned, {s.block_id for s in self._pinned}
            self._pinned = []
            self._landed = []
            self._flight_transit, self._transit = self._transit, []
            self._flight_requeue, self._requeue = self._requeue, []
            self._above = -1
            return
        if self._transit:
            self._transit_done(self._transit)
            self._transit = []
        pinned = self._pinned
        for slot in pinned:
            slot.refs = 0
        self._cached.extend(self._unpinned(pinned))
        self._pinned = []
        self._landed = []
        self.num_unpins += 1
        if self._requeue:  # (also when nothing was pinned: a plan in flight may have
            self._move_last(self._requeue)  # been unpinned after them, ``copies_done``)
            self._requeue = []
            self._above = -1

    def copies_done(self) -> None:
        """The copies of the plan ended with ``end_step(pending=True)`` are done: unpin its
        slots that this step has not pinned again, most recently used last."""
        done = [s for s in self._flight if s.block_id in self._flight_ids]
        for slot in done:
            slot.refs = 0
        self._cached.extend(self._unpinned(done))
        self._flight, self._flight_ids = [], set()
        if self._flight_requeue:
            if done:
                self._move_last(self._flight_requeue)
            self._flight_requeue = []
        if self._flight_transit:
            self._transit_done(self._flight_transit)
            self._flight_transit = []
        self.num_unpins += 1

    def _move_last(self, slots: list[Block]) -> None:
        """Make each of ``slots`` that is still cached (not pinned, holding the content it
        is found by) the most recently used, in order; the others are passed by. A parent
        refreshed by the eviction that offloaded its children would else be older than
        their slots, unpinned after it: taken first, it takes them along (orphans)."""
        by_chunk, by_key = self.by_chunk, self.by_key
        _, tail = self._cached.ends()
        for s in slots:  # (``remove`` and ``append`` inlined: its count stays)
            key = s.key
            if s.refs or key is None or not s.chained and (
                    by_chunk.get(key) if type(key) is bytes else by_key.get(key)) is not s:  # type: ignore[arg-type]
                continue
            prev, nxt = s.prev, s.next
            prev.next = nxt
            nxt.prev = prev
            last = tail.prev
            last.next = s
            s.prev, s.next = last, tail
            tail.prev = s

    def _transit_done(self, slots: list[Block]) -> None:
        """Slots in transit whose loads ran go empty (reused first: ``reserve`` pops them;
        their counts are 0 already). When the empty stack is empty (the run's fetch took
        it whole: the common case), ``slots`` becomes the stack, not a copy of it: each
        entry copied touches a slot, cold after the fetch (~40 us a 2,048-slot run,
        results/store25-r25.md). The list may be the fetch's ``slots``: nothing reads
        those once its run landed on the device (``store_reuse.reuse``)."""
        if self._empty:
            self._empty += slots
        else:
            self._empty = slots

    def _take(self) -> Block | None:
        """A free slot: an empty one, else the least recently used cached one."""
        return self._empty.pop() if self._empty else self._take_cached()

    def _take_cached(self) -> Block | None:
        """The least recently used cached slot, its content dropped; None when there is
        none (``demote`` inlines it)."""
        slot = self._cached.popleft()
        if slot is None:
            return None
        dropped = [self.orphan(slot)] if slot.content_id in self.kids.by_parent else None
        self._drop(slot)
        if dropped:
            self.cut_off(dropped)
        return slot

    def clear(self) -> None:
        """Forget every slot's content (reset_prefix_cache), and the step's copies not
        taken yet: offloads into slots, loads and store payloads out of them (no block
        is held then). Left in the plan, an offload would write a slot that a store fetch
        of the same step may have reserved and read into (attached memory)."""
        self.num_unpins += 1
        self.offload_src, self.offload_dst, self.load_src, self.load_dst = [], [], [], []
        self._loading = None
        self.fetches = []
        self._landed = []
        for s in self.slots:
            s.key, s.prev, s.next, s.refs, s.chained = None, UNLINKED, UNLINKED, 0, False
        self.num_chained = 0
        self.chaining = True  # (the device's index was cleared too: nothing is cut)
        self.num_emptied = 0
        self.by_chunk.clear()
        self.by_key.clear()
        self.kids.clear()
        self.up.clear()
        self.lent = False
        self._pinned.clear()
        self._flight, self._flight_ids = [], set()
        self._transit, self._flight_transit = [], []
        self._requeue, self._flight_requeue = [], []
        self._above = -1
        self._lost_parents = None  # (``_pinned`` was cleared in place)
        assert not self.num_landing, "clear while a store fetch writes into host slots"
        self._cached = FreeBlockQueue()
        self._empty = self.slots[::-1]

    def snapshot(self) -> list[BlockStored]:
        """The BlockStored events that announced the content the slots hold now, in the
        order that content was first recorded (content id); slots recorded while events
        were off contribute none. For a resynchronisation after dropped events."""
        slots = [s for s in self.slots if s.key is not None]
        return [s.event for s in sorted(slots, key=lambda s: s.content_id) if s.event is not None]

    def check(self) -> str | None:
        """The first inconsistency of slots, maps, pins and LRU links, None when sound."""
        return check_tier(self)

    def check_parents(self, devices: Sequence[Block]) -> str | None:
        """The first slot found under a content that neither ``devices`` (the device
        pool's blocks) nor a slot holds (an orphan: announced, never reached); None when
        there is none."""
        return check_parents(self, devices)
