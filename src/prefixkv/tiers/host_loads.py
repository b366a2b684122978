"""The step's loads (``HostTier`` is a ``SlotLoads``): host slots copied into device
blocks by the plan's one ``BlockLoads``, and when one leaves the plan.

    host hit       --load------> (slot, device block) pairs --take_loads--> BlockLoads
    landed run     --load_ids--'         |
                                         '--unload: the device block lost the content
                                            the load brings (evicted, uncached)

A load is stated for a device block that holds the slot's content from then on (the
index recorded it: ``adopt``, ``land_run``). The load stays in the plan while the block
holds that content, whoever holds the block: a request freed, aborted or preempted
before its step ran leaves its hits findable (their KV is the load's), and a request
may hit them in this step or later. It leaves the plan the moment the block loses that
content: evicted for reuse (a miss's block, a decode's new block, a fork's copy
destination, another load's target), or made unfindable (``uncache``: its KV or a
parent's declared invalid, ``uncache_blocks`` and ``rewind``, a store run given up with
them). So no plan writes a block twice, nor a block the step computes; a reset drops the
step's loads with every slot's content (``clear``).

A load's block is always recorded in its load's step, so an eviction looks only at the
evicted blocks recorded in this step, which ``demote`` skips anyway (the index's
per-block eviction, with events or held spares, asks ``unload`` of all of them: a block
whose content a held spare takes over is not demoted).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import attrgetter, not_

from ..core.block import Block
from ..results import BlockLoads

_BLOCK_ID = attrgetter("block_id")


class SlotLoads:
    """``HostTier``'s loads: ``load_src`` and ``load_dst``, the step's slot ids and the
    device block ids beside them; ``num_loaded``, the loads stated so far (less those
    that left the plan before it was taken)."""

    slots: list[Block]
    up: dict[int, Block]  # slot id -> the device block its content last went up to
    # (tuples while a store run landed on the device is the step's only loads:
    # ``load_ids``; ``take_loads`` hands them out as they are)
    load_src: list[int] | tuple[int, ...]
    load_dst: list[int] | tuple[int, ...]
    num_loaded: int
    _held: tuple[Sequence[Block], list[int] | None]  # ``hold``'s, for ``load``
    # the device block ids of the step's loads, as a set: built when ``unload`` first
    # needs it in the step, then kept as loads are added (no cost per load before that)
    _loading: set[int] | None

    def load(self, slots: Sequence[Block], devices: Sequence[Block]) -> None:
        """State the copy of each of ``slots`` into the fresh device block beside it in
        ``devices`` (the slots stay pinned until the plan is drained; the caller pinned
        them with ``hold``): their ids join the step's one ``BlockLoads``."""
        held, ids = self._held
        self._held = ((), None)
        if ids is None or held is not slots:
            ids = [s.block_id for s in slots]
        if type(self.load_src) is tuple:  # (a landed run's, both: ``load_ids``)
            self.load_src, self.load_dst = list(self.load_src), list(self.load_dst)
        self.load_src += ids  # type: ignore[operator]  # (lists)
        assert len(ids) == len(devices), (ids, devices)  # (no ``strict``: a keyword C
        self.up.update(zip(ids, devices))  # noqa: B905 (parses on a cold path of its own)
        self.load_dst += map(_BLOCK_ID, devices)  # type: ignore[operator]
        self.num_loaded += len(slots)
        if self._loading is not None:
            self._loading.update(map(_BLOCK_ID, devices))

    def load_ids(self, slot_ids: list[int] | tuple[int, ...],
                 device_ids: list[int] | tuple[int, ...]) -> None:
        """``load`` by ids, for a store fetch's run landed in slots in transit and in the
        device blocks beside them: the ids join the step's one ``BlockLoads``. The
        lists (or tuples, as the fetcher makes them) become the tier's when they are the
        step's first loads (tuples: ``take_loads`` hands them out as they are, no entry
        copied, no list freed; results/store25-r25.md), or lists, the longer ones (the
        step's earlier ids moved in front, no count touched): the caller no longer
        reads them. Unlike ``load``, no ``up`` guess is noted: the slots go empty once
        the loads ran (``transit``), so no content of theirs is ever dropped with that
        guess read (``orphan``)."""
        if self._loading is not None:
            self._loading.update(device_ids)
        src, dst = self.load_src, self.load_dst
        if not src:
            self.load_src, self.load_dst = slot_ids, device_ids
        elif not isinstance(src, list) or not isinstance(dst, list):  # (tuples: joined)
            self.load_src, self.load_dst = [*src, *slot_ids], [*dst, *device_ids]
        elif len(src) < len(slot_ids) and isinstance(slot_ids, list) \
                and isinstance(device_ids, list):
            slot_ids[:0] = src
            device_ids[:0] = dst
            self.load_src, self.load_dst = slot_ids, device_ids
        else:
            src += slot_ids
            dst += device_ids
        self.num_loaded += len(slot_ids)

    def take_loads(self) -> list[BlockLoads]:
        """The step's loads as one op (none when there are none), and forget them."""
        src, dst = self.load_src, self.load_dst
        self.load_src, self.load_dst, self._loading = [], [], None
        return [BlockLoads(tuple(src), tuple(dst))] if src else []

    def unload(self, blocks: Sequence[Block]) -> None:
        """Device ``blocks`` lose their content (evicted, or made unfindable): the step's
        loads into any of them leave the plan (they would write a block that holds
        something else by the time the plan runs, or nothing anyone reads). Per block one
        set probe, in C; the plan is rewritten only when a load is dropped."""
        if not self.load_dst:
            return
        loading = self._loading
        if loading is None:
            loading = self._loading = set(self.load_dst)
        if loading.isdisjoint(map(_BLOCK_ID, blocks)):  # (the common case: no list built)
            return
        dead = loading.intersection(map(_BLOCK_ID, blocks))
        loading -= dead
        src, dst = self.load_src, self.load_dst  # (rewritten in C: no bytecode per load)
        live = list(map(not_, map(dead.__contains__, dst)))
        self.load_src = list(compress(src, live))
        self.load_dst = list(compress(dst, live))
        self.num_loaded -= len(dst) - len(self.load_dst)

    def check_loads(self, devices: Sequence[Block]) -> str | None:
        """The first load whose device block does not hold the content of its slot (a
        dead load: ``unload`` missed it), or a stale set of targets; None when sound. A
        pending run's block (``Run.pending``) holds its content in its run's record.
        (``CopyPlan.check`` finds a block two loads write.)"""
        if self._loading is not None and self._loading != set(self.load_dst):
            return f"the step's load targets {sorted(self._loading)} != {sorted(self.load_dst)}"
        for src, dst in zip(self.load_src, self.load_dst, strict=True):
            b, s = devices[dst], self.slots[src]
            if b.counted is not None and b.counted.pending:
                continue
            if b.key is None or b.twin or b.content_id != s.content_id:
                return f"a load of the plan writes {b!r}, which does not hold slot {s!r}'s content"
        return None
