"""A publisher with the replica's own topic and rank (a second replica misconfigured
with them, or a life the router never saw end) whose frame is numbered exactly as the
replica's next batch, ``last + 1``: the one frame the numbers cannot judge. vLLM 0.33's
wire states nothing else of a publisher but the batch's timestamp (the scheduler's
``time.time()`` as it made the batch; prefixkv's publisher stamps the same way), so a
frame stamped before the batch applied last is checked with the replica's replay buffer
(it was applied as in order, its blocks indexed as the replica's, until the replica's
own next frame came); without a replay endpoint the replica is forgotten, the frame not
applied (an understatement, never an overstatement). A clock set back on the replica's
own publisher is the same stamp: its buffer holds the frame, which is applied."""

import time

import pytest

from prefixkv import KVCacheManager
from prefixkv.fleet import publisher as publisher_module
from prefixkv.fleet.wire import pack, to_wire_events
from prefixkv.router.subscriber import Subscriber
from waiting import LIVE, await_subscribed, poll_until

from .test_subscriber import BS, LegacyReplay, P, make, step, wait_for

TOPIC = b"kv-events"


def twin_batch(prompt, ts):
    """A well-formed batch of ``prompt``'s blocks, rank 0, stamped ``ts``: packed here as
    ``encode_batch`` packs it, for ``encode_batch`` refuses a stamp that is no finite
    time, which another publisher (or a fuzzed frame) may still send."""
    other = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    other.add_request("x", prompt)
    return pack([float(ts), to_wire_events(other.take_events(), BS, "int"), 0])


def following(protocol):
    """A publisher ("prefixkv", "vllm": 8-byte replay only, "none": no replay endpoint)
    and a subscriber that applied its batch 0 (P[0])."""
    pub, mgr, router = make()
    if protocol == "vllm":
        pub.replay = LegacyReplay(100)
    replay = None if protocol == "none" else pub.replay_endpoint
    sub = Subscriber(router, {"r": (pub.endpoint, replay)}, replay_timeout=LIVE)
    await_subscribed(sub)
    step(pub, mgr, "a", P[0])
    wait_for(sub, 1)
    assert router.cached_tokens(P[0])["r"] == 12 and sub.last_seq["r"] == 0
    return pub, mgr, router, sub


@pytest.mark.parametrize("protocol", ["prefixkv", "vllm"])
def test_a_twins_frame_numbered_next_and_stamped_earlier_is_not_applied(protocol):
    pub, mgr, router, sub = following(protocol)
    try:
        with sub.lock:
            sub._on_message("r", 1, twin_batch(P[5], time.time() - 60), TOPIC)
        assert router.cached_tokens(P[5])["r"] == 0  # (12 before: the twin's blocks)
        assert sub.earlier_frames == 1
        assert sub.health()["counters"]["earlier_frames"] == 1
        for i in (1, 2):  # the replica's own batches 1 and 2: in order, no restart
            step(pub, mgr, str(i), P[i])
        assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
        assert [router.cached_tokens(p)["r"] for p in P[:3]] == [12] * 3
        assert router.cached_tokens(P[5])["r"] == 0
        assert (sub.restarts, sub.resyncs, sub.errors) == (0, 0, 0), sub.health()
    finally:
        sub.close()
        pub.close()


def test_without_a_replay_endpoint_the_replica_is_forgotten_not_the_twin_applied():
    pub, mgr, router, sub = following("none")
    try:
        with sub.lock:
            sub._on_message("r", 1, twin_batch(P[5], time.time() - 60), TOPIC)
        assert router.cached_tokens(P[5])["r"] == 0
        assert router.cached_tokens(P[0])["r"] == 0  # unjudged: forgotten, understated
        assert (sub.earlier_frames, sub.resyncs) == (1, 1)
        for i in (1, 2):  # its own batch 1 (numbered as the twin's: a restart) and 2
            step(pub, mgr, str(i), P[i])
        assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
        assert router.cached_tokens(P[5])["r"] == 0 and sub.errors == 0
    finally:
        sub.close()
        pub.close()


class _SetBack:
    """``time`` as the publisher's thread sees it, its wall clock an hour behind."""

    def __init__(self):
        self.monotonic, self.sleep = time.monotonic, time.sleep

    @staticmethod
    def time():
        return time.time() - 3600


@pytest.mark.parametrize("protocol", ["prefixkv", "vllm"])
def test_the_replicas_own_clock_set_back_is_applied_after_its_buffer_is_asked(
        protocol, monkeypatch):
    pub, mgr, router, sub = following(protocol)
    try:
        monkeypatch.setattr(publisher_module, "time", _SetBack())
        step(pub, mgr, "b", P[1])  # stamped an hour before batch 0: its buffer holds it
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
        step(pub, mgr, "c", P[2])  # judged by batch 1's stamp from then on
        assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
        assert router.cached_tokens(P[0])["r"] == 12
        assert (sub.earlier_frames, sub.restarts, sub.resyncs, sub.errors) == (1, 0, 0, 0)
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("stamp", [float("inf"), float("nan"), 1e300, "2 h ahead"])
def test_a_stamp_that_is_no_plausible_time_judges_no_next_frame(stamp):
    # (found by tests/router/test_wire_fuzz.py: a fuzzed batch stamped 1e300, applied in
    # order, made the next frame look earlier, and that one was not applied)
    stamp = time.time() + 7200 if stamp == "2 h ahead" else stamp
    pub, mgr, router, sub = following("none")
    try:
        with sub.lock:
            sub._on_message("r", 1, twin_batch(P[5], stamp), TOPIC)  # in order: applied
            sub._on_message("r", 2, twin_batch(P[3], time.time()), TOPIC)
        assert router.cached_tokens(P[3])["r"] == 12
        assert (sub.earlier_frames, sub.resyncs, sub.errors) == (0, 0, 0)
    finally:
        sub.close()
        pub.close()


def test_vllms_own_publishers_a_twin_behind_a_proxy_is_not_applied():
    """Two of vLLM 0.33's own ``ZmqEventPublisher`` (rank 0, one topic) merged by a
    proxy onto the replica's socket; the replay endpoint is the replica's. The twin's
    clock is a minute behind: its batch 1 arrives numbered ``last + 1``."""
    from fleet.test_vllm_interop import free_ports, publish, vllm_publisher
    from fleet.vllm_kv_events import kv_events
    from prefixkv.router import Router

    from .test_subscriber_foreign import Proxy

    kv = kv_events()
    ports, (twin_port,) = free_ports(2), free_ports(1)
    pub = vllm_publisher(kv, ports)
    twin = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{twin_port}", replay_endpoint=None,
                                topic="kv-events")
    proxy = Proxy(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{twin_port}")
    router = Router(["v"], block_size=BS)
    sub = Subscriber(router, {"v": (proxy.endpoint, f"tcp://127.0.0.1:{ports[1]}")},
                     replay_timeout=LIVE)
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    other = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    try:
        await_subscribed(sub)
        publish(kv, pub, mgr, "a", P[0])  # the replica's batch 0 (replayed if lost)
        assert poll_until(sub, lambda: router.cached_tokens(P[0])["v"] == 12)
        time.sleep(0.2)  # (the subscription reached the twin through the proxy too)
        for i, prompt in enumerate((P[4], P[5])):  # the twin's batches 0 and 1
            other.add_request(str(i), prompt)
            events = [{"BlockStored": kv.BlockStored, "BlockRemoved": kv.BlockRemoved}[
                m.pop("type")](**m) for m in to_wire_events(other.take_events(), BS)]
            twin.publish(kv.KVEventBatch(ts=time.time() - 60, events=events))
        assert poll_until(sub, lambda: sub.earlier_frames == 1)
        assert router.cached_tokens(P[5])["v"] == 0  # (12 before, until the replica's next)
        publish(kv, pub, mgr, "b", P[1])  # the replica's own batch 1
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["v"] == 12)
        assert [router.cached_tokens(p)["v"] for p in P] == [12, 12, 0, 0, 0, 0]
        assert (sub.restarts, sub.resyncs, sub.errors) == (0, 0, 0), sub.health()
    finally:
        sub.close()
        proxy.close()
        twin.shutdown()
        pub.shutdown()
