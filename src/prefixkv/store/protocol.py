"""The store protocol: what prefixkv asks of a shared KV store (L3).

A store maps keys (bytes) to values (bytes); prefixkv never lists or scans its keys.
Every method is one round trip per server involved, however many keys it is given, and
may be called from several threads at once. A key that fails on its own (a value of the
wrong type, a write refused for memory) fails that key only; a method raises only when
the whole call failed (down, slow past its deadline): ``StoreLink`` turns that into
misses and counts it; nothing of a store failure reaches a request. Capacity (expiry,
eviction) is the store's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

ReadOutcome = bool | int | Exception | None
"""What ``read_into`` did with one key: ``True``, its value was written into the key's
buffers; ``None``, the store holds no such key; an ``int``, the length of a value that
does not fit the buffers exactly (nothing written); an ``Exception``, this key failed
(e.g. a value of another type)."""


class StoreBackend(Protocol):
    """A key-value store shared by processes (``RedisStore``; tests may pass their own)."""

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds (a chain's cached
        length, stopping at the first missing key): one batched existence check. Values
        are neither read nor checked."""
        ...

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]],
                  deadline: float) -> list[ReadOutcome]:
        """Read the value of each key into its buffers (writable byte views, filled in
        order), when its length is their total; one outcome per key (``ReadOutcome``).
        ``deadline``: a ``time.monotonic()`` instant by which the call returns or raises,
        however slowly the store answers (a bound on the whole call, not on each read)."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store each ``(key, value)``, replacing what was there. Returns how many were
        refused (each on its own: the others are stored)."""
        ...
