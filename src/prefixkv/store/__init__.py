"""The shared KV store (L3): replicas and restarts reuse each other's blocks.

``SharedStore`` (a backend and a ``StoreLayout``) is passed to ``KVCacheManager(...,
store=...)``; ``RedisStore`` is the Redis/Valkey backend (redis-py is imported only when
one is made); ``StoreWriter`` sends the plan's ``StorePut`` writes from a thread;
``encode_value``/``decode_value`` are a stored value's format. See docs/store.md.
"""

from .protocol import StoreBackend
from .record import StoreLayout, decode_value, encode_value
from .shared import Fetched, SharedStore, StoreLink
from .writer import StoreWriter


def __getattr__(name: str):
    if name == "RedisStore":  # redis-py is an extra: the core imports this package
        from .redis_store import RedisStore
        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Fetched", "RedisStore", "SharedStore", "StoreBackend", "StoreLayout", "StoreLink",
           "StoreWriter", "decode_value", "encode_value"]
