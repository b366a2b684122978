"""The subscriber against batches that are not the replica's: a message numbered past
what the replica's own replay says it sent (a corrupt or foreign frame), up to the last
8-byte number, and a replay endpoint answering with another topic. The index must not
take their events, and the stream must be followed on, with nothing counted as a
defect."""

import pytest

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE, await_subscribed, poll_until, wait_until

from .test_subscriber import BS, LegacyReplay, P, connect, discard, make, step, wait_for

LAST = (1 << 64) - 1


def foreign_batch(prompt):
    """A well-formed payload announcing ``prompt``'s blocks (another manager's)."""
    other = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    other.add_request("x", prompt)
    return encode_batch(other.take_events(), block_size=BS)


def follow(replay=None):
    """A publisher (``replay``: its replay buffer, if not its own) and a subscriber
    following it, seq 0 (P[0]) applied."""
    pub, mgr, router = make()
    if replay is not None:
        pub.replay = replay
    sub = connect(pub, router)
    step(pub, mgr, "a", P[0])
    wait_for(sub, 1)
    return pub, mgr, router, sub


@pytest.fixture
def following():
    pub, mgr, router, sub = follow()
    yield pub, mgr, router, sub
    sub.close()
    pub.close()


@pytest.fixture
def following_vllm():
    """As ``following``, the publisher answering only vLLM's 8-byte replay request."""
    pub, mgr, router, sub = follow(LegacyReplay(100))
    yield pub, mgr, router, sub
    sub.close()
    pub.close()


@pytest.mark.parametrize("seq", [7, 1 << 40, LAST])
def test_a_message_numbered_past_the_replay_is_not_applied(following, seq):
    pub, mgr, router, sub = following
    with sub.lock:
        sub._on_message("r", seq, foreign_batch(P[5]))
    assert router.cached_tokens(P[5])["r"] == 0    # the replay says seq 0 is its last
    for i in (1, 2):
        step(pub, mgr, str(i), P[i])
    assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
    assert [router.cached_tokens(p)["r"] for p in P[:3]] == [12] * 3
    assert router.cached_tokens(P[5])["r"] == 0
    assert sub.errors == 0 and sub.last_error is None


@pytest.mark.parametrize("seq", [7, 1 << 40, LAST])
def test_a_message_numbered_past_a_vllm_replay_is_not_applied(following_vllm, seq):
    """A vLLM publisher (8-byte replay) asked for the gap before such a message ends its
    answer before it: the message was not sent by this life. It was applied all the
    same (the index claimed the foreign prompt), and the replica's next message, now
    numbered below it, counted a restart that never happened."""
    pub, mgr, router, sub = following_vllm
    with sub.lock:
        sub._on_message("r", seq, foreign_batch(P[5]))
    assert router.cached_tokens(P[5])["r"] == 0
    for i in (1, 2):
        step(pub, mgr, str(i), P[i])
    assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
    assert router.cached_tokens(P[5])["r"] == 0
    assert sub.restarts == 0 and sub.errors == 0 and sub.last_seq["r"] == 2
    assert sub.health()["replicas"]["r"]["protocol"] == "vllm"


def test_after_the_last_number_a_snapshot_is_asked(following):
    """``last_seq`` at the last 8-byte number (a forgotten replica follows from whatever
    message comes next, this one included): the next start cannot be asked, a snapshot
    can (before, packing the start raised, counted as a defect, for every message)."""
    pub, mgr, router, sub = following
    with sub.lock:
        sub.last_seq["r"] = LAST
    step(pub, mgr, "b", P[1])
    assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
    assert sub.errors == 0 and sub.snapshots == 2 and sub.last_seq["r"] == 1


class OtherTopicReplay(LegacyReplay):
    """A vLLM replay (8-byte form) of a publisher with another topic: the endpoint of
    another replica's publisher, given by mistake."""

    def serve(self, sock, snapshot, topic=b""):
        super().serve(sock, snapshot, b"other-events")


def test_a_replay_of_another_topic_is_not_applied():
    pub, mgr, router = make()
    pub.replay = OtherTopicReplay(100)
    sub = connect(pub, router)
    try:
        step(pub, mgr, "a", P[0])
        wait_for(sub, 1)                 # first contact: the map request gets an end mark
        step(pub, mgr, "b", P[1])
        discard(sub, 1)
        step(pub, mgr, "c", P[2])
        wait_for(sub, 1)                 # the gap: its replay is of another topic
        assert sub.gaps_filled == 0 and sub.resyncs == 1
        assert [router.cached_tokens(p)["r"] for p in P[:3]] == [0, 0, 12]
    finally:
        sub.close()
        pub.close()


def test_a_replay_answer_late_once_does_not_make_a_prefixkv_replica_vllm():
    """The map request timed out once (the publisher's thread was busy): the replica
    was taken for a vLLM publisher for good (``protocol`` "vllm", no snapshots: a gap
    past its buffer forgot it). Now the timeout costs a resync, and the next gap is
    asked in prefixkv's form again."""
    import threading

    pub, mgr, router = make()
    release, real = threading.Event(), pub.replay.serve
    def slow_once(*args):
        release.wait(PATIENCE)
        pub.replay.serve = real
        real(*args)
    pub.replay.serve = slow_once
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=1.0)
    await_subscribed(sub)
    try:
        step(pub, mgr, "a", P[0])
        wait_for(sub, 1)                 # first contact: the map request times out
        release.set()
        assert sub.resyncs == 1 and router.cached_tokens(P[0])["r"] == 12
        step(pub, mgr, "b", P[1])
        discard(sub, 1)
        step(pub, mgr, "c", P[2])
        wait_for(sub, 1)
        assert [router.cached_tokens(p)["r"] for p in P[:3]] == [12] * 3
        assert sub.health()["replicas"]["r"]["protocol"] == "prefixkv"
        assert sub.errors == 0
    finally:
        sub.close()
        pub.close()


def test_a_vllm_publishers_batches_replayed_at_a_reconnection_are_not_a_restart_live(following_vllm):
    """A reconnection without a restart (a network blip): the verification replays from
    the batch applied last, which applies what the publisher sent since; those batches
    also arrive live on the new connection. Each was read as numbering starting again:
    a restart counted and the replica forgotten."""
    pub, mgr, router, sub = following_vllm
    with sub.lock:
        sub._unverified.add("r")                 # as at the disconnect
    for i in (1, 2):
        step(pub, mgr, str(i), P[i])             # sent on the new connection
    wait_until(lambda: pub.published_batches == 3, "seq 1 and 2 sent")
    with sub.lock:
        sub._verify("r")                         # as at the handshake: replays seq 1, 2
    assert sub.last_seq["r"] == 2
    wait_for(sub, 2)                             # the same two, live
    step(pub, mgr, "3", P[3])
    wait_for(sub, 1)
    assert [router.cached_tokens(p)["r"] for p in P[:4]] == [12] * 4
    assert sub.restarts == 0 and sub.resyncs == 0 and sub.errors == 0 and sub.last_seq["r"] == 3


def test_a_foreign_message_after_a_vllm_publisher_restarted_finds_the_restart(following_vllm):
    """The publisher restarted (its new life sent one batch, the disconnect not read
    yet) and a frame numbered past the new life's buffer arrives: it is not applied, and
    the replica is verified there and then, so the old life's entries go."""
    pub, mgr, router, sub = following_vllm
    endpoints = pub.endpoint, pub.replay_endpoint
    pub.close()
    pub, mgr, _ = make(endpoint=endpoints[0], replay=endpoints[1])
    pub.replay = LegacyReplay(100)
    try:
        step(pub, mgr, "d", P[3])
        wait_until(lambda: pub.published_batches == 1, "the new life's seq 0 sent")
        with sub.lock:
            sub._on_message("r", 5, foreign_batch(P[5]))
            assert sub.restarts == 1 and sub.errors == 0
            assert [router.cached_tokens(p)["r"] for p in (P[0], P[3], P[5])] == [0, 12, 0]
    finally:
        pub.close()


@pytest.mark.parametrize("seq", [0, 3])
def test_a_frame_before_the_publisher_sent_anything_is_not_applied(seq):
    """First contact with a publisher that has sent nothing yet (a fresh life; the frame
    is a dead life's, or foreign): its answer says ``next_seq`` 0, the last number
    applied became -1, which also marks a replica forgotten after a failed replay (that
    one follows from the message at hand), so the frame was applied. Found by
    test_subscriber_machine."""
    pub, mgr, router = make()
    sub = connect(pub, router)
    try:
        with sub.lock:
            sub._on_message("r", seq, foreign_batch(P[5]))
        assert router.cached_tokens(P[5])["r"] == 0 and sub.snapshots == 1
        step(pub, mgr, "a", P[0])                    # its own seq 0 is followed
        assert poll_until(sub, lambda: router.cached_tokens(P[0])["r"] == 12)
        assert router.cached_tokens(P[5])["r"] == 0 and sub.errors == 0 and sub.resyncs == 0
    finally:
        sub.close()
        pub.close()


def test_a_foreign_frame_numbered_below_a_vllm_publishers_last_is_not_a_restart(following_vllm):
    """A frame numbered at or below the last batch applied was read as the publisher's
    numbering starting again (a restart): the replica was forgotten and the frame applied
    as the new life's first batch. Its buffer says whether it sent it. Found by
    test_subscriber_machine."""
    pub, mgr, router, sub = following_vllm
    with sub.lock:
        sub._on_message("r", 0, foreign_batch(P[5]))
    assert [router.cached_tokens(p)["r"] for p in (P[0], P[5])] == [12, 0]
    assert sub.restarts == 0 and sub.errors == 0 and sub.last_seq["r"] == 0
    step(pub, mgr, "b", P[1])
    assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
    assert router.cached_tokens(P[0])["r"] == 12 and sub.restarts == 0


@pytest.mark.parametrize("legacy", [False, True])
def test_a_frame_cut_on_the_way_is_replaced_by_the_publishers_copy(legacy):
    """A frame numbered next whose payload was cut on the way (undecodable) was taken as
    applied: its events lost, the index kept what its removals removed, and no gap was
    seen after it. The publisher's buffer holds the whole batch (test_vllm_wire_fuzz
    found it)."""
    pub, mgr, router, sub = follow(LegacyReplay(100) if legacy else None)
    try:
        step(pub, mgr, "b", P[1])
        (sock,) = sub._sockets.subs
        assert sock.poll(PATIENCE * 1000)
        topic, seq, payload = sock.recv_multipart()
        with sub.lock:
            sub._on_message("r", int.from_bytes(seq, "big"), payload[:len(payload) // 2], topic)
        assert [router.cached_tokens(p)["r"] for p in P[:2]] == [12, 12]
        assert (sub.last_seq["r"], sub.bad_batches, sub.unsent_frames, sub.resyncs) == (1, 0, 1, 0)
        step(pub, mgr, "c", P[2])
        wait_for(sub, 1)
        assert router.cached_tokens(P[2])["r"] == 12 and sub.restarts == sub.errors == 0
    finally:
        sub.close()
        pub.close()
