"""The host-memory tier (L2): slots of host memory that keep content evicted from the
device pool one copy away.

    device pool  --evict (write-back)-->  host slot      BlockOffload(device, slot)
    host slot    --admission hit------->  fresh block    BlockLoad(slot, device)

The tier never moves bytes: it states copies, which the manager hands to the engine with
``take_kv_ops()`` once a step, before that step's forward pass. A slot is *pinned* while a
copy stated for it is pending (it is the source of a load or the target of an offload),
so no later offload in the same plan overwrites it; ``end_step()`` unpins them when the
plan is drained. Like the device index, a slot is found by its content (parent content
id, token bytes, extra bytes) and content ids are the manager's, so a chain can pass from
device blocks to host slots and back. Free slots: an empty stack, then the cached slots in
LRU order (the same two tiers as the pool).
"""

from __future__ import annotations

from dataclasses import replace

from ..core.block import Block
from ..core.free_queue import FreeBlockQueue
from ..events import BlockRemoved, BlockStored
from ..results import BlockLoad, BlockOffload, pair_maker, StoreFetched

_offload, _load = pair_maker(BlockOffload), pair_maker(BlockLoad)

HOST = "CPU"
"""The medium of host slots in events (vLLM's spelling)."""


class HostSlot(Block):
    """A host slot: a Block whose ``block_id`` is the slot index and whose ``ref_cnt``
    counts pending copies (pins). ``key`` is the full content triple."""

    __slots__ = ()


class HostTier:
    """``num_slots`` host slots. ``sink``: where CPU-medium events go."""

    def __init__(self, num_slots: int, sink) -> None:
        self.slots = [HostSlot(i) for i in range(num_slots)]
        self._empty = self.slots[::-1]
        self._cached = FreeBlockQueue()
        self._map: dict[tuple, HostSlot] = {}
        self._sink = sink
        self._pinned: list[HostSlot] = []
        self.offloads: list[BlockOffload] = []
        self.loads: list[BlockLoad] = []
        self.fetches: list[StoreFetched] = []
        self.num_offloaded = self.num_loaded = 0

    def __len__(self) -> int:
        return len(self._map)

    def find(self, parent_cid: int, chunk: bytes, extra: bytes) -> HostSlot | None:
        """The slot holding this content, if any. Changes nothing."""
        return self._map.get((parent_cid, chunk, extra))

    def demote(self, b: Block, chunk: bytes) -> None:
        """``b``'s content is leaving the device (its block is evicted for reuse): keep
        it in a slot, stating the offload copy, unless a slot holds it already (then it
        becomes the most recently used) or every slot is pinned (then it is lost)."""
        key = (b.parent_cid, chunk, b.extra)
        held = self._map.get(key)
        if held is not None:
            if held.prev is not None:  # cached, not pinned: refresh (move to the MRU end)
                cached = self._cached
                cached.remove(held)
                cached.append(held)
            return
        slot = self._take()
        if slot is None:
            return
        slot.key, slot.parent_cid, slot.extra = key, b.parent_cid, b.extra
        slot.content_id, slot.hash = b.content_id, b.hash
        slot.event = None
        self._map[key] = slot
        self._pin(slot)
        self.offloads.append(_offload(b.block_id, slot.block_id))
        self.num_offloaded += 1
        if self._sink.active and b.event is not None:
            slot.event = replace(b.event, block_id=slot.block_id, medium=HOST)  # type: ignore[arg-type]
            self._sink.append(slot.event)

    def room(self, hits: list) -> int:
        """How many slots ``fill`` can take once ``hold`` pinned the slots among ``hits``
        (empty slots, and cached ones not among them). Changes nothing."""
        return len(self._empty) + len(self._cached) - sum(
            1 for h in hits if type(h) is HostSlot and not h.ref_cnt)

    def fill(self, parent_cid: int, fetched, content_id: int, event: BlockStored | None) -> HostSlot:
        """Keep a block fetched from the shared store (``Fetched``) in a slot, pinned,
        stating the write of its payload; ``event`` (any block id) announces it. The
        caller checked ``room``."""
        slot = self._take()
        assert slot is not None, "fill without room"
        slot.key = key = (parent_cid, fetched.chunk, fetched.extra)
        slot.parent_cid, slot.extra = parent_cid, fetched.extra
        slot.content_id, slot.hash, slot.event = content_id, fetched.hash, None
        self._map[key] = slot
        self._pin(slot)
        self.fetches.append(StoreFetched(slot.block_id, fetched.payload))
        if event is not None:
            slot.event = replace(event, block_id=slot.block_id, medium=HOST)
            self._sink.append(slot.event)
        return slot

    def load(self, slots: list[HostSlot], devices: list[Block]) -> None:
        """State the copy of each of ``slots`` into the fresh device block beside it in
        ``devices`` (the slots stay pinned until the plan is drained; the caller pinned
        them with ``hold``)."""
        self.loads += map(_load, [s.block_id for s in slots], [d.block_id for d in devices])
        self.num_loaded += len(slots)

    def hold(self, slots: list[HostSlot]) -> None:
        """Pin ``slots`` (they are about to be loaded), so that no offload stated while
        the device makes room for them can take them."""
        cached, pinned = self._cached, self._pinned
        for s in slots:
            if not s.ref_cnt:
                if s.prev is not None:
                    cached.remove(s)
                pinned.append(s)
            s.ref_cnt += 1

    def _pin(self, slot: HostSlot) -> None:
        if slot.ref_cnt == 0:
            if slot.prev is not None:
                self._cached.remove(slot)
            self._pinned.append(slot)
        slot.ref_cnt += 1

    def end_step(self) -> None:
        """The plan was handed to the engine: unpin, most recently used last."""
        pinned = self._pinned
        for slot in pinned:
            slot.ref_cnt = 0
        self._cached.extend(pinned)
        self._pinned = []

    def _take(self) -> HostSlot | None:
        if self._empty:
            return self._empty.pop()
        if not len(self._cached):
            return None
        slot = self._cached.popleft()
        del self._map[slot.key]  # type: ignore[arg-type]
        if self._sink.active and slot.event is not None:
            self._sink.append(BlockRemoved(slot.hash, slot.block_id, HOST))  # type: ignore[arg-type]
        slot.key = None
        return slot  # type: ignore[return-value]

    def clear(self) -> None:
        """Forget every slot's content (reset_prefix_cache)."""
        for s in self.slots:
            s.key, s.prev, s.next, s.ref_cnt = None, None, None, 0
        self._map.clear()
        self._pinned.clear()
        self._cached = FreeBlockQueue()
        self._empty = self.slots[::-1]

    def snapshot(self) -> list[BlockStored]:
        return [s.event for s in sorted(self._map.values(), key=lambda s: s.content_id)
                if s.event is not None]

    def check(self) -> str | None:
        """The first inconsistency of slots, map, pins and LRU links, None when sound."""
        seen = set()
        for s in self._empty:
            if s.key is not None or s.ref_cnt or s.prev is not None:
                return f"bad empty host slot {s!r}"
            seen.add(s.block_id)
        for s in self._cached:
            if s.key is None or s.ref_cnt or self._map.get(s.key) is not s:
                return f"bad cached host slot {s!r}"
            seen.add(s.block_id)
        for s in self._pinned:
            if not s.ref_cnt or self._map.get(s.key) is not s or s.prev is not None:  # type: ignore[arg-type]
                return f"bad pinned host slot {s!r}"
            seen.add(s.block_id)
        if len(seen) != len(self.slots):
            return f"host slots accounted {len(seen)} != {len(self.slots)}"
        if len(self._map) != len(self.slots) - len(self._empty):
            return f"host map holds {len(self._map)} for {len(self.slots) - len(self._empty)} slots"
        return self._cached.broken_link()
