"""Landing a store fetch that ended (``store_waits.py`` starts and polls them).

Two halves, one per thread. ``fetch_ready`` runs on the fetcher's thread once the run
of checked blocks is known: it fills the run's slots with everything the landing would
write but the first slot's key (the run stays unfindable until then). ``land`` runs on
the scheduler's thread at ``poll``: it keys the part of the run that still continues
the request's chain (the device or host may have got a block's content meanwhile, or
the prefix before the run may have left) in its host slots, and frees every other
reserved slot. A run the fetcher did not fill is filled here.

A fetch that also lands in device blocks (``Fetch.devices``: taken at the start, held by
the fetch) has them filled on the fetcher's thread as well (``store_fill.py``): every
block but the first keyed and chained under the one before, under the fresh content ids
of the slots, the first keyless. ``land`` then makes the whole run findable on the
device with one write (``ContentIndex.land_run``) and states the slots' copies into
the blocks (``BlockLoads``, after the plan's ``StoreFetched``): the re-admission takes
the blocks as device hits, with nothing to record, pin or copy. Its slots are in transit
(``HostTier.transit``): the fetcher wrote no key into them, the landing keys none, and they
go empty once the loads ran (the host tier keeps none of the run). The request's host
hits before the run went up at the start (``promote``), into device blocks the fetch
holds: the run continues device hits alone. A run that does not continue the fetch's
held device hits exactly (one given up, a block's content that came meanwhile) lands in
the host slots only, and the blocks go back empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..events import BlockStored
from ..results import StoreFetched
from ..store.fetch import Fetch
from ..tiers import HostTier
from ..tiers.host_index import HOST
from ..tiers.host_landing import fill_landing
from .block import Block
from .request import Request
from .store_fill import emptied, fill_device, fill_pending, unpend

__all__ = ["fetch_ready", "land", "promote"]


def fetch_ready(f: Fetch) -> None:
    """``Fetch.ready``, on the fetcher's thread: fill the run's landing slots
    (``fill_landing``: everything ``land`` would write but the first slot's key, which
    makes the run findable), note whether
    the run's token chunks are distinct (``HostTier.land``'s ``unique``) and, if they
    are and the run lands in host slots alone, map them to the slots (its ``keyed``: a
    dict of the fetch's own, which the scheduler merges into the tier's map when it
    lands the whole run; a device run's slots are keyed only when it lands there alone,
    after a lost race: ``land`` maps them then), list the slots'
    ids (``slot_ids``, for the loads) and, in staging buffers, state the run's copies
    into its slots (``fetched``)."""
    run = f.run
    slots = f.slots[:run]
    if f.devices is None:
        keyed = dict(zip(f.chunks[:run], slots, strict=True))
        f.unique = len(keyed) == run
        f.keyed = keyed if f.unique else None
    else:  # (a device run's slots are keyed only if it lands in them alone, a lost race:
        # no map the landing would free on the scheduler's thread; ``land`` builds it then)
        f.unique = len(set(f.chunks[:run])) == run
    ids = [s.block_id for s in slots]  # (a device run's: tuples, the plan's own when
    f.slot_ids = ids if f.devices is None else tuple(ids)  # they are its only loads:
    fill_landing(slots, f.parent_cid, f.extras[:run], f.planned[:run], f.hashes[:run],
                 f.chunks[:run] if f.devices is None else None)  # (a device run's slots
    # stay keyless: ``land`` puts them in transit, or keys them all if the run lands there alone)
    if f.devices is not None and run:
        devices = f.devices[:run]
        f.device_ids = tuple([b.block_id for b in devices])  # ``HostTier.load_ids``)
        # the blocks are written with the manager's step now, the landing's in the
        # common case (a fetch ends while the engine runs a step, and is landed at the
        # next ``poll_store``): the landing rewrites each block's step only when a step
        # ended between (``_on_device``).
        # Read without a lock, and benign (storerisk-r19; tests/store/
        # test_landing_step.py forces a step's end between this read and the writes):
        # the step is one int that only the scheduler's thread changes, only upwards
        # (``take_kv_ops``), so the value read is at most the landing's; nothing reads
        # these blocks' fields before the landing (held by the fetch, in no map or free
        # queue, the first keyless: nothing finds, evicts or offloads them, and the
        # checks skip ``index.landing``); the landing runs on the scheduler's thread
        # after ``done`` has handed the fetch over (the deque orders these writes
        # before it), compares ``f.step``, the value the blocks were written with, to
        # its own step and writes its own on a difference. So a stale read costs that
        # loop, never a block marked older than the plan that loads it.
        f.step = f.index.step
        if f.pend is not None and run == len(f.devices) and run > 2:  # one pending run
            f.pending_run = fill_pending(devices, f.parent_cid, f.extras[0], f.planned[:run],
                                         f.hashes[:run], f.chunks[:run], f.step, f.pend)
        else:
            fill_device(devices, f.parent_cid, f.extras[:run], f.planned[:run],
                        f.hashes[:run], f.chunks[:run], f.step)
        if run == len(f.devices):  # the request's blocks if it lands whole (``front``:
            joined = f.front + f.devices  # the start's, never changed; ``devices``
            # is changed by nothing while the fetch runs): listed where the blocks were
            # just written, not on the scheduler's thread; grown here by one entry and
            # back (the list keeps the room), so that the re-admission's append of the
            # tail block does not reallocate it (a copy of every entry, cold: 16 KiB at
            # 2048 blocks, measured in benchmarks/results/store25b-r22.md)
            joined.append(None)
            joined.pop()
            f.joined = joined
    if f.staged:  # the run's ``StoreFetched`` ops (new objects: the fetcher's to make)
        f.fetched = [StoreFetched(s.block_id, b[0].toreadonly())
                     for s, b in zip(slots, f.buffers, strict=False)]
        f.buffers = []  # (read by ``land`` only without ``fetched``; freed here: see ``finish``)
    f.filled = True


def land(f: Fetch, host: HostTier, index: Any, events: Any, block_size: int) -> list[Block]:
    """Land the run of ended fetch ``f`` that still continues its request's chain in its
    slots of ``host`` (``index``: the manager's content index, ``events``: its event
    sink), and in its device blocks when it continues its held device hits exactly (the
    start's device hits, and its host hits, which went up at the start: ``promote``)
    (``f.on_device`` then counts the run's blocks); free the other slots. Returns the
    blocks the fetch holds and no longer needs (device blocks emptied, and its hits when no block
    landed on the device), for the pool to take back, tail first. Called once per
    fetch, on the scheduler's thread."""
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
    elif first and f.losses == index.losses and keys.mm is None and len(f.held) == first:
        # no content lost since the start held its device hits (they are the walk's up
        # to the run's block, by identity): the walk's probes of that block alone, on the
        # device after the last hit, then in a slot (a slot under a device block's content
        # is keyed: ``HostTier.on_device``), as below for a run from the first block
        hits = f.held
        chunk, last = chunks[first], hits[-1]
        if index.holds(last, chunk, keys.base) or \
                host.find(last.content_id, chunk, keys.base) is not None:
            hits = index.match(chunks[:end], keys.base, None)
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
    devices, gone = f.devices, []
    keys_filled = devices is None  # (``fetch_ready`` keys the slots of a host run only)
    if devices is not None:
        index.landing.pop(id(f), None)
        # (the host hits went up at the start: ``promote``; identity: blocks are not
        # equal; a fetch that gave up hits holds less than ``first``: ``store_giveup.py``)
        if not (start == first < end and hits == f.held):
            # the run lands in the slots alone, if at all
            gone = f.tail + emptied(devices) + f.held[::-1]
            f.devices, f.held, f.tail, f.blocks = None, [], [], None
            devices = None
    if start < end:
        lo, hi, bs = start - first, end - first, block_size
        parent_cid = hits[-1].content_id if hits else 0
        cids, filled = f.planned[lo:hi], f.filled
        if parent_cid >= cids.start:  # (a parent recorded after the start, which lost
            # the race: new ids, so that a child's id stays above its parent's, the
            # order snapshots announce contents in; the landing fills the slots)
            cids, filled = index.new_ids(hi - lo), False
        f.cids = cids
        if devices is not None:  # (``lo`` is 0: checked above) the run goes on in the
            # device blocks; its slots only hold the payload until the loads ran
            run = slots if hi == len(slots) else slots[:hi]
            if not filled:  # (new ids, or the fetcher did not fill: the loads' sources
                # hold the content ids their blocks get, as ``fill_landing`` writes them)
                fill_landing(run, parent_cid, f.extras[:hi], cids, f.hashes[:hi])
            if events.active:  # (announced on the device alone: ``land_run``)
                _transit_events(f, run, hits, req, start, end, block_size)
            host.transit(run)
            f.keyed = None  # (the fetcher's map: for a run in the slots alone)
            if hi < len(slots):
                host.unreserve(slots[hi:])
            if f.fetched:  # (stated by the fetcher: ``fetch_ready``)
                host.fetches += f.fetched
            elif f.staged:
                host.fetches += [StoreFetched(s.block_id, b[0].toreadonly())
                                 for s, b in zip(run, f.buffers, strict=False)]
            return _on_device(f, devices, hi, cids, filled, parent_cid, hits, run, index, host)
        event = None
        if events.active:
            extra = req.keys.extra
            event = BlockStored(tuple(f.hashes[lo:hi]), hits[-1].hash if hits else None,
                                b"".join(f.chunks[lo:hi]),
                                tuple(s.block_id for s in slots[lo:hi]),
                                None if extra is None else extra.for_range(start * bs, end * bs),
                                start, HOST)
        whole = not lo  # (the fetcher's map and ids are the whole run's: ``hi`` is its end)
        ids = f.slot_ids if whole and type(f.slot_ids) is list and f.slot_ids else None
        if whole and hi == len(slots):  # every reserved slot (the common case): the fetch's
            # own lists, not copies (a copy touches every object it holds, cold by now)
            run, run_chunks, extras, hashes, fetched = slots, f.chunks, f.extras, f.hashes, f.fetched
        else:
            run, run_chunks, extras, hashes, fetched = (
                slots[lo:hi], f.chunks[lo:hi], f.extras[lo:hi], f.hashes[lo:hi], f.fetched[lo:hi])
        host.land(run, parent_cid, run_chunks, extras, cids, hashes, event,
                  filled=filled and keys_filled, unique=f.unique,
                  keyed=f.keyed if whole else None, ids=ids)
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
    return gone


def _transit_events(f: Fetch, run: list[Block], hits: list[Any], req: Request, start: int,
                  end: int, bs: int) -> None:
    """Give the slots in transit ``run`` (blocks ``start..end - 1`` of ``req``) the chain hash
    and one-block event of the content each carries up, which ``ContentIndex.land_run``
    announces on the device (the slots' own run event is never announced: the host tier
    does not keep them)."""
    extra = req.keys.extra
    lo, hi = start - f.first, end - f.first
    hashes = f.hashes[lo:hi]
    event = BlockStored(tuple(hashes), hits[-1].hash if hits else None,
                        b"".join(f.chunks[lo:hi]), tuple(s.block_id for s in run),
                        None if extra is None else extra.for_range(start * bs, end * bs),
                        start, HOST)
    for i, (s, h) in enumerate(zip(run, hashes, strict=True)):
        s.hash = h
        s.event = event.block(i, s.block_id, HOST)


def promote(f: Fetch, d: int, slots: list[Any], chunks: Sequence[bytes], index: Any,
            host: HostTier) -> None:
    """At the start of fetch ``f`` (``StoreWaits.start``, once the executor took it): its
    host hits ``slots``, pinned for this step (``HostTier.hold``), go up to the empty
    device blocks the start took for them, ``f.held[d:]`` (after its ``d`` held device
    hits), as an admission loads host hits (their contents, token bytes ``chunks``,
    recorded in the blocks, chained below ``f.held[d - 1]``; their copies stated in this
    step's loads). The fetch holds them as device hits, so the run lands on the device
    after them whatever the host tier does with the slots meanwhile, and its landing,
    its give-backs and its re-admission see device hits alone. (The fetcher's thread
    reads none of these blocks' fields, nor the index: ``fetch_ready`` lists them
    only.)"""
    held = f.held
    blocks = held[d:]
    index.adopt(blocks, slots, chunks, held[d - 1] if d else None, True)
    host.load(slots, blocks)
    f.promoted = len(blocks)


def _on_device(f: Fetch, devices: list[Block], hi: int, cids: Sequence[int], filled: bool,
               parent_cid: int, hits: list[Any], slots: list[Block], index: Any,
               host: HostTier) -> list[Block]:
    """``land``'s device half: the run's first ``hi`` device blocks findable under the
    last of ``hits`` (the fetch's held device hits), the slots' copies into them stated;
    the device blocks past the run are returned, emptied."""
    run = devices if hi == len(devices) else devices[:hi]
    step = index.step
    pend = f.pending_run
    if pend is not None and (not filled or hi < len(devices) or index.pend_counts(None) is None):
        unpend(devices)  # (new ids, a shorter run, spares since the start: written below)
        pend = f.pending_run = None
        filled = False
    if not filled:  # (new ids, or the fetcher did not fill them)
        fill_device(run, parent_cid, f.extras[:hi], cids, f.hashes[:hi], f.chunks[:hi], step)
    elif f.step != step:  # (copied in by this step's plan: not offloaded before a
        # later one; ``f.step``: the step the fetcher wrote them in, ``fetch_ready``)
        for b in run:
            b.step = step
    index.land_run(run, f.chunks[0], hits[-1] if hits else None, slots, pend)
    f.pending_run = None
    src = f.slot_ids if filled and len(f.slot_ids) == hi else [s.block_id for s in slots]
    dst = f.device_ids if filled and len(f.device_ids) == hi else [b.block_id for b in run]
    host.load_ids(src, dst)  # (the tier's lists now, maybe)
    f.slot_ids, f.device_ids = [], []
    f.on_device = hi
    joined, f.joined = f.joined, None
    if hi == len(devices):  # (``blocks``: the held hits and the whole run, as landed:
        # the fetcher's list while the held hits are still the start's)
        f.blocks = joined if joined is not None and f.held == f.front else f.held + devices
        return []
    f.blocks = None
    return emptied(devices[hi:])
