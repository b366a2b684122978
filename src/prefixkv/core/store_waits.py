"""``StoreWaits``: the requests waiting on the shared store, and their fetches.

An admission whose prefix continues past the device and host into the store does not
wait for it: ``start`` reserves host slots, hands a ``Fetch`` to the store's fetcher
threads and answers ``StoreWait``. ``poll`` lands each fetch that ended: the run of
blocks that passed the content check (on the fetcher's thread) becomes device content in
the blocks the start took (its slots held the payload until the loads ran), or, when the
start could take none, takes its host slots as ordinary host content, as if the device
had offloaded it; every other reserved slot is freed. The request's next admission then
takes those blocks, or finds those slots like any host hit (``store_landing.py``). So:

- a fetch that fails, times out or finds nothing lands nothing: the blocks are computed;
- a fetch that ends after its request left (``cancel``) lands all the same (cached);
- a fetch past its deadline releases its request at ``poll`` (it computes), while its
  slots stay reserved until the fetcher returns them (no thread writes into a slot
  that something else holds);
- a fetch that loses a race lands only what still continues the chain: blocks whose
  content the device or host got meanwhile are not landed twice, and a run whose
  prefix left the device and host meanwhile is not landed at all;
- a fetch delivered twice is landed once;
- a fetch holding a device block whose KV is declared invalid (``uncache_blocks``,
  ``rewind``) gives it up, with every block after it (``store_giveup.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ..errors import check_count
from ..extra_keys import ExtraKeys
from ..results import StoreWait
from ..store.fetch import OK, Fetch, new_fetch
from ..store.link import StoreLink
from ..tiers import HostSlot, HostTier
from .block import Block
from .pool import BlockPool
from .prompt import Prompt
from .request import Request
from .store_fill import unpend
from .store_holds import FetchHolds
from .store_landing import fetch_ready, land, promote
from .store_memory import FetchMemory
from .store_reuse import reuse

GRACE = 0.05
"""Seconds past a fetch's deadline before ``poll`` gives up on it (its threads return by
the deadline; this covers scheduling delays only)."""

_new, _set = object.__new__, object.__setattr__


def store_wait(request_id: Hashable, num_blocks: int) -> StoreWait:
    """``StoreWait(request_id, num_blocks)``, an equal object, its frozen fields written as
    its own ``__init__`` writes them, without the class call's machine code
    (``type_call``, ``slot_tp_init``, a frame pushed from C): a store start runs it for
    this alone, cold after the fetch before it (results/store25-r24.md)."""
    w: StoreWait = _new(StoreWait)
    _set(w, "request_id", request_id)
    _set(w, "num_blocks", num_blocks)
    return w


class StoreWaits:
    """The waits of one manager: ``link`` its store, ``host`` its host tier, ``index`` its
    content index, ``events`` its event sink, ``root`` its chain's root hash."""

    def __init__(self, link: StoreLink, host: HostTier, index: Any, events: Any,
                 block_size: int, root: bytes, pool: BlockPool) -> None:
        self.link, self.host, self.index, self.events = link, host, index, events
        self.pool = pool
        self.held = FetchHolds(pool)  # the device blocks the fetches hold (store_holds.py)
        self.block_size, self.root = block_size, root
        self.waiting: dict[Hashable, Fetch] = {}
        self.given_up: list[Fetch] = []  # waiting fetches left with no valid hit (``store_giveup``)
        self.in_flight = 0  # fetches submitted and not landed
        self.reserved = 0  # their slots (landing in the host tier)
        self.buffers = FetchMemory(link.payload, len(host.slots))  # (the payloads' memory)

    def attach(self, buffers: Sequence[Sequence[memoryview]]) -> None:
        """Fetches read straight into these buffers (``FetchMemory.attach``: raises
        ConfigError, nothing changed, for bad buffers and while fetches are under way)."""
        self.buffers.attach(buffers, self.in_flight)

    def start(self, req: Request, hits: list[Any], chunks: Sequence[bytes], limit: int,
              prompt: Sequence[int] | Prompt | None = None) -> StoreWait | None:
        """Start fetching the blocks after ``hits`` (at most ``limit`` blocks in all) for
        request ``req``, admitted with ``prompt`` (``req.tokens`` encode it: a list of ids
        is kept, and a copy of it, for ``reuse``), when the store is worth asking and
        slots can be reserved; the answer to give, or None (then nothing changed, but
        for an executor that refused the fetch: counted in ``store_errors``, and the
        store is left alone for ``retry_after``, as after a fetch that failed as a
        whole)."""
        link, host, pool = self.link, self.host, self.pool
        first = len(hits)
        if hits:
            kinds = list(map(type, hits))
            d = kinds.count(Block)  # device hits; the run lands on the device when they
            on_device = kinds[:d].count(Block) == d  # come first (the host's go up at the start)
            held = (hits[d:] if on_device  # (then the rest are host slots: no comprehension,
                    else [h for h in hits if type(h) is HostSlot])  # a function made and called)
        else:
            d, on_device, held = 0, True, None
        n = limit - first  # (not ``min``: its keyword parsing is machine code of its own,
        if link.max_fetch < n:  # cold after a fetch: store25-r23.md)
            n = link.max_fetch
        free = len(host._empty) + host._cached.size  # (``num_free``s inline: no property
        if free < n:  # call, a frame pushed from C, cold after a fetch)
            n = free
        if on_device:  # (the pool short: the run lands in host slots alone)
            room = len(pool._empty) - pool._lo + pool._cached.size - (first - d)
            on_device = n < (room - [b.ref_cnt for b in hits[:d]].count(0) if d else room)
        now = link.store.clock()
        if n <= 0 or now < link.quiet_until or not link._worth(n, now):  # (``worth``, inline)
            return None
        if held:  # pinned for this step: no reservation takes a slot the request hits
            host.hold(held)
        slots = host.reserve(n)
        if not slots:
            return None
        index = self.index
        if on_device:  # the device hits held (a reference each), the run's blocks taken,
            # and the block the re-admission's first token after the run opens (``tail``)
            # (``stale``: a pending run's blocks evicted whole keep its ``counted``, cleared
            # here for ``up`` and ``tail``, by the fetcher for the run's: ``store_fill``)
            kept = pool.acquire(hits[:d] if held else hits, 0) if d else []  # (first: a hit
            # is not evicted) then the new blocks: for the host hits, the run's, the tail's
            up, taken = pool.take_split(first - d, len(slots) + 1)
        staged, views = self.buffers.views()
        keys = req.keys  # (the run's extra bytes listed by the fetcher: ``prepare``)
        f = new_fetch(req.request_id, req, first, hits[-1].hash if hits else self.root,
                      chunks, [], slots, [], now + link.store.timeout, staged, views,
                      keys.of_blocks)
        if hits:
            f.hits, f.hit_cids = hits, [h.content_id for h in hits]
            f.parent_cid = hits[-1].content_id
        if type(prompt) is list:  # (and a copy: the caller may change its list meanwhile)
            f.ids, f.ids_given = prompt[:], prompt
        # the content ids the slots take if they land (ids are never reused: the ones of
        # slots that do not land are lost), so that a fetcher can fill them (``fetch_ready``)
        f.planned = index.new_ids(len(slots))
        f.ready = fetch_ready  # (store_landing.py)
        if on_device:  # (``taken`` becomes the run's list: no copy of it, whose entries
            tail = taken.pop()  # would touch every block, cold; the landing lists the
            tail.counted = None  # request's blocks: ``Fetch.blocks``) (``unpend``, inlined)
            f.tail = [tail]
            if up:  # the host hits' blocks, held after the device hits (empty until
                for b in up:  # the hits go up: below) (``unpend``, inlined)
                    b.counted = None
                kept += up
            f.devices, f.held, f.step, f.index = taken, kept, index.step, index
            f.front = kept[:]  # (a list of its own: ``held`` is not it)
            index.landing[id(f)] = taken
            f.pend = index.pend_counts(keys.mm)
            self.held.holders.add(f)  # (its holds: ``FetchHolds``)
        try:
            link.submit(f, keys.extra)
        except Exception:  # the executor refused (shut down): a fetch failed as a whole
            host.unreserve(slots)
            if on_device:
                del self.index.landing[id(f)]
                unpend(f.devices or ())  # (no fetcher wrote them: their ``counted`` may be stale)
                self.held.release(f)
            link.stats.store_errors += 1
            link.quiet_until = now + link.store.retry_after
            return None
        if on_device:
            if held:  # the host hits go up now (pinned above), as an admission loads them
                promote(f, d, held, chunks[d:first], index, host)  # (a refused fetch
                # gives their blocks back empty: no content of theirs to forget)
            f.losses = index.losses  # (``land``: no walk up to the run while it stays)
        self.waiting[req.request_id] = f
        self.in_flight += 1
        self.reserved += len(slots)
        w: StoreWait = _new(StoreWait)  # (``store_wait``, inline: no frame, cold)
        _set(w, "request_id", req.request_id)
        _set(w, "num_blocks", len(slots))
        return w

    def take(self, request_id: Hashable) -> Fetch | StoreWait | None:
        """At a re-admission: the request's fetch once it ended (``cancel`` it once the
        request is admitted), ``StoreWait`` while it runs, None when the request waits on
        nothing."""
        f = self.waiting.get(request_id)
        if f is None or f.ended or f.expired:
            return f
        return store_wait(request_id, len(f.slots))

    def reuse(self, f: Fetch, prompt: Sequence[int] | Prompt,
              extra: ExtraKeys | None) -> tuple[Request, list[Any], int] | None:
        """At the re-admission of ``f``'s request with ``prompt`` and ``extra``: the
        request as the start made it, the hits ``index.match`` would find now and how many
        of them are device blocks, without walking the index, when nothing it would find
        has moved; else None (``store_reuse.reuse`` says when). Changes nothing. Raises
        TokenError for a prompt the walk's encoding refuses."""
        return reuse(f, prompt, extra, self.index, self.host, self.block_size)

    def cancel(self, request_id: Hashable, taken: bool = False) -> bool:
        """The request was admitted, or left while it waited: forget the wait (its fetch
        still lands). Whether it waited. ``request_id`` is hashable. ``taken``: the
        request took the blocks its fetch held (the device hits and the landed run: the
        re-admission's ``reuse``); else a fetch that ended gives them back now, and one
        that runs still when it lands."""
        f = self.waiting.pop(request_id, None)
        if f is None:
            return False
        if taken:  # (the request holds them: the fetch holds nothing; its lists are
            self.link.retire(f, f.devices)  # freed off this thread: ``StoreLink.retire``)
            self.held.taken(f)
        else:
            self.held.give_back(f)
        return True

    def leave(self, request_id: Hashable, num_computed_tokens: int | None) -> Request | None:
        """``free`` or ``preempt`` of ``request_id``: when it waits, forget the wait (it
        holds nothing; its fetch still lands, as cached content, and frees the slots that
        got nothing) and return the request as the start made it (its tokens); else None,
        with nothing changed (also for an id that cannot be looked up: the caller's
        lookup of live requests raises for it). Raises RequestError, with nothing
        changed, for a waiting request and a ``num_computed_tokens`` other than None or
        0 (nothing of it was scheduled)."""
        try:
            f = self.waiting.get(request_id)
        except Exception:  # (unhashable, or its __eq__ raised: not ours to judge)
            return None
        if f is None:
            return None
        if num_computed_tokens is not None:
            check_count("num_computed_tokens", num_computed_tokens, 0, 0)
        self.cancel(request_id)
        return f.req  # type: ignore[no-any-return]

    def poll(self) -> list[Hashable]:
        """Land the fetches that ended; the ids of waiting requests whose wait is over
        (landed, or past the deadline), in that order."""
        out = []
        done, now = self.link.done, self.link.store.clock()
        while done:
            f = done.popleft()
            if f.ended:  # delivered twice
                continue
            f.ended = True
            self.in_flight -= 1
            self.reserved -= len(f.slots)
            if f.stop != OK:  # (a run that ended at a bad or failed value: counted)
                self.link.ended(f, now)
            gone = land(f, self.host, self.index, self.events, self.block_size)  # (store_landing.py)
            if gone:
                self.pool.release(gone)
            if self.waiting.get(f.request_id) is f and not f.expired:
                out.append(f.request_id)
            elif f in self.held.holders:  # (its request left, or computes: past the
                self.held.release(f)  # deadline)
            if not f.devices:
                self.held.holders.discard(f)
        if self.given_up:  # (their requests compute: ``store_giveup.py``)
            out += [f.request_id for f in self.given_up if self.waiting.get(f.request_id) is f]
            self.given_up = []
        for rid, f in self.waiting.items():
            if not f.ended and not f.expired and now > f.deadline + GRACE:
                f.expired = f.late = True  # the request computes; the slots wait for
                # the threads (counted here: ``StoreLink.ended`` counts no late failure)
                self.link.stats.store_errors += 1
                out.append(rid)
        return out
