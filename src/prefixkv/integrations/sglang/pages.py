"""``PageStore``: pages named by an engine's own page hashes, in prefixkv's shared store,
each value content-checked (no SGLang import: bytes in, bytes out).

SGLang names a page of KV by ``sha256(parent page hash || token ids as u32)`` (hex), so
the key already commits to the whole prefix. A value is prefixkv's record
(``prefixkv.store.record``) whose head names the layout (model, ranks, dtype, page
bytes, host layout: ``StoreLayout``), the page size and the page's own hash::

    key   = b"prefixkv:sglang:" hex(sha256(layout digest, page size))[:24] b":"
            [after n clears: reset_tag(reset_root(that sha256, n))] page hash
    value = head(layout digest, page size, parent = b"", tokens = page hash, extra = b"")
            | length | xxh3-128 checksum | payload

A page hit is a value whose head is the one this store expects for that page, byte for
byte, whose length is exact and whose payload matches the checksum: a value written for
another page (a key mix-up), by another model, rank, dtype or layout (stale or foreign),
truncated or corrupted, is a miss, never KV. The token ids themselves never reach a
storage backend in SGLang; the page hash stands for them (a SHA-256 chain).

A failing store (down, slow past a read's deadline, full) costs misses or dropped
writes: the error is counted and the store is left alone for ``retry_after`` seconds.
Values are read straight into two buffers each (``StoreBackend.read_into``: the head
and the payload) and checked there; the payload buffer is what ``get`` returns (no
copy).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...store.link import reset_root, reset_tag
from ...store.mistakes import own_mistake
from ...store.protocol import StoreBackend
from ...store.record import StoreLayout, block_head, encode_value, value_checked

_FRAME = len(encode_value(b"", b""))  # a value's bytes besides its head and payload


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class PageCounts:
    """A ``PageStore``'s counters read at one instant (``PageStore.counts``): every call
    it reflects, it reflects whole."""

    hits: int
    misses: int
    rejected: int
    failed_reads: int
    written: int
    failed_writes: int
    failed_calls: int


class PageStore:
    """Pages of ``layout.block_bytes`` bytes (``page_size`` tokens) in ``backend``.
    Counters, in pages unless named: ``hits`` (read and checked), ``misses`` (not
    held), ``rejected`` (values that failed the content check), ``failed_reads`` (not
    read: their key failed on its own, their whole call failed, or the store was left
    alone after a failure), ``written``, ``failed_writes`` (refused by the store, e.g.
    full, their call failed, or the store was left alone); ``failed_calls``: store
    calls (``held``, ``get``, ``put``) that failed as a whole, each leaving the store
    alone for ``retry_after`` seconds. Every page ``get`` is asked for is one of hits,
    misses, rejected, failed_reads; every page ``put`` is given, one of written,
    failed_writes. A read of n pages may take ``timeout`` seconds plus the time its bytes
    take at ``read_rate`` bytes a second (SGLang reads up to 128 pages a call: 1 GiB of
    8 MiB pages). Raises ConfigError for a layout that is not a StoreLayout, a page size
    that is not a positive int, a non-positive ``timeout`` or ``read_rate`` or a
    negative ``retry_after``.
    SGLang calls it from three threads (prefetch, its I/O pool, backup): a call adds
    its counts in one step under a lock, so ``counts()`` is a consistent set (the
    attributes read one by one may straddle a call)."""

    def __init__(self, backend: StoreBackend, layout: StoreLayout, page_size: int, *,
                 timeout: float = 0.25, retry_after: float = 1.0,
                 read_rate: float = 1e8) -> None:
        if not isinstance(layout, StoreLayout):
            raise ConfigError(f"layout must be a StoreLayout, got {layout!r}")
        if type(page_size) is not int or page_size <= 0:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        if type(retry_after) not in (int, float) or not 0 <= retry_after < float("inf"):
            raise ConfigError(f"retry_after must be a finite number >= 0, got {retry_after!r}")
        if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
            raise ConfigError(f"timeout must be a positive finite number, got {timeout!r}")
        if type(read_rate) not in (int, float) or not 0 < read_rate < float("inf"):
            raise ConfigError(f"read_rate must be a positive finite number of bytes a second, "
                              f"got {read_rate!r}")
        self.backend, self.layout, self.page_size = backend, layout, page_size
        self.timeout, self.retry_after = float(timeout), float(retry_after)
        self.read_rate = float(read_rate)
        self._digest = layout.digest()
        self._root = _sha256(b"prefixkv-sglang\0" + self._digest + page_size.to_bytes(4, "little"))
        self.clears = 0  # (``clear``)
        self._base = f"prefixkv:sglang:{self._root.hex()[:24]}:".encode()
        self.prefix = self._base
        self._quiet_until = 0.0
        self._lock = threading.Lock()  # the counters' (a call adds its counts in one step)
        self.hits = self.misses = self.rejected = self.failed_reads = 0
        self.written = self.failed_writes = self.failed_calls = 0

    def counts(self) -> PageCounts:
        """The counters as one consistent set: no call is in it in part."""
        with self._lock:
            return PageCounts(self.hits, self.misses, self.rejected, self.failed_reads,
                              self.written, self.failed_writes, self.failed_calls)

    def _count(self, hits: int = 0, misses: int = 0, rejected: int = 0, failed_reads: int = 0,
               written: int = 0, failed_writes: int = 0, failed_calls: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.rejected += rejected
            self.failed_reads += failed_reads
            self.written += written
            self.failed_writes += failed_writes
            self.failed_calls += failed_calls

    def clear(self) -> None:
        """Leave every page stored so far unfound: from now on keys carry after the
        namespace the ``reset_tag`` of ``store.link.reset_root`` of its root and the
        count of clears (the rule of a prefix-cache reset), so stores cleared as often
        share again. Nothing is deleted (the store is shared and never scanned; old pages
        expire). A call under way keeps the namespace it started in: a write of pages
        read before the clear lands where nothing looks after it."""
        with self._lock:
            self.clears += 1
            self.prefix = self._base + reset_tag(reset_root(_sha256, self._root, self.clears))

    def key(self, page: str) -> bytes:
        """The store key of page hash ``page``. Raises ConfigError for a page hash that
        is not a non-empty str."""
        return self._keys([page])[0]

    def _keys(self, pages: Sequence[str]) -> list[bytes]:
        """The store keys of ``pages``, all in one namespace (``clear`` may run meanwhile
        on another thread). Raises as ``key``."""
        prefix = self.prefix
        for page in pages:
            if type(page) is not str or not page:
                raise ConfigError(f"a page key must be a non-empty str, got {page!r}")
        return [prefix + page.encode() for page in pages]

    def head(self, page: str) -> bytes:
        """The head every value of page ``page`` must start with."""
        return block_head(self._digest, self.page_size, b"", page.encode(), b"")

    def held(self, pages: Sequence[str]) -> int:
        """How many of ``pages``, from the first, the store holds (values not read: a
        held page can still fail the check when it is read). 0 when the store fails."""
        keys = self._keys(pages)
        if not keys or self._quiet():
            return 0
        try:
            return int(self.backend.held(keys))
        except Exception as exc:
            own_mistake(exc, "StoreBackend.held (SGLang pages)")
            self._failed()
            return 0

    def get(self, pages: Sequence[str]) -> list[bytearray | None]:
        """The checked payload of each page (a buffer of its own, the value's payload
        read into it and checked there: no copy), None where the store holds none, the
        value fails the content check, or the store fails (then every page is None).
        One round trip per server, bounded by ``timeout`` plus the values' bytes at
        ``read_rate``."""
        keys = self._keys(pages)
        if not keys or self._quiet():
            self._count(failed_reads=len(keys))
            return [None] * len(keys)
        heads = [self.head(p) for p in pages]
        size = self.layout.block_bytes
        fronts = [bytearray(len(h) + _FRAME) for h in heads]  # head | length | checksum
        payloads = [bytearray(size) for _ in heads]
        try:
            deadline = (time.monotonic() + self.timeout
                        + (sum(map(len, heads)) + len(keys) * (_FRAME + size)) / self.read_rate)
            outcomes = self.backend.read_into(
                keys, [[memoryview(f), memoryview(p)] for f, p in zip(fronts, payloads, strict=True)],
                deadline)
            if len(outcomes) != len(keys):
                raise ValueError(f"the store answered {len(outcomes)} of {len(keys)} keys")
        except Exception as exc:
            own_mistake(exc, "StoreBackend.read_into (SGLang pages)")
            self._failed(failed_reads=len(keys))
            return [None] * len(keys)
        out: list[bytearray | None] = []
        hits = misses = rejected = failed = 0
        for outcome, head, front, buf in zip(outcomes, heads, fronts, payloads, strict=True):
            ok = outcome is True and value_checked(front, head, [memoryview(buf)], size)
            payload = buf if ok else None
            if payload is not None:
                hits += 1
            elif outcome is None:
                misses += 1
            elif outcome is True or type(outcome) is int:  # checked and refused, or a
                rejected += 1  # value of another length
            else:  # this key failed on its own
                failed += 1
            out.append(payload)
        self._count(hits=hits, misses=misses, rejected=rejected, failed_reads=failed)
        return out

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> bool:
        """Store each ``(page, payload)``; True when the store took them all (as
        ``put_pages``)."""
        return all(self.put_pages(items))

    def put_pages(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        """Store each ``(page, payload)``; for each, True when the store holds it after
        the call. A payload of the wrong size raises ConfigError before anything is sent;
        a failing store gives False for every page (counted). When the store refuses
        some values (a full server), one existence check says how many pages from the
        first it holds: those are True, the rest False (a page stored after a refused
        one is reported False, never the other way round)."""
        keys = self._keys([page for page, _ in items])
        values = []
        for key, (page, payload) in zip(keys, items, strict=True):
            if len(payload) != self.layout.block_bytes:
                raise ConfigError(f"a page payload of {len(payload)} bytes for pages of "
                                  f"{self.layout.block_bytes}")
            values.append((key, encode_value(self.head(page), payload)))
        if not values:
            return []
        if self._quiet():
            self._count(failed_writes=len(values))
            return [False] * len(values)
        try:
            refused = self.backend.put(values) or 0
        except Exception as exc:
            own_mistake(exc, "StoreBackend.put (SGLang pages)")
            self._failed(failed_writes=len(values))
            return [False] * len(values)
        self._count(written=len(values) - refused, failed_writes=refused)
        if not refused:
            return [True] * len(values)
        try:
            held = self.backend.held([k for k, _ in values]) if refused < len(values) else 0
        except Exception as exc:
            own_mistake(exc, "StoreBackend.held (SGLang pages, after a put)")
            self._failed()
            held = 0
        return [i < held for i in range(len(values))]

    def _quiet(self) -> bool:
        return time.monotonic() < self._quiet_until

    def _failed(self, failed_reads: int = 0, failed_writes: int = 0) -> None:
        """Count a store call that failed whole (with the pages it cost) and leave the
        store alone for ``retry_after`` seconds."""
        self._quiet_until = time.monotonic() + self.retry_after
        self._count(failed_reads=failed_reads, failed_writes=failed_writes, failed_calls=1)
