"""prefixkv's own mistakes in a store call are not the store's failures: ``RedisStore``
refuses arguments it cannot send (ConfigError, ``redis_args``) before any command, and
every caller in prefixkv wraps its store calls in ``except Exception`` (a failing store
costs a miss, never the engine). A key or buffer prefixkv itself got wrong was then
counted as a store failure and nothing more. It is still counted, and now logged at
ERROR once per call site (``store/mistakes.py``); the suite fails a test that logs one
(``store_mistakes`` in tests/conftest.py). No server: the checks refuse before any."""

from __future__ import annotations

import logging

import pytest

from prefixkv.results import StorePut
from prefixkv.store import RedisStore, StoreWriter, mistakes

pytest.importorskip("redis")


class Failing:
    """A backend whose every call fails as a store does (no ConfigError)."""

    def put(self, items: object) -> int:
        raise ConnectionError("the store is down")


def written(backend: object, key: object) -> StoreWriter:
    w = StoreWriter(backend, batch=4)  # type: ignore[arg-type]
    w.put(StorePut(3, key, b"head"), b"payload")  # type: ignore[arg-type]
    w.close()
    return w


def test_a_key_prefixkv_got_wrong_is_counted_and_logged_once(monkeypatch, store_mistakes, caplog):
    monkeypatch.setattr(mistakes, "_told", set())
    backend = RedisStore("redis://127.0.0.1:1/0")  # (never reached: refused before any)
    with caplog.at_level(logging.ERROR, logger=mistakes.LOGGER):
        assert written(backend, "prefixkv:ab").errors == 1  # (a str key: a bug of ours)
        assert written(backend, "prefixkv:cd").errors == 1
    logged = [r for r in caplog.records if r.name == mistakes.LOGGER]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert "StoreWriter" in logged[0].getMessage() and "a bug in prefixkv" in logged[0].getMessage()
    assert "keys" in logged[0].getMessage() or "items" in logged[0].getMessage()
    assert logged[0].exc_info is not None
    assert len(store_mistakes) == 1
    store_mistakes.clear()  # (made on purpose)


def test_a_store_failure_is_counted_and_not_logged(monkeypatch, store_mistakes, caplog):
    monkeypatch.setattr(mistakes, "_told", set())
    with caplog.at_level(logging.ERROR, logger=mistakes.LOGGER):
        assert written(Failing(), b"prefixkv:ab").errors == 1
    assert [r for r in caplog.records if r.name == mistakes.LOGGER] == []
    assert store_mistakes == []


@pytest.mark.parametrize("where", ["pages.held", "pages.get", "pages.put"])
def test_the_sglang_pages_log_a_refused_call(monkeypatch, store_mistakes, where):
    """The SGLang storage's pages call the backend directly: a ConfigError there is
    logged too (a backend that refuses every call, as RedisStore's checks would)."""
    from prefixkv.errors import ConfigError
    from prefixkv.integrations.sglang.pages import PageStore
    from prefixkv.store import StoreLayout

    class Refusing:
        def held(self, keys: object) -> int:
            raise ConfigError("held: keys must be a list of bytes")

        def read_into(self, keys: object, buffers: object, deadline: object) -> list[object]:
            raise ConfigError("read_into: buffers must be writable")

        def put(self, items: object) -> int:
            raise ConfigError("put: items must be (bytes, bytes) pairs")

    monkeypatch.setattr(mistakes, "_told", set())
    pages = PageStore(Refusing(), StoreLayout("m", "u8", 8), 4)  # type: ignore[arg-type]
    if where == "pages.held":
        assert pages.held(["p0"]) == 0
    elif where == "pages.get":
        assert pages.get(["p0"]) == [None]
    else:
        assert pages.put_pages([("p0", bytes(8))]) == [False]
    assert len(store_mistakes) == 1 and "SGLang pages" in store_mistakes[0].getMessage()
    store_mistakes.clear()
