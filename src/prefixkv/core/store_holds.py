"""``FetchHolds``: the device blocks that store fetches hold for their requests
(``StoreWaits``'s part; ``store_giveup.py`` gives up what turns out invalid).

A fetch whose run lands on the device takes at its start, a reference each and in no
request: the device hits it continues and the blocks its host hits went up into
(``Fetch.held``), the blocks its run will occupy (``Fetch.devices``; once it ended, the
first ``Fetch.on_device`` of them are the landed run) and one empty block for the
prompt's tokens after the run (``Fetch.tail``). They end in one of two ways:

    the request's re-admission takes them      ``taken``: the request holds them now
    they go back to the pool                   ``release``: the tail first, then the
                                               run and the hits, each chain's last
                                               block first (as ``free``)

``holders`` lists the fetches that hold any (``StoreWaits.start`` adds each); a fetch
leaves it when it holds nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..store.fetch import Fetch
from .block import Block

if TYPE_CHECKING:
    from .pool import BlockPool


class FetchHolds:
    """The holds of the fetches of one manager, whose blocks come from ``pool``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.holders: set[Fetch] = set()  # fetches holding device blocks

    def taken(self, f: Fetch) -> None:
        """The re-admission of ``f``'s request took the blocks ``f`` held (the request
        holds them now): ``f`` holds none."""
        self.holders.discard(f)
        f.held, f.devices, f.blocks = [], None, None

    def release(self, f: Fetch) -> None:
        """Give the blocks ``f`` holds back to the pool (the tail first, as ``free``)."""
        self.holders.discard(f)
        devices = f.devices
        out = f.tail + f.held[::-1]  # (``tail``: an empty block)
        f.tail = []
        if devices is not None:  # (a fetch that ended holds the blocks of its run alone)
            k = f.on_device if f.ended else len(devices)
            out = devices[k - 1::-1] + out if k else out
        f.held, f.devices, f.blocks = [], None, None
        self.pool.release(out)

    def give_back(self, f: Fetch) -> None:
        """``f`` ended and its request does not take its blocks now (the re-admission
        found the pool short, or the request left): they go back (cached: its run stays
        findable), so that a request the engine leaves waiting holds nothing meanwhile."""
        if f.ended and f in self.holders:
            self.release(f)

    def spare(self, f: Fetch, taken: bool) -> int:
        """At the re-admission of ``f``'s request: how many of the blocks it asks for the
        fetch holds already (``Fetch.tail``, taken at the start for the block that the
        first token after the run opens) when the request takes the fetch's blocks
        (``taken``: ``reuse`` answered); else that block goes back to the pool now,
        before the admission counts the free blocks, and none is."""
        if taken:
            return len(f.tail)
        if f.tail:
            self.pool.release(f.tail)
            f.tail = []
        return 0

    def tail(self, f: Fetch, need: int) -> list[Block]:
        """The ``need`` new blocks of a re-admission that takes ``f``'s blocks: the ones
        ``spare`` counted first, the rest from the pool (the caller checked that it has
        them); a spare block that is not needed goes back."""
        spare, f.tail = f.tail, []
        if need < len(spare):
            self.pool.release(spare[need:])
            return spare[:need]
        return spare + self.pool.take(need - len(spare)) if need > len(spare) else spare

    def holds(self) -> list[Block]:
        """Every device block the fetches hold (a reference each), for the checks."""
        out: list[Block] = []
        for f in self.holders:
            out += f.held + f.tail
            if f.devices is not None:
                out += f.devices if not f.ended else f.devices[:f.on_device]
        return out
