"""Prefix caching of a HiSparse layout (vLLM 0.33 with ``enable_caching``): the host pool's
blocks are cached by the requests' block hashes, late (a page only once its host copy is
confirmed, and only as far as the request's caching wish, ``cache``, reaches: vLLM's
``publish_when_ready``); the indexer's device blocks are cached when the wish is made
(an ordinary full-attention group). A hit (``lookup``) is the longest prefix both hold;
a request admitted with one starts its resident row with HOST pages (read from host) and
takes its hot region. The GPU copies of published pages are indexed by host hash
(``copies``) while the pool keeps them (a freed request's clean pages stay there,
unpinned); a hit adopts those that survive at its first step (``advance``), its pages
GPU-resident again. A request finished with copies in flight keeps its host blocks and
publishes them once every copy is confirmed; a preempted one publishes nothing more.

A copy a live request reads is adopted too: both rows read the block (held by those that
pin it, watched for those that unpinned it). The rules are vLLM 0.33's
(``v1/hisparse/coordinator.py``), checked side by side against vLLM's manager by
tests/engines/test_vllm_hisparse_cache.py.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from ...core.block import Block
from ...core.pool import PoolIndex
from ...errors import InvariantError, check_count
from . import hits
from .hash_index import HashIndex
from .request import _Request
from .row import CLEAN, HOST, IN_FLIGHT, UNPINNED
from .state import HiSparseState

__all__ = ["HiSparseCache"]

_VALID = (CLEAN, UNPINNED, HOST)


@dataclass(slots=True)
class _Pub:
    """A live request's caching: its hashes (a live list), the wish (tokens, pages) still
    to publish, the host and indexer pages cached, the pages whose copies are recorded,
    and the hit pages to adopt copies for at the next step."""

    hashes: Sequence[bytes]
    wish: tuple[int, int] | None = None
    host: int = 0
    indexer: int = 0
    recorded: int = 0
    adopt: int = 0


@dataclass(slots=True)
class _Detached:
    """A finished request's publication waiting for its copies in flight: the host blocks
    it holds (its first ``pages``), those cached, the valid pages, the copies pending."""

    hashes: Sequence[bytes]
    blocks: list[Block]
    cached: int
    pages: int
    valid: set[int]
    pending: dict[int, int] = field(default_factory=dict)  # copy id -> page


class HiSparseCache(HiSparseState):
    """``HiSparseState`` with prefix caching (module doc)."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self._pubs: dict[Hashable, _Pub] = {}
        self.copies: dict[bytes, Block] = {}  # published host hash -> its GPU copy
        self._copy_of: dict[int, bytes] = {}  # a copy's block id -> its hash
        self._detached: dict[int, _Detached] = {}  # copy id -> the publication it holds back
        self._finished = False  # (``free``'s argument, read by ``_leaving``)
        self._restoring: list[tuple[int, tuple[Hashable | None, int]]] = []  # (``report``'s whole restores)

    def _new_index(self) -> PoolIndex:
        return HashIndex()

    def _index(self, pool: str) -> HashIndex:
        index = (self.host if pool == "host" else self.device).index
        assert isinstance(index, HashIndex)
        return index

    # ---- lookup and admission --------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], max_tokens: int) -> tuple[list[Block], list[Block]]:
        """The hit of a request with block ``hashes`` of at most ``max_tokens`` tokens:
        the host blocks of the longest published prefix, and the indexer's device blocks
        of the longest cached prefix of those (the hit: as many pages). Changes nothing."""
        return hits.lookup(self, hashes, max_tokens)

    def need_hit(self, tokens: int, host: Sequence[Block], indexer: Sequence[Block], *,
                 cap: bool = False, imported: int = 0) -> int:
        """``need`` for a new request admitted with a hit of ``len(indexer)`` pages (its
        first host blocks ``host`` and indexer blocks): free hit blocks count as taken,
        the row starts past the hit, the hot region is taken. ``imported``: the hit's and
        an external load's tokens, when one follows the hit (hits.py)."""
        return hits.need_hit(self, tokens, host, indexer, cap=cap, imported=imported)

    def admit(self, key: Hashable, total: int, hashes: Sequence[bytes], host: Sequence[Block],
              indexer: Sequence[Block], imported: int = 0) -> bool:
        """``allocate`` for new request ``key`` with its block ``hashes`` (a live list, read
        as it grows) and the hit ``host``/``indexer`` (``lookup``'s: the host blocks at
        least as many as the indexer's, the hit's pages; more are kept only up to an
        import's pages). ``imported``: the hit's and an external load's tokens when a load
        follows the hit (0: none; then past the hit, at most ``total``). All or nothing;
        whether it did. RequestError, nothing changed, for a request holding blocks or
        counts that do not fit."""
        return hits.admit(self, key, total, hashes, host, indexer, imported)

    def _hit(self, key: Hashable, hashes: Sequence[bytes], host: int, k: int) -> None:
        """``key`` was admitted with a hit of ``k`` pages, its first ``host`` host pages
        cached already (its GPU copies adopted at its first step)."""
        self._pubs[key] = _Pub(hashes, host=host, indexer=k, recorded=k, adopt=k)

    # ---- caching and publication -------------------------------------------------------

    def cache(self, key: Hashable, tokens: int, hashes: Sequence[bytes]) -> None:
        """``key``'s tokens up to ``tokens`` are final: its indexer pages are cached, its
        host pages published as their copies are confirmed (vLLM's ``cache_blocks``).
        ``hashes``: its block hashes (a live list, read as it grows)."""
        r = self._get(key)
        p = self._pubs.setdefault(key, _Pub(hashes))
        n = min(check_count("tokens", tokens, 0, None) // self.block_size, len(p.hashes), len(r.indexer))
        index = self._index("device")
        for j in range(p.indexer, n):
            if r.indexer[j].key is None:
                index.record(r.indexer[j], p.hashes[j], j)
        p.indexer = max(p.indexer, n)
        p.wish = (tokens, tokens // self.block_size)
        self._publish(key)

    def _publish(self, key: Hashable) -> None:
        """Publish ``key``'s wish as far as its host copies are valid; index the GPU
        copies of the pages published."""
        r, p = self._requests[key], self._pubs[key]
        if p.wish is None:
            return
        ready = self._ready(key, r)
        n = min(min(p.wish[0], ready * self.block_size) // self.block_size, len(r.host), len(p.hashes))
        index = self._index("host")
        for j in range(p.host, n):
            if r.host[j].key is None:
                index.record(r.host[j], p.hashes[j], j)
        p.host = max(p.host, n)
        for page in range(p.recorded, n):
            block, h = r.blocks[page], r.host[page].key
            if block is not None and r.row.state(page) != IN_FLIGHT:
                self._record_copy(h, block)
        p.recorded = max(p.recorded, n)
        if ready >= p.wish[1]:
            p.wish = None

    def _ready(self, key: Hashable, r: _Request) -> int:
        """The pages of ``key``'s valid host prefix, as vLLM counts it for publication:
        none while its import is pending or after it failed (the load's pages are not
        written); past a done import's whole last page while its restore is in flight
        (the load wrote its host copy)."""
        if key in self.imports.pending or key in self.imports.failed:
            return 0
        ready, row = r.row.ready, r.row
        if any(k == key and page == ready and self.imports.restores.get(tid, False)
               for tid, (k, page) in self.spills.flight.items()):
            ready += 1
            while ready < len(row) and row.state(ready) in _VALID:
                ready += 1
        return ready

    def report(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> list[int]:
        """``HiSparseState.report``; a live request's page restored whole from its published
        host block (an import's last page) is indexed as that block's GPU copy, before the
        publications the report makes (vLLM's order: a published page's copy indexed by
        the same report wins)."""
        self._restoring = [(t, self.spills.page_of(t)) for t, whole in self.imports.restores.items() if whole]
        try:
            return super().report(enqueued, completed)
        finally:
            self._restoring = []

    def _record_copy(self, h: Hashable, block: Block) -> None:
        if isinstance(h, bytes):
            self._drop_copy(h)
            self.copies[h] = block
            self._copy_of[block.block_id] = h

    def _drop_copy(self, h: bytes) -> None:
        old = self.copies.pop(h, None)
        if old is not None:
            del self._copy_of[old.block_id]

    def _confirmed(self, keys: set[Hashable]) -> None:
        for tid, (key, page) in self._restoring:
            r = self._requests.get(key)
            block = None if r is None or tid in self.spills else r.blocks[page]
            if r is not None and block is not None:
                self._record_copy(r.host[page].key, block)
        for key in keys:
            if key in self._pubs:
                self._publish(key)

    # ---- copies: adopted, lost ------------------------------------------------------------

    def _adopt(self, key: Hashable) -> None:
        r, p = self._requests[key], self._pubs.get(key)
        if p is None:
            return
        for page in range(p.adopt):
            h = r.host[page].key
            block = None if r.blocks[page] is not None or h is None else self.copies.get(h)  # type: ignore[arg-type]
            if block is None:
                continue
            self.device.hold(block)
            r.blocks[page] = block
            r.row.adopt(page)
            if page < r.synced:
                r.stale.add(page)
        p.adopt = 0

    def _reused(self, block: Block) -> None:
        h = self._copy_of.get(block.block_id)
        if h is not None:
            self._drop_copy(h)
        super()._reused(block)

    def _let_go(self, block: Block) -> None:
        if block.block_id not in self._copy_of:  # (a copy's watcher drops it when reused)
            super()._let_go(block)

    # ---- free: a finished request's publication held back --------------------------------

    def free(self, key: Hashable, finished: bool = False) -> None:
        """``HiSparseState.free``; ``finished``: the request finished (not preempted), so
        its pages whose copies are in flight may still be published once confirmed."""
        self._finished = finished
        try:
            super().free(key)
        finally:
            self._finished = False

    def _leaving(self, key: Hashable) -> None:
        r, p = self._requests[key], self._pubs.pop(key, None)
        if p is None:
            return
        flight = {t: page for t, (k, page) in self.spills.flight.items() if k == key}
        if p.wish is None or not self._finished or not flight:
            return
        blocks = self.host.acquire(r.host[:p.wish[1]], 0)
        d = _Detached(p.hashes, blocks, p.host, p.wish[1],
                      {q for q in range(len(r.row)) if r.row.state(q) in _VALID}, flight)
        self._detached.update(dict.fromkeys(flight, d))

    def _orphan_done(self, tid: int) -> None:
        d = self._detached.pop(tid, None)
        if d is None:
            return
        d.valid.add(d.pending.pop(tid))
        if d.pending:
            return
        ready = 0
        while ready in d.valid:
            ready += 1
        index = self._index("host")
        for j in range(d.cached, min(ready, d.pages, len(d.hashes))):
            if d.blocks[j].key is None:
                index.record(d.blocks[j], d.hashes[j], j)
        self.host.free(reversed(d.blocks))

    def in_flight(self) -> tuple[set[int], set[int]]:
        """The device and host block ids of the live requests' copies in flight (vLLM
        counts a reference for each such copy on both blocks)."""
        device, host = set(), set()
        for key, page in self.spills.flight.values():
            r = self._requests.get(key) if key is not None else None
            block = None if r is None else r.blocks[page]
            if r is not None and block is not None:
                device.add(block.block_id)
                host.add(r.host[page].block_id)
        return device, host

    def page_of(self, pool: str, block_id: int) -> int | None:
        """The page whose hash ``pool``'s block ``block_id`` holds, None when it holds none."""
        return self._index(pool).page_of(self.host.blocks[block_id] if pool == "host"
                                         else self.device.blocks[block_id])

    def _held_host(self) -> list[Block]:
        return [b for d in {id(d): d for d in self._detached.values()}.values() for b in d.blocks]

    # ---- reset, eviction, checks ----------------------------------------------------------

    def reset(self) -> bool:
        """Drop each pool's cached content where none of its blocks is in use (both are
        tried); whether both did. The GPU copies go with the device pool's."""
        done = []
        for pool, null in zip((self.device, self.host), self.nulls, strict=True):
            pool.free([null])  # (back first in the free order, taken back at once)
            done.append(pool.reset())
            pool.take(1)
        return all(done)

    def evict(self, block_ids: Sequence[int], pool: str = "device") -> None:
        """``pool``'s (device or host) blocks ``block_ids`` hold no findable content from
        now on (a free one is reused first)."""
        blocks = (self.host if pool == "host" else self.device).blocks
        for i in block_ids:
            check_count("a block id", i, 0, len(blocks) - 1)
        index = self._index(pool)
        for i in block_ids:
            b = blocks[i]
            if b.key is not None:
                index.drop_one(b)
                if not b.refs:
                    (self.host if pool == "host" else self.device).emptied([b])

    def check_invariants(self, others: Sequence[Block] = (), host_others: Sequence[Block] = ()) -> None:
        """``HiSparseState.check_invariants``, the requests' cached blocks holding their
        own hashes, and each copy a free unpinned block or one a row reads."""
        super().check_invariants(others, host_others)
        for key, p in self._pubs.items():
            r = self._requests[key]
            for name, blocks, n in (("host", r.host, p.host), ("indexer", r.indexer, p.indexer)):
                bad = [j for j in range(min(n, len(blocks))) if blocks[j].key not in (None, p.hashes[j])]
                if bad or any(b.key is not None for b in blocks[n:] if b.refs == 1):
                    raise InvariantError(f"{key!r}'s {name} blocks hold other hashes ({bad})")
        reading = {id(b) for r in self._requests.values() for b in r.blocks if b is not None}
        for h, b in self.copies.items():
            if self._copy_of.get(b.block_id) != h \
                    or not (id(b) in reading or b.block_id in self.device.unpinned):
                raise InvariantError(f"copy {b!r} of {h!r} is neither read nor unpinned")
