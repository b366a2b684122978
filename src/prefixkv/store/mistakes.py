"""prefixkv's own mistakes in a store call, told apart from the store's failures.

Each call prefixkv makes to a ``StoreBackend`` (the fetchers' reads, the writer's puts,
the engine plug-ins' lookups) is wrapped in ``except Exception``: a store that fails or
is slow costs a miss, counted, never the engine. ``RedisStore`` checks its arguments
before any command (``redis_args``) and raises ConfigError for ones it refuses; when
prefixkv itself passed them (a key that is not bytes, a read-only or strided buffer of
its own), that is a bug here, not a failure of the store, and counting it as one hid it.
``own_mistake`` logs such an error at ERROR, with its traceback, the first time each call
site meets one, on logger ``LOGGER`` (the engine goes on: the call still counts as
failed). The test suite fails a test that logs one (tests/conftest.py).
"""

from __future__ import annotations

import logging

from ..errors import ConfigError

__all__ = ["LOGGER", "own_mistake"]

LOGGER = "prefixkv.store.mistakes"
"""The logger ``own_mistake`` writes to."""

_told: set[str] = set()  # the call sites that logged theirs (once each, per process)


def own_mistake(exc: BaseException, where: str) -> None:
    """Call in the ``except`` around a store call at ``where`` (e.g.
    ``"RedisStore.put (StoreWriter)"``), beside counting the failure: a ConfigError, the
    backend refusing what prefixkv passed it, is logged at ERROR once per ``where``;
    another error (the store's) is not logged here."""
    if isinstance(exc, ConfigError) and where not in _told:
        _told.add(where)
        logging.getLogger(LOGGER).error(
            "prefixkv passed %s arguments it refuses: a bug in prefixkv, not a store "
            "failure (counted as one; logged once): %s", where, exc, exc_info=exc)
