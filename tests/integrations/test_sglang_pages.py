"""PageStore (the SGLang backend's store side, no SGLang) on a real Redis."""

import pytest

from prefixkv.errors import ConfigError
from prefixkv.integrations.sglang.pages import PageStore
from prefixkv.store import RedisStore, StoreLayout
from prefixkv.store.server import LocalRedis
from waiting import LIVE

LAYOUT = StoreLayout("pages-test", "bfloat16", 8)


@pytest.fixture(scope="module")
def server():
    with LocalRedis() as s:
        yield s


def pages(server, layout=LAYOUT, **kw) -> PageStore:
    """A page store whose calls to the live server get ``LIVE`` seconds (the default,
    0.25 s, is for a server that answers in milliseconds; a busy CI machine may not)."""
    return PageStore(RedisStore(server.url, timeout=LIVE), layout, 4, retry_after=0,
                     **{"timeout": LIVE, **kw})


def test_put_held_get_and_the_content_check(server):
    store = pages(server)
    assert store.put([("aa", b"12345678"), ("bb", b"abcdefgh")])
    assert store.held(["aa", "bb", "cc"]) == 2
    assert store.get(["aa", "cc", "bb"]) == [b"12345678", None, b"abcdefgh"]
    client = store.backend.client
    client.set(store.key("bb"), client.get(store.key("aa")))  # aa's value under bb's key
    other = pages(server, StoreLayout("pages-test", "float16", 8))
    assert other.get(["aa"]) == [None] and other.held(["aa"]) == 0  # other dtype, other keys
    assert store.get(["aa", "bb"]) == [b"12345678", None]
    assert (store.hits, store.misses, store.rejected) == (3, 1, 1)


def test_store_down_is_misses_and_dropped_writes():
    with LocalRedis() as s:
        store = pages(s, timeout=0.2)  # (a stopped server refuses at once)
        s.stop()
        assert store.held(["aa"]) == 0 and store.get(["aa"]) == [None]
        assert not store.put([("aa", b"12345678")])
        assert store.errors == 3


def test_bad_input_raises(server):
    with pytest.raises(ConfigError):
        PageStore(RedisStore(server.url), "layout", 4)
    for kw in ({"timeout": 0}, {"retry_after": -1}):
        with pytest.raises(ConfigError):
            PageStore(RedisStore(server.url), LAYOUT, 4, **kw)
    with pytest.raises(ConfigError):
        PageStore(RedisStore(server.url), LAYOUT, 0)
    store = pages(server)
    with pytest.raises(ConfigError, match="page key"):
        store.held([""])
    with pytest.raises(ConfigError, match="payload"):
        store.put([("aa", b"short")])
