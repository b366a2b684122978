"""The memory store fetches read payloads into (``StoreWaits`` holds one): the host
slots' own buffers once the engine attached them (``KVCacheManager.attach_host_memory``),
else a staging area of the manager's own, whose payloads the plan's ``StoreFetched``
ops hand to the engine."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise

from ..errors import ConfigError
from .block import Block

Views = Callable[[list[Block]], list[list[memoryview]]]


def _attached(memory: list[list[memoryview]], slots: list[Block]) -> list[list[memoryview]]:
    """The views of ``slots`` in attached ``memory`` (``Fetch.views``: a fetcher calls it)."""
    return [memory[s.block_id] for s in slots]


class FetchMemory:
    """Payload buffers for ``num_slots`` host slots of ``payload`` bytes each."""

    def __init__(self, payload: int, num_slots: int) -> None:
        self.payload, self.num_slots = payload, num_slots
        self.memory: list[list[memoryview]] | None = None  # host slots' bytes, when attached
        # ``_attached`` bound to ``memory``, made once by ``attach``: every fetch started
        # until the next ``attach`` shares it (no ``partial`` made and freed a start)
        self._views: Views | None = None
        self._stage: memoryview | None = None  # else: payloads land here

    def attach(self, buffers: Sequence[Sequence[memoryview]], in_flight: int) -> None:
        """Fetches read straight into these buffers: ``buffers[slot]``, writable byte
        views whose lengths add up to the layout's ``block_bytes``. Raises ConfigError
        (nothing changes) for another number of slots, a size, a read-only or strided
        view, views that share memory (two slots' fetches would write over each other),
        and while fetches are under way (``in_flight`` of them: they read into the
        memory attached when they started: their runs would land where the new memory
        holds no payload)."""
        if in_flight:
            raise ConfigError(f"{in_flight} store fetches are under way: attach host "
                              f"memory once they landed (poll_store)")
        slots, want = self.num_slots, self.payload
        if not isinstance(buffers, Sequence) or isinstance(buffers, (str, bytes, bytearray, memoryview)):
            raise ConfigError(f"host memory must be a list of each slot's views, got {buffers!r}")
        if len(buffers) != slots:
            raise ConfigError(f"host memory for {len(buffers)} slots, the tier has {slots}")
        views = [_slot_views(i, views_i, want) for i, views_i in enumerate(buffers)]
        _check_apart(views)
        self.memory = views
        self._views = partial(_attached, views)

    def views(self) -> tuple[bool, Views]:
        """For a fetch starting now: whether its payloads are staged (no attached memory),
        and what gives a fetcher its slots' buffers (``Fetch.views``). Maps the staging
        area on first use (on the scheduler's thread, before any fetcher reads it)."""
        attached = self._views
        if attached is not None:
            return False, attached
        if self._stage is None:
            self._stage = memoryview(mmap.mmap(-1, self.payload * self.num_slots))
        return True, self._staging

    def _staging(self, slots: list[Block]) -> list[list[memoryview]]:
        """Buffers of the manager's own for ``slots``' payloads, which the plan's
        ``StoreFetched`` ops then copy (without ``attach``; a fetcher thread calls it):
        one area of anonymous memory for every slot, mapped once (by ``views``, on the
        scheduler's thread), whose pages are touched only as fetches write them. A
        slot's buffer is reused only once the slot is reserved again, in a later step
        than the plan that named it."""
        size, area = self.payload, self._stage
        assert area is not None, "views maps the staging area before a fetch is submitted"
        return [[area[s.block_id * size:(s.block_id + 1) * size]] for s in slots]


def _slot_views(i: int, views_i: object, want: int) -> list[memoryview]:
    """Slot ``i``'s views as flat writable byte views of ``want`` bytes in all."""
    if not isinstance(views_i, Sequence) or isinstance(views_i, (str, bytes, bytearray, memoryview)):
        raise ConfigError(f"host slot {i}: a list of writable views, got {views_i!r}")
    try:
        vs = [memoryview(v).cast("B") for v in views_i]
    except TypeError as exc:  # not a buffer, or not C-contiguous
        raise ConfigError(f"host slot {i}: views must be C-contiguous writable buffers ({exc})") from None
    if sum(v.nbytes for v in vs) != want or any(v.readonly for v in vs):
        raise ConfigError(f"host slot {i}: writable views of {want} bytes in all "
                          f"(the StoreLayout's block_bytes), got "
                          f"{[(v.nbytes, 'ro' if v.readonly else 'rw') for v in vs]}")
    return vs


def _check_apart(views: list[list[memoryview]]) -> None:
    """No two views share a byte (each a writable flat view: its address is ctypes')."""
    spans = sorted((ctypes.addressof(ctypes.c_char.from_buffer(v)), v.nbytes, i)
                   for i, vs in enumerate(views) for v in vs if v.nbytes)
    for (a, n, i), (b, _, j) in pairwise(spans):
        if b < a + n:
            raise ConfigError(f"host slots {min(i, j)} and {max(i, j)}: views share memory "
                              f"(each slot's fetches need memory of their own)")
