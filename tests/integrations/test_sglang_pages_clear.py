"""``PageStore.clear`` (what SGLang's ``clear()`` of the backend runs: after an in-place
weight update, on a PD role switch): pages stored before are unfound from then on, stores
cleared as often share again, and nothing is deleted. Real Redis, no SGLang."""

import hashlib

from prefixkv.integrations.sglang.pages import PageStore
from prefixkv.store import RedisStore
from waiting import LIVE

from .test_sglang_pages import LAYOUT, pages, server  # noqa: F401 (a fixture)


def test_a_clear_leaves_the_pages_stored_before_unfound_and_deletes_nothing(server):  # noqa: F811
    store, other = pages(server), pages(server)
    assert store.put([("c1", b"12345678"), ("c2", b"abcdefgh")])
    old = store.key("c1")
    store.clear()
    assert store.held(["c1", "c2"]) == 0 and store.get(["c1"]) == [None]
    assert store.key("c1") != old and store.backend.held([old]) == 1
    assert other.held(["c1", "c2"]) == 2                       # not cleared: the old pages
    assert store.put([("c1", b"ABCDEFGH")])
    assert other.get(["c1"]) == [b"12345678"]
    other.clear()
    assert other.get(["c1", "c2"]) == [b"ABCDEFGH", None]       # cleared as often: shared
    assert (store.clears, other.clears) == (1, 1)


def test_the_keys_before_any_clear_are_those_of_before(server):  # noqa: F811
    """No clear, no move: a replica of this version shares with one of the last."""
    digest = LAYOUT.digest()
    ns = hashlib.sha256(b"prefixkv-sglang\0" + digest + (4).to_bytes(4, "little")).hexdigest()[:24]
    assert pages(server).key("ab") == f"prefixkv:sglang:{ns}:ab".encode()


def test_a_write_under_way_at_a_clear_lands_in_the_namespace_it_started_in(server):  # noqa: F811
    """The backup thread's write of pages read before the clear (the old weights' KV)
    must not land where the cleared store looks."""
    backend = RedisStore(server.url, timeout=LIVE)
    store = PageStore(backend, LAYOUT, 4, timeout=LIVE, retry_after=0)
    real = backend.put

    def put_after_a_clear(values, *args, **kw):
        store.clear()
        return real(values, *args, **kw)

    backend.put = put_after_a_clear
    assert store.put([("w1", b"12345678")])
    backend.put = real
    assert store.held(["w1"]) == 0 and store.clears == 1
