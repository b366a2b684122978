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
    return PageStore(RedisStore(server.url, timeout=LIVE), layout, 4,
                     **{"timeout": LIVE, "retry_after": 0, **kw})


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
        assert (store.failed_calls, store.failed_reads, store.failed_writes) == (3, 1, 1)


def test_failed_calls_and_the_pages_they_cost_are_counted_apart():
    """One counter mixed failed calls (one for a whole batch) with failed keys (one
    each) and refused writes (one per call, however many pages): pages asked for did
    not add up to what was counted. Now every page read is one of hits, misses,
    rejected, failed_reads; every page written one of written, failed_writes."""
    with LocalRedis() as s:
        store = pages(s, timeout=0.2)
        assert store.put([("aa", b"12345678"), ("bb", b"abcdefgh")])
        store.backend.client.rpush(store.key("cc"), b"x")  # another type: fails alone
        assert store.get(["aa", "cc", "dd"]) == [b"12345678", None, None]
        assert (store.hits, store.misses, store.failed_reads, store.failed_calls) == (1, 1, 1, 0)
        s.stop()
        assert store.get(["aa", "bb"]) == [None, None]  # one call failed: two pages not read
        assert store.held(["aa", "bb"]) == 0
        assert not store.put([("aa", b"12345678"), ("bb", b"abcdefgh"), ("dd", b"01234567")])
        assert (store.failed_calls, store.failed_reads, store.failed_writes) == (3, 3, 3)
        assert store.hits + store.misses + store.rejected + store.failed_reads == 5
        assert store.written + store.failed_writes == 5


def test_pages_asked_while_the_store_is_left_alone_are_counted_not_called():
    with LocalRedis() as s:
        store = pages(s, timeout=0.2, retry_after=60.0)
        s.stop()
        assert store.get(["aa"]) == [None]  # fails: left alone for retry_after
        assert store.get(["aa", "bb"]) == [None, None]  # not asked
        assert not store.put([("aa", b"12345678")])
        assert (store.failed_calls, store.failed_reads, store.failed_writes) == (1, 3, 1)


def test_a_full_store_counts_each_refused_page():
    layout = StoreLayout("pages-test", "bfloat16", 64 << 10)
    with LocalRedis(maxmemory=2 << 20, policy="noeviction") as s:
        store = pages(s, layout)
        payload = bytes(64 << 10)
        results = [store.put([(f"p{i}-{j}", payload) for j in range(4)]) for i in range(16)]
        assert results[0] and not results[-1]
        assert store.failed_calls == 0  # the calls answered: the store refused pages
        assert store.written + store.failed_writes == 64
        assert store.failed_writes > results.count(False)  # one a page, not one a call


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


class Recording:
    """A StoreBackend that holds nothing and records each read's deadline."""

    def __init__(self) -> None:
        self.deadlines: list[float] = []

    def held(self, keys):
        return 0

    def read_into(self, keys, buffers, deadline):
        import time

        self.deadlines.append(deadline - time.monotonic())
        return [None] * len(keys)

    def put(self, items):
        return 0


def test_a_reads_deadline_allows_for_the_bytes_it_reads():
    # Before: one deadline of `timeout` (0.25 s) for a whole batch, whatever its size.
    # SGLang reads 128 pages a call: for Llama-3.1-8B's 64-token pages (8 MiB) that is
    # 1 GiB, of which a healthy local Redis served 0 to 46 pages by the deadline
    # (benchmarks/results/sglang-read-deadline.md). Now the deadline is `timeout` plus
    # the batch's bytes at `read_rate` (bytes/s, default 100 MB/s: 500 MB/s, the default
    # before, was missed by most 1 GiB reads of a local Redis on a loaded 2-core VM).
    big = StoreLayout("pages-test", "bfloat16", 8 << 20)
    backend = Recording()
    store = PageStore(backend, big, 64, timeout=0.25)
    store.get([f"p{i}" for i in range(128)])
    assert backend.deadlines[-1] >= 0.25 + 128 * (8 << 20) / 1e8 - 0.05
    store.get(["p0"])
    assert 0.25 + (8 << 20) / 1e8 - 0.05 <= backend.deadlines[-1] <= 0.25 + (8 << 20) / 1e8
    fast = PageStore(backend, big, 64, timeout=0.25, read_rate=4e9)
    fast.get([f"p{i}" for i in range(128)])
    assert backend.deadlines[-1] <= 0.25 + 128 * (8 << 20) / 4e9
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1e9"):
        with pytest.raises(ConfigError, match="read_rate"):
            PageStore(backend, big, 64, read_rate=bad)
