"""Landing a store fetch that ended (``store_waits.py`` starts and polls them).

Two halves, one per thread. ``fetch_ready`` runs on the fetcher's thread once the run
of checked blocks is known: it fills the run's slots with everything the landing would
write but the first slot's key (the run stays unfindable until then). ``land`` runs on
the scheduler's thread at ``poll``: it keys the part of the run that still continues
the request's chain (the device or host may have got a block's content meanwhile, or
the prefix before the run may have left) in its host slots, and frees every other
reserved slot. A run the fetcher did not fill is filled here.
"""

from __future__ import annotations

from typing import Any

from ..events import BlockStored
from ..results import StoreFetched
from ..store.fetch import Fetch
from ..tiers import HostTier
from ..tiers.host_index import HOST
from ..tiers.host_landing import fill_landing
from .request import Request

__all__ = ["fetch_ready", "land"]


def fetch_ready(f: Fetch) -> None:
    """``Fetch.ready``, on the fetcher's thread: fill the run's landing slots
    (``fill_landing``: everything ``land`` would write but the first slot's key, which
    makes the run findable), note whether
    the run's token chunks are distinct (``HostTier.land``'s ``unique``) and, if they
    are, map them to the slots (its ``keyed``: a dict of the fetch's own, which the
    scheduler merges into the tier's map when it lands the whole run), list the slots'
    ids (``slot_ids``, for the loads) and, in staging buffers, state the run's copies
    into its slots (``fetched``)."""
    run = f.run
    slots = f.slots[:run]
    keyed = dict(zip(f.chunks[:run], slots, strict=True))
    f.unique = len(keyed) == run
    f.keyed = keyed if f.unique else None
    f.slot_ids = [s.block_id for s in slots]
    fill_landing(slots, f.parent_cid, f.extras[:run], f.planned[:run], f.hashes[:run],
                 f.chunks[:run])
    if f.staged:  # the run's ``StoreFetched`` ops (new objects: the fetcher's to make)
        f.fetched = [StoreFetched(s.block_id, b[0].toreadonly())
                     for s, b in zip(slots, f.buffers, strict=False)]
        f.buffers = []  # (read by ``land`` only without ``fetched``; freed here: see ``finish``)
    f.filled = True


def land(f: Fetch, host: HostTier, index: Any, events: Any, block_size: int) -> None:
    """Land the run of ended fetch ``f`` that still continues its request's chain in its
    slots of ``host`` (``index``: the manager's content index, ``events``: its event
    sink); free the other slots. Called once per fetch, on the scheduler's thread."""
    req: Request = f.req
    chunks = req.prompt_chunks  # (kept: the request was never admitted under this object)
    assert chunks is not None, "a fetch of a request without its chunks"
    first, end = f.first, f.first + f.run
    # what the device and host hold now, up to the first fetched block: that block's
    # content may have come meanwhile (then land only past what is there now), or
    # the prefix before it may have left (then the run continues nothing)
    keys = req.keys
    if not f.run:
        hits = []
    elif first or keys.mm is not None:
        hits = index.match(chunks[:first + 1], keys.base, keys.mm)
        if len(hits) > first:
            hits = index.match(chunks[:end], keys.base, keys.mm)
    else:  # a run from the first block: the walk only if its content is held now (one
        # probe of the device, one of the host: a first content is never a chained slot)
        chunk = chunks[0]
        held = (index.holds(None, chunk, keys.base)
                or host.find(0, chunk, keys.base) is not None)
        hits = index.match(chunks[:end], keys.base, None) if held else []
    start = len(hits) if len(hits) >= first else end
    slots = f.slots
    if start < end:
        lo, hi, bs = start - first, end - first, block_size
        parent_cid = hits[-1].content_id if hits else 0
        cids, filled = f.planned[lo:hi], f.filled
        if parent_cid >= cids.start:  # (a parent recorded after the start, which lost
            # the race: new ids, so that a child's id stays above its parent's, the
            # order snapshots announce contents in; the landing fills the slots)
            cids, filled = index.new_ids(hi - lo), False
        f.cids = cids
        event = None
        if events.active:
            extra = req.keys.extra
            event = BlockStored(tuple(f.hashes[lo:hi]), hits[-1].hash if hits else None,
                                b"".join(f.chunks[lo:hi]),
                                tuple(s.block_id for s in slots[lo:hi]),
                                None if extra is None else extra.for_range(start * bs, end * bs),
                                start, HOST)
        whole = not lo  # (the fetcher's map and ids are the whole run's: ``hi`` is its end)
        ids = f.slot_ids if whole and f.slot_ids else None
        if whole and hi == len(slots):  # every reserved slot (the common case): the fetch's
            # own lists, not copies (a copy touches every object it holds, cold by now)
            run, run_chunks, extras, hashes, fetched = slots, f.chunks, f.extras, f.hashes, f.fetched
        else:
            run, run_chunks, extras, hashes, fetched = (
                slots[lo:hi], f.chunks[lo:hi], f.extras[lo:hi], f.hashes[lo:hi], f.fetched[lo:hi])
        host.land(run, parent_cid, run_chunks, extras, cids, hashes, event, filled=filled,
                  unique=f.unique, keyed=f.keyed if whole else None, ids=ids)
        f.keyed = None  # (it may be the tier's map now)
        if not lo:  # (``reuse`` checks ``slots[:len(cids)]``)
            f.landed_at = host.num_unpins
        if fetched:  # (stated by the fetcher: ``fetch_ready``)
            host.fetches += fetched
        elif f.staged:
            host.fetches += [StoreFetched(s.block_id, f.buffers[i][0].toreadonly())
                             for i, s in zip(range(lo, hi), slots[lo:hi], strict=True)]
        if lo or hi < len(slots):
            host.unreserve(slots[:lo] + slots[hi:])
    else:
        host.unreserve(slots)
