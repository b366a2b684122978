"""A publisher restart the router learns of late or not at all: its host vanished without
closing the connections (crash, power loss, a cut network), so the router's sockets keep
connections that nothing will ever answer (``blackhole.py`` stands in for the host)."""

import pytest

from prefixkv import KVCacheManager
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.router import Router, RouterError
from prefixkv.router.decode import Stored
from prefixkv.router.subscriber import Subscriber
from router.blackhole import Blackhole
from router.test_subscriber import step, wait_for
from waiting import LIVE, PATIENCE, await_subscribed, poll_until, wait_until

BS = 4
P = [list(range(100 * i + 1, 100 * i + 13)) for i in range(4)]  # 3 blocks each


def port(endpoint):
    return int(endpoint.rsplit(":", 1)[1])


def publisher(endpoint="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*"):
    return (EventPublisher(endpoint, replay, block_size=BS, heartbeat=None),
            KVCacheManager(256, BS, hash_mode="sha256", enable_events=True))


def restart_unheard(sub, pub, mgr, router, holes):
    """``P[0]`` applied, then the host vanishes (each of ``holes`` swallows its
    connections) and a new life starts on its ports, stating ``P[2]`` (its batch 0, sent
    before the router can hear it); returns the new publisher once the router has found
    the restart or forgotten the replica, and checks that it found it and rebuilt the
    index from the new life's snapshot."""
    await_subscribed(sub)
    step(pub, mgr, "a", P[0])
    wait_for(sub, 1)
    assert router.cached_tokens(P[0])["r"] == 12
    for hole in holes:
        hole.swallow()                    # nothing comes, nothing ends
    endpoints = pub.endpoint, pub.replay_endpoint
    pub.close()
    pub, mgr = publisher(*endpoints)
    step(pub, mgr, "c", P[2])
    assert poll_until(sub, lambda: sub.restarts + sub.resyncs > 0)
    assert (sub.restarts, sub.resyncs) == (1, 0) and sub.disconnects >= 1
    # the new life's snapshot: its batch 0 (unheard live), not the old life's blocks
    assert [router.cached_tokens(p)["r"] for p in P[:3]] == [0, 0, 12]
    return pub


def test_a_vanished_host_is_noticed_by_pings_and_its_restart_found():
    """Nothing closes the router's connections to a host that vanished: without pings its
    SUB socket waited on the dead one for ever (not reconnected, so the new life went
    unheard), and the index kept the old life's blocks: routed to as hits that are not
    there. Pings (ZeroMQ's heartbeats, answered by the peer's ZeroMQ itself) drop it."""
    pub, mgr = publisher()
    holes = Blackhole(port(pub.endpoint)), Blackhole(port(pub.replay_endpoint))
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (holes[0].endpoint, holes[1].endpoint)},
                     replay_timeout=LIVE, ping=0.1)
    try:
        pub = restart_unheard(sub, pub, mgr, router, holes)
    finally:
        sub.close()
        pub.close()
        for hole in holes:
            hole.close()


def test_a_restart_is_verified_on_a_new_replay_connection():
    """The SUB socket's connection is reported closed, the replay socket's is not (yet,
    or ever: a vanished host): the verification was asked on the dead one, had no answer
    (``replay_timeout``), and the new life was forgotten (``resyncs``) instead of rebuilt
    from its snapshot (``restarts``). The replay socket is made again at every disconnect."""
    pub, mgr = publisher()
    hole = Blackhole(port(pub.replay_endpoint))
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.endpoint, hole.endpoint)}, replay_timeout=LIVE)
    try:
        pub = restart_unheard(sub, pub, mgr, router, [hole])
    finally:
        sub.close()
        pub.close()
        hole.close()


@pytest.mark.parametrize("bad", [0, -1, 0.0001, 601, float("nan"), float("inf"), True, "1"])
def test_a_ping_out_of_range_is_a_router_error_before_any_change(bad):
    router = Router(["r"], block_size=BS)
    router.apply("r", [Stored((7,), None, "GPU")])
    with pytest.raises(RouterError, match="ping"):
        Subscriber(router, {"r": ("tcp://127.0.0.1:1", None)}, ping=bad)
    assert router.index.num_blocks("r") == 1  # not forgotten


def test_route_does_not_wait_for_a_replay_under_way():
    """The subscriber's thread held ``subscriber.lock``, which ``route`` callers take,
    for the whole of a message's handling, replay requests included: a replay endpoint
    slow to answer (busy, or gone: up to ``replay_timeout``, ten of them for a streamed
    answer) held every ``route`` call that long. The lock is taken only to change the
    index now."""
    import msgpack
    import zmq

    pub, mgr = publisher(replay=None)
    server = zmq.Context.instance().socket(zmq.ROUTER)  # a replay endpoint that waits
    server.bind("tcp://127.0.0.1:*")
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.endpoint, server.getsockopt_string(zmq.LAST_ENDPOINT))},
                     replay_timeout=LIVE)
    try:
        sub.start()
        await_subscribed(sub)
        step(pub, mgr, "a", P[0])               # first contact: a snapshot is asked
        assert server.poll(PATIENCE * 1000)
        ident, _, body = server.recv_multipart()
        assert msgpack.unpackb(body) == {"start_seq": 0}
        assert sub.lock.acquire(blocking=False)  # a route call would not wait
        try:
            assert router.route(P[0]).cached_tokens == 0
        finally:
            sub.lock.release()
        router.finish("r")
        answer = {"publisher_epoch": "e", "next_seq": 1, "replayed_batches": [],
                  "snapshot": pub.replay.since(0)[0][1]}
        server.send_multipart([ident, b"", msgpack.packb(answer)])
        wait_until(lambda: router.cached_tokens(P[0])["r"] == 12, "the snapshot applied")
        assert sub.snapshots == 1 and sub.errors == 0
    finally:
        sub.close()
        pub.close()
        server.close(linger=0)
