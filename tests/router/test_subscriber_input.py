"""Bad input to ``Subscriber``: a RouterError before any change (no index forgotten, no
socket made), and a poll timeout that would wait for ever or is no number."""

import math

import pytest

from prefixkv.errors import PrefixKVError
from prefixkv.router import Router, RouterError, Stored
from prefixkv.router.subscriber import Subscriber

GOOD = ("tcp://127.0.0.1:1", None)


def indexed():
    router = Router(["a", "b"], block_size=4)
    router.apply("a", [Stored((1, 2), None, "GPU")])
    return router


@pytest.mark.parametrize("endpoints, kw", [
    ({"a": GOOD, "zzz": GOOD}, {}),                  # a replica the router does not know
    ({"a": GOOD, "b": ("tcp://127.0.0.1:1",)}, {}),  # not (pub, replay)
    ({"a": GOOD, "b": (1, None)}, {}),
    ({"a": GOOD, "b": ("tcp://127.0.0.1:1", b"x")}, {}),
    ({"a": GOOD}, {"topic": b"kv-events"}),
    # (fleet-r10: text that is no UTF-8 raised UnicodeEncodeError after the index was
    # forgotten)
    ({"a": GOOD}, {"topic": "kv-\udc80"}),
    ({"a": GOOD, "b": ("tcp://127.0.0.1:\udc80", None)}, {}),
    ({"a": GOOD, "b": ("tcp://127.0.0.1:1", "tcp://\ud800")}, {}),
    *[({"a": GOOD}, {"replay_timeout": t}) for t in (0, -1.0, math.nan, math.inf, True, "1")],
])
def test_bad_arguments_are_refused_before_any_index_is_forgotten(endpoints, kw):
    router = indexed()
    with pytest.raises(RouterError):
        Subscriber(router, endpoints, **kw)
    assert router.index.num_blocks("a") == 2  # (the first replica was forgotten, then it raised)
    assert issubclass(RouterError, PrefixKVError)


@pytest.mark.parametrize("timeout", [-1.0, math.nan, math.inf, None, True])
def test_a_poll_timeout_that_is_not_seconds_is_refused(timeout):
    sub = Subscriber(Router(["a"], block_size=4), {"a": GOOD})
    try:
        with pytest.raises(RouterError):
            sub.poll(timeout)  # (-1 s was -1000 ms: ZeroMQ waits for ever)
    finally:
        sub.close()
