"""Frames of another publisher on a replica's socket, numbered exactly as the next
expected batch (``seq == last + 1``), and a restarted vLLM-style publisher whose first
frame the router reads is numbered so: on real publishers over loopback.

vLLM 0.33's wire names no publisher and no life (``(topic, seq, [ts, events,
data_parallel_rank])``; each life numbers from 0). What the router can check on a frame
is its topic (the subscription matches a prefix: ``kv-events`` takes ``kv-events-dp1``
too) and its rank (one publisher, one rank); a restart is told by the socket's monitor
(the new life's frames come on a new connection, after the old one's end)."""

import threading

import pytest
import zmq

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router.subscriber import Subscriber
from waiting import LIVE, PATIENCE, await_subscribed, poll_until, wait_until

from .test_subscriber import BS, LegacyReplay, P, make, step


class Proxy:
    """A ZeroMQ forwarder (XSUB -> XPUB, subscriptions back): several publishers reach
    one SUB socket through it, as through a deployment's event proxy."""

    def __init__(self, *publishers):
        ctx = zmq.Context.instance()
        self.xsub, self.xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        self.xpub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        for endpoint in publishers:
            self.xsub.connect(endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(20):
                other = self.xpub if sock is self.xsub else self.xsub
                other.send_multipart(sock.recv_multipart())

    def close(self):
        self.stop.set()
        self.thread.join()
        self.xsub.close(linger=0)
        self.xpub.close(linger=0)


def other_batch(prompt, dp_rank):
    other = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    other.add_request("x", prompt)
    return encode_batch(other.take_events(), block_size=BS, dp_rank=dp_rank)


@pytest.mark.parametrize(("topic", "dp_rank"), [(b"kv-events", 1), (b"kv-events-dp1", 0)])
def test_another_publishers_frame_numbered_next_is_not_applied(topic, dp_rank):
    """A vLLM-style publisher (8-byte replay) and another one (another DP rank, or
    another topic the subscription's prefix matches) behind one proxy. The other's frame
    numbered ``last + 1`` was applied as the replica's (its prompt indexed there), and
    the replica's own next batch, now numbered ``last``, was taken for a restart."""
    pub, mgr, router = make()
    pub.replay = LegacyReplay(100)
    other = zmq.Context.instance().socket(zmq.XPUB)  # (XPUB: it sees the subscription)
    other.bind("tcp://127.0.0.1:*")
    proxy = Proxy(pub.endpoint, other.getsockopt_string(zmq.LAST_ENDPOINT))
    sub = Subscriber(router, {"r": (proxy.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        assert other.poll(PATIENCE * 1000)          # the subscription reached the publishers
        other.recv_multipart()
        step(pub, mgr, "a", P[0])                   # seq 0 (lost on the way: replayed)
        assert poll_until(sub, lambda: router.cached_tokens(P[0])["r"] == 12)
        assert sub.last_seq["r"] == 0
        other.send_multipart((topic, (1).to_bytes(8, "big"), other_batch(P[5], dp_rank)))
        def handled():  # (judged either way: not applied, or applied)
            return sub.foreign_frames + sub.bad_batches or router.cached_tokens(P[5])["r"]
        wait_until(handled, "the other publisher's frame", step=lambda: sub.poll(0.05))
        assert router.cached_tokens(P[5])["r"] == 0 and sub.foreign_frames == 1
        step(pub, mgr, "b", P[1])                   # the replica's own seq 1
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
        assert router.cached_tokens(P[0])["r"] == 12 and router.cached_tokens(P[5])["r"] == 0
        assert (sub.restarts, sub.resyncs, sub.errors, sub.last_seq["r"]) == (0, 0, 0, 1)
    finally:
        sub.close()
        proxy.close()
        other.close(linger=0)
        pub.close()


@pytest.mark.parametrize("legacy", [True, False])
def test_a_restarted_publishers_frame_numbered_next_is_a_restart(legacy):
    """The publisher (vLLM's 8-byte replay, or prefixkv's with epochs) restarts on its
    endpoint and its new life's batches 0 and 1 go out (before or after the router
    reconnected: either way); its batch 2 is numbered ``last + 1`` of the old life. The
    old life's entries must go: the monitor reports the old connection's end before the
    new one's frames, and the replica is verified."""
    pub, mgr, router = make()
    if legacy:
        pub.replay = LegacyReplay(100)
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        for i in (0, 1):
            step(pub, mgr, str(i), P[i])
        assert poll_until(sub, lambda: sub.last_seq.get("r") == 1)
        endpoints = pub.endpoint, pub.replay_endpoint
        pub.close()
        pub, mgr, _ = make(endpoint=endpoints[0], replay=endpoints[1])
        if legacy:
            pub.replay = LegacyReplay(100)
        for i in (3, 4):
            step(pub, mgr, str(i), P[i])            # seq 0, 1 of the new life
        wait_until(lambda: pub.published_batches == 2, "the new life's first batches")
        step(pub, mgr, "5", P[5])                   # seq 2: the old life's last + 1
        assert poll_until(sub, lambda: router.cached_tokens(P[5])["r"] == 12)
        assert [router.cached_tokens(p)["r"] for p in P[:2]] == [0, 0]
        assert sub.restarts == 1 and sub.errors == 0 and sub.last_seq["r"] == 2
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_a_foreign_frame_numbered_0_at_first_contact_is_not_applied(dp_rank):
    """Before the replica's first batch, a frame numbered 0 of another publisher (the
    same rank, or another) was applied unchecked: its prompt indexed there, and its rank
    learnt as the replica's origin, refusing the replica's own frames from then on. The
    vLLM publisher's buffer (empty) shows it never sent it."""
    pub, mgr, router = make()
    pub.replay = LegacyReplay(100)
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        with sub.lock:
            sub._on_message("r", 0, other_batch(P[5], dp_rank), b"kv-events")
        assert router.cached_tokens(P[5])["r"] == 0 and sub.unsent_frames == 1
        step(pub, mgr, "a", P[0])                   # the replica's own seq 0
        assert poll_until(sub, lambda: router.cached_tokens(P[0])["r"] == 12)
        with sub.lock:  # a foreign frame 0 again, now that seq 0 is the replica's
            sub._on_message("r", 0, other_batch(P[4], 0), b"kv-events")
        assert router.cached_tokens(P[4])["r"] == 0 and sub.unsent_frames == 2
        step(pub, mgr, "b", P[1])
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
        assert router.cached_tokens(P[0])["r"] == 12 and router.cached_tokens(P[5])["r"] == 0
        assert (sub.restarts, sub.resyncs, sub.errors, sub.foreign_frames) == (0, 0, 0, 0)
    finally:
        sub.close()
        pub.close()


def test_a_vllm_publishers_frame_again_is_a_duplicate_not_a_restart():
    """A frame delivered twice, or late (reordered behind a later one the gap replay
    already applied): its buffer holds it and the batch applied last. It was taken for
    a restart: the replica forgotten and rebuilt (or, its buffer past the start, lost)."""
    pub, mgr, router = make()
    pub.replay = LegacyReplay(100)
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        for i in (0, 1, 2):
            step(pub, mgr, str(i), P[i])
        assert poll_until(sub, lambda: sub.last_seq.get("r") == 2)
        frames = dict(pub.replay.since(0))
        with sub.lock:
            for seq in (1, 0, 2):
                sub._on_message("r", seq, frames[seq], b"kv-events")
        assert [router.cached_tokens(p)["r"] for p in P[:3]] == [12] * 3
        assert (sub.restarts, sub.resyncs) == (0, 0)
        assert (sub.duplicates, sub.unsent_frames) == (3, 0)
        assert sub.health()["counters"]["duplicates"] == 3
    finally:
        sub.close()
        pub.close()
