"""What a step hands out after its scheduling calls: the plan of KV copies
(``take_kv_ops``, which also ends the step), the KV events and the prefix-cache
statistics: functions ``KVCacheManager``'s body lists (``self`` the manager); growth is
in ``decode.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanError
from ..event_log import PendingEvents
from ..events import AllBlocksCleared, Event
from ..index import ContentIndex
from ..index.announce import Fresh
from ..results import KVOp
from ..stats import PrefixCacheStats
from .block import Block

if TYPE_CHECKING:
    from .manager import KVCacheManager


def take_stats(self: KVCacheManager) -> PrefixCacheStats:
    """Statistics since the previous ``take_stats`` (get-and-reset)."""
    return self._stats.take()


def take_events(self: KVCacheManager) -> list[Event]:
    """Events since the previous call, oldest first (empty unless ``enable_events``).
    At most ``max_events`` are kept between calls: past that, the pending ones are
    dropped (counted in ``events_dropped``) and this call returns ``AllBlocksCleared``
    followed by one ``BlockStored`` per content findable now, so a consumer that
    mirrors the stream is exact again."""
    out = self._events.take()
    return self._restated() if out is None else out


def take_pending_events(self: KVCacheManager) -> PendingEvents:
    """``take_events()``, handed off: what the step recorded, whose chain hashes and
    event objects ``build()`` computes later, on any thread (``EventPublisher.publish``
    takes it and builds it on its own thread, so the scheduler's thread pays for no
    hash). ``build()`` returns exactly the list ``take_events()`` would have returned
    here; batches are built in the order they were taken, each once, whoever builds
    them (a later ``take_events()`` builds the older ones first). A restatement after
    an overflow is built now. Mixing both calls across steps is allowed."""
    pending = self._events.take_pending()
    return PendingEvents.built(self._restated()) if pending is None else pending


def _restated(self: KVCacheManager) -> list[Event]:
    """``AllBlocksCleared`` and one ``BlockStored`` per content findable now."""
    host = self._host.snapshot() if self._host is not None else []
    return [AllBlocksCleared(), *self._index.snapshot(self._pool.blocks), *host]


def take_kv_ops(self: KVCacheManager, *, pending: bool = False) -> list[KVOp]:
    """The step's plan: the copies the engine must run, in this order, after this
    step's scheduling calls and before its forward pass: one ``BlockOffloads`` (all the
    device blocks evicted now whose KV the forward pass would overwrite, into host
    slots), then every ``StorePut`` (blocks computed by an earlier step, to write to
    the shared store), every ``StoreFetched`` (blocks from the store into host
    slots), one ``BlockLoads`` (all the step's host hits into fresh device blocks,
    less those whose block lost that content since: evicted or made unfindable; a
    hit's request freed before its step ran leaves it findable, and its load stays),
    then every ``BlockCopy`` (fork copy-on-write, the same as ``Fork.copies``, a
    closed set: a copy's source and every block a later copy reads are held until the
    plan is taken; a copy into a freed request's block that nothing needs is dropped;
    see ``core.copies``). Call it exactly once a step: it also ends the step
    (content recorded before it counts as computed after it, and what the plan pinned
    is released).

    The host slots the plan reads (``BlockLoads``) and writes (``BlockOffloads``,
    ``StoreFetched``) may be taken again by the next step's scheduling calls: a store
    fetch's thread writes a reserved slot at once, an offload rewrites it. So the
    plan's copies must be done, not only queued, before the next scheduling call;
    an engine that schedules the next step while they run passes ``pending=True``
    and calls ``kv_ops_done()`` once they are done: until then those slots stay
    pinned (no reservation or offload takes them; ``reset_prefix_cache`` returns
    False). Raises PlanError, before anything changes, while a plan taken with
    ``pending=True`` was not reported done, or when ``pending`` is not a bool."""
    if type(pending) is not bool:
        raise PlanError(f"pending must be True or False, got {pending!r}")
    if self._ops_pending:
        raise PlanError("the previous plan was taken with pending=True and its copies "
                        "were not reported done: call kv_ops_done() before take_kv_ops()")
    out: list[KVOp] = []
    host = self._host
    if host is not None:
        out += host.take_offloads()
        if self._store is not None:
            out += self._store_puts()
            out += host.fetches
            host.fetches = []
        out += host.take_loads()
        host.end_step(pending)
    copies, pins = self._copies.take()
    out += copies
    if pins:
        self._pool.release(pins)
    self._index.step += 1
    self._ops_pending = pending
    return out


def kv_ops_done(self: KVCacheManager) -> None:
    """The copies of the plan taken with ``take_kv_ops(pending=True)`` are done (read
    and written, e.g. its CUDA event completed): its host slots may be taken again.
    Raises PlanError when no such plan awaits it (nothing changes)."""
    if not self._ops_pending:
        raise PlanError("kv_ops_done() without a plan taken with take_kv_ops(pending=True) "
                        "whose copies were not reported done")
    self._ops_pending = False
    if self._host is not None:
        self._host.copies_done()


def _store_puts(self: KVCacheManager) -> list[KVOp]:
    """Writes of the contents recorded in the previous step (their forward pass has
    run since), those still held as recorded: not evicted, not made unfindable."""
    store, index = self._store, self._index
    assert store is not None and isinstance(index, ContentIndex), "puts need a store"
    ops: list[KVOp] = []
    for b, cid, parent, chunk, keys in self._computing:
        if b.key is not None and not b.twin and b.content_id == cid:
            assert b.hash is not None, "with a store, every recorded block has its chain hash"
            ops.append(store.put(b.block_id, b.hash, parent, chunk, b.extra, keys))
    assert index.fresh is not None, "a store's index notes fresh contents"
    self._computing, index.fresh = index.fresh, []
    return ops


def _drop_puts(self: KVCacheManager, invalid: list[Block]) -> None:
    """Drop the pending store writes (if any) of the contents of ``invalid`` blocks
    (their KV turned out invalid: ``uncache_blocks``) and of every content computed
    on top of them (a live request's blocks after one, or a content whose parent is
    one): a step that computed such a block read that KV, and its chain hash keys the
    value for every replica (it would overwrite another replica's right KV, and be
    served from then on). Before the index forgets them."""
    bad = {b.hash for b in invalid if b.key is not None and b.hash is not None}
    index = self._index
    if self._store is None or not bad or not isinstance(index, ContentIndex) or index.fresh is None:
        return
    named = set(map(id, invalid))
    after: set[int] = set()  # (ids of the blocks from an invalid one on, per request)
    for req in self._requests.values():
        k = next((k for k, b in enumerate(req.blocks) if id(b) in named), -1)
        if k >= 0:
            after.update(map(id, req.blocks[k:]))
    kept: list[list[Fresh]] = [[], []]
    for out, pending in zip(kept, (self._computing, index.fresh), strict=True):
        for entry in pending:  # (oldest first: a parent's entry before its children's)
            b, cid, parent = entry[0], entry[1], entry[2]
            if b.content_id == cid and b.hash is not None and (
                    id(b) in after or parent in bad or b.hash in bad):
                bad.add(b.hash)
            else:
                out.append(entry)
    self._computing, index.fresh = kept
