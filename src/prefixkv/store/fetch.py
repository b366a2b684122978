"""``Fetch``: one request's chain continued into the shared store, read off the
scheduler's thread straight into reserved host slots and checked there.

    scheduler thread                        fetcher threads (``StoreLink``'s executor)
    add_request: reserve host slots,  --->  the slots' buffers, chain hashes, keys,
                 submit, StoreWait          expected heads
                                            read_into, one part per connection: values
                                            land in the slots' buffers, heads apart
                                            check heads, lengths, checksums in place
    poll_store:  land the checked run <---  the last part queues the fetch as done
                 in the slots, free the rest

The fields above the line are the scheduler's, set before the fetch is submitted and
read-only after; those below it are written by the fetcher threads before the fetch is
queued as done, and read by the scheduler only after (the queue orders them).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .mistakes import own_mistake
from .protocol import StoreBackend
from .record import block_head, value_checked

_TAIL = struct.Struct("<Q16s")

YIELD_EVERY = 8
"""Values a fetcher thread handles between two releases of the GIL (``time.sleep(0)``):
the scheduler's thread, which needs the GIL for its calls, then waits for at most that
much Python work instead of the interpreter's switch interval (5 ms)."""

OK, ABSENT, REJECTED, FAILED = range(4)
"""A block's state after its read: checked and served; the store holds no value; a value
that fails the content check (wrong length, head or checksum); the key or the call failed."""

NO_IDS = range(0)
"""No content ids (a range is immutable: every fetch shares this one until its own)."""

_new = object.__new__


class Fetch:
    """A fetch of blocks ``first .. first + len(slots) - 1`` of request ``request_id``
    (``req``: its Request) into host ``slots``, whose payload buffers are ``buffers``
    (``staged``: the manager's own, the payloads then copied by ``StoreFetched``
    ops), or, when ``views`` is given, ``views(slots)``, called by the fetcher (one
    view per slot is per-block work the scheduler's thread need not do). ``parent``:
    the chain hash before block ``first``; ``chunks``/``extras``: the blocks' token and
    extra-key bytes (``chunks`` may be the request's whole list, from block 0: the
    fetcher then takes the run's part of it, on its thread, before anything reads it:
    ``prepare``; it lists ``extras`` there too when ``extras_of`` is given, called with
    the bounds ``first, first + len(slots)``: a list of one entry per block is not made
    on the scheduler's thread). ``deadline``: the ``time.monotonic()`` instant by which
    it ends, whatever the store does. ``hits``/``hit_cids``: the blocks the admission found before
    block ``first`` and the content ids they held then, and ``ids_given``/``ids``: the
    list of token ids it was given, if a list, and a copy (None without one) (the
    scheduler's, for the re-admission's checks that they still do and that it is given
    the same ids). ``ready``: called with the fetch on the fetcher's thread once the
    run is known, before it is queued as done (the manager fills the landing slots
    there: ``filled``, maps the run's token bytes to its slots: ``unique``, ``keyed``,
    lists their ids: ``slot_ids``, and states the staged run's copies: ``fetched``);
    an exception it raises is dropped (``filled`` stays False and the scheduler does
    that work itself).
    Results: ``run`` (blocks from ``first`` that passed the check), ``stop`` (the state
    of the block that ended the run, ``OK`` if none did), ``failed`` (an error of the whole
    call), ``hashes``, ``nbytes``/``seconds`` (measured)."""

    __slots__ = ("request_id", "req", "first", "parent", "chunks", "extras", "slots",
                 "buffers", "views", "staged", "deadline", "started", "ended", "expired", "late", "cids",
                 "hits", "hit_cids", "ids", "ids_given", "planned", "parent_cid", "ready",
                 "landed_at", "hashes", "filled", "unique", "keyed", "slot_ids", "fetched",
                 "keys", "heads", "states", "run", "stop", "failed", "nbytes", "seconds", "left", "lock",
                 "devices", "held", "tail", "blocks", "step", "on_device", "promoted", "device_ids",
                 "pend", "pending_run", "front", "joined", "index", "extras_of", "losses")
    # set by ``prepare`` on the fetcher's thread, not here on the scheduler's: the reads'
    # keys, expected heads and states (emptied by ``finish``; a ``prepare`` that failed
    # leaves ``states`` to its caller), the lock of the parts' count
    keys: list[bytes]
    heads: list[bytes]
    states: list[int]
    lock: threading.Lock

    def __init__(self, request_id: Hashable, req: Any, first: int, parent: bytes,
                 chunks: Sequence[bytes], extras: Sequence[bytes], slots: list[Any],
                 buffers: list[list[memoryview]], deadline: float, staged: bool,
                 views: Callable[[list[Any]], list[list[memoryview]]] | None = None,
                 extras_of: Callable[[int, int], list[bytes]] | None = None) -> None:
        self.request_id, self.req, self.first, self.parent = request_id, req, first, parent
        self.chunks, self.extras, self.slots, self.buffers = chunks, extras, slots, buffers
        self.staged, self.views, self.extras_of = staged, views, extras_of
        self.deadline, self.started = deadline, time.monotonic()
        # landed; its request went on without it (past its deadline, or nothing valid
        # left before its run: ``core/store_giveup.py``); past its deadline at ``poll``
        # (counted in ``store_errors`` then, not again when it fails)
        self.ended = self.expired = self.late = False
        self.cids: range = NO_IDS  # content ids landed (store hits at the re-admission)
        self.hits: list[Any] = []
        self.hit_cids: list[int] = []
        self.ids: list[int] | None = None  # a copy of the token id list the start was given
        self.ids_given: object = None  # that list
        self.planned: range = NO_IDS  # content ids for the slots, given at the start
        self.parent_cid = 0  # the content id before block ``first`` at the start
        self.landed_at = -1  # the host tier's ``num_unpins`` when its run landed in ``slots[0:]``
        self.ready: Callable[[Fetch], None] | None = None
        # landing in device blocks too: the device blocks the run will occupy (one per
        # slot), and the device hits before it, each held (a reference) by the fetch until
        # its request takes them or the fetch gives them back; ``step``: the manager's
        # step at the start, then the one the fetcher wrote the blocks in (``ready``);
        # ``on_device``: how many of ``devices`` landed (findable)
        self.devices: list[Any] | None = None
        self.held: list[Any] = []
        self.tail: list[Any] = []  # an empty block for the prompt's tokens after the run
        # ``held`` and ``devices`` in one list, listed when the run landed whole, while
        # they are exactly what the request takes: its re-admission's blocks
        self.blocks: list[Any] | None = None
        self.step = 0
        # the manager's content index, for a device run: the fetcher reads its ``step``
        # when it writes the blocks (``step`` then: the step they were written in)
        self.index: Any = None
        # the index's count of content losses once the start held its device hits (-1:
        # none held): while it stays, they are what a walk would find (``land``)
        self.losses = -1
        self.on_device = 0
        self.promoted = 0  # host hits that went up to device blocks (the last of ``held``)
        # the index's ``RunCounts`` when the device run may land as one pending run
        # (``index/pending.py``); ``ready`` then records it (``pending_run``), unregistered
        self.pend: Any = None
        self.pending_run: Any = None
        # the held hits as the start took them (never changed), and, for a
        # run filled whole, ``front + devices`` listed by the fetcher (``joined``), which
        # the landing takes as ``blocks`` while ``held`` is still ``front``
        self.front: list[Any] = []
        self.joined: list[Any] | None = None
        # ---- written by the fetcher threads ----
        self.hashes: list[bytes] = []
        self.run, self.stop = 0, OK
        self.failed: Exception | None = None
        self.nbytes, self.seconds = 0, 0.0
        self.left = 0  # parts not read yet
        self.filled = self.unique = False  # set by ``ready``
        self.keyed: dict[bytes, Any] | None = None  # (``ready``'s too)
        self.fetched: list[Any] = []  # (``ready``'s: the run's StoreFetched ops, when staged)
        # (``ready``'s: the run's slots' ids, and its device blocks': tuples for a run
        # landing on the device)
        self.slot_ids: list[int] | tuple[int, ...] = []
        self.device_ids: list[int] | tuple[int, ...] = []


def new_fetch(request_id: Hashable, req: Any, first: int, parent: bytes,
              chunks: Sequence[bytes], extras: Sequence[bytes], slots: list[Any],
              buffers: list[list[memoryview]], deadline: float, staged: bool,
              views: Callable[[list[Any]], list[list[memoryview]]] | None = None,
              extras_of: Callable[[int, int], list[bytes]] | None = None) -> Fetch:
    """``Fetch(...)``, the same object, made without entering the interpreter again from
    C: a class call runs ``type_call`` and ``slot_tp_init`` (argument tuple, method
    lookup, a frame pushed from C), machine code that a store start, the scheduler's
    one caller, runs for this alone, cold after the fetch before it. ``__init__``,
    called as a function, has its frame pushed inline (results/store25-r24.md)."""
    f: Fetch = _new(Fetch)
    Fetch.__init__(f, request_id, req, first, parent, chunks, extras, slots, buffers,
                   deadline, staged, views, extras_of)
    return f


def prepare(f: Fetch, chain: Callable[..., list[bytes]], digest: bytes, block_size: int, prefix: bytes,
            payload_len: int, parts: int) -> list[tuple[int, int]]:
    """The fetcher's first step: chain hashes, keys and heads; returns the parts
    ``(start, stop)`` to read, at most ``parts``."""
    n = len(f.slots)
    if len(f.chunks) != n:  # the request's whole list: the run's part (a copy that touches
        f.chunks = f.chunks[f.first:f.first + n]  # every chunk: not on the scheduler's thread)
    if f.extras_of is not None:  # (a list of n entries: not made on the scheduler's thread)
        f.extras = f.extras_of(f.first, f.first + n)
    f.lock = threading.Lock()  # (before any part is read: the parts share it)
    if f.views is not None:
        f.buffers = f.views(f.slots)
    f.hashes = hashes = chain(f.parent, f.chunks, f.extras)
    f.keys = [prefix + h.hex().encode() for h in hashes]
    parents = [f.parent, *hashes[:-1]]
    f.heads = [block_head(digest, block_size, p, c, e)
               for p, c, e in zip(parents, f.chunks, f.extras, strict=True)]
    f.states = [FAILED] * n
    time.sleep(0)  # (as YIELD_EVERY: the hashing above was Python work)
    # blocks per part, rounded up (``core.block.blocks_for``: the store layer is below it)
    size = -(-n // max(1, min(parts, n)))
    bounds = [(a, min(a + size, n)) for a in range(0, n, size)]
    f.left = len(bounds)
    return bounds


def read_part(f: Fetch, backend: StoreBackend, start: int, stop: int, payload_len: int) -> bool:
    """Read and check blocks ``start .. stop - 1``; True when this was the fetch's last
    part (the caller then queues it as done). Never raises: a failed call fails its
    blocks and is kept in ``failed``."""
    heads = f.heads[start:stop]
    fronts = [bytearray(len(h) + _TAIL.size) for h in heads]
    bufs = [[memoryview(front), *f.buffers[i]]
            for front, i in zip(fronts, range(start, stop), strict=True)]
    try:
        outcomes = backend.read_into(f.keys[start:stop], bufs, f.deadline)
        if len(outcomes) != stop - start:
            raise ValueError(f"the store answered {len(outcomes)} of {stop - start} keys")
    except Exception as exc:
        own_mistake(exc, "StoreBackend.read_into (a store fetch)")
        f.failed = exc
        outcomes = [exc] * (stop - start)
    states = f.states
    for i, outcome, head, front in zip(range(start, stop), outcomes, heads, fronts, strict=True):
        if outcome is True:
            states[i] = OK if value_checked(front, head, f.buffers[i], payload_len) else REJECTED
        elif outcome is None:
            states[i] = ABSENT
        elif isinstance(outcome, int):
            states[i] = REJECTED
        else:
            states[i] = FAILED
        if states[i] != OK:
            break  # the run ends here: what follows in this part is not checked
        if not (i - start + 1) % YIELD_EVERY:
            time.sleep(0)
    with f.lock:
        f.left -= 1
        return f.left == 0


def finish(f: Fetch, payload_len: int) -> None:
    """The last part's step: the run and what ended it, the measured figures. The
    reads' own per-block data (keys, expected heads, states, views of attached memory)
    goes here, on the fetcher's thread: dropped with the fetch on the scheduler's, their
    objects, cold by then, cost that thread a cache miss each (store-r7.md)."""
    run = 0
    for state in f.states:
        if state != OK:
            f.stop = state
            break
        run += 1
    f.run, f.nbytes = run, run * payload_len
    f.seconds = time.monotonic() - f.started
    f.keys, f.heads, f.states = [], [], []
    if not f.staged:  # (attached memory: the views were the reads' only)
        f.buffers = []

