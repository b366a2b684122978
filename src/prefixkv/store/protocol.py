"""The store protocol: what prefixkv asks of a shared KV store (L3).

A store maps keys (bytes) to values (bytes); prefixkv never lists or scans its keys.
Every method is one round trip, however many keys it is given. A method may raise any
exception when the store is down, slow or full: ``SharedStore`` turns that into misses
and counts it; nothing of a store failure reaches a request. Capacity (expiry,
eviction) is the store's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StoreBackend(Protocol):
    """A key-value store shared by processes (``RedisStore``; tests may pass their own)."""

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds (a chain's cached
        length, stopping at the first missing key). Values are neither read nor checked."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, None where the store holds none."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store each ``(key, value)``, replacing what was there."""
        ...
