"""The replay socket on real publishers over loopback: vLLM 0.33's frames (issue 26.1),
malformed answers to prefixkv's map request (issue 22.3)."""

import time

import pytest
import zmq

from prefixkv import KVCacheManager
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.replay import END_SEQ, ReplayBuffer
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber
from waiting import LIVE, await_subscribed, poll_until, wait_until

BS = 4
P = [list(range(100 * i + 1, 100 * i + 13)) for i in range(4)]  # 3 blocks each


def test_replay_answers_in_vllm_frames():
    """vLLM 0.33's ``_service_replay`` sends ``(id, b"", topic, seq, payload)`` per batch
    and ``(id, b"", b"", END_SEQ, b"")`` last; a DEALER client sees the frames after id."""
    mgr = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=BS, heartbeat=None,
                        topic="kv-x") as pub:
        for i in range(3):
            mgr.add_request(str(i), P[i])
            pub.publish(mgr.take_events())
        wait_until(lambda: pub.published_batches == 3, "the three batches sent")
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replies = []
        while dealer.poll(LIVE * 1000):
            replies.append(dealer.recv_multipart())
            if replies[-1][2] == END_SEQ:
                break
        dealer.close(linger=0)
        assert [r[:3] for r in replies] == [[b"", b"kv-x", (1).to_bytes(8, "big")],
                                            [b"", b"kv-x", (2).to_bytes(8, "big")],
                                            [b"", b"", END_SEQ]]
        assert [r[3] for r in replies] == [p for _, p in pub.replay.since(1)] + [b""]


def test_client_streams_vllm_frames_and_rejects_other_shapes():
    from prefixkv.router.replay_client import ReplayClient

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    client = ReplayClient(ctx, server.getsockopt_string(zmq.LAST_ENDPOINT), int(LIVE * 1000))
    try:
        def answer(*messages):
            ident, _, start = server.recv_multipart()
            for m in messages:
                server.send_multipart((ident, *m))
            return int.from_bytes(start, "big")

        seq = [(s).to_bytes(8, "big") for s in range(4)]
        import threading
        t = threading.Thread(target=answer, args=(
            (b"", b"t", seq[2], b"p2"), (b"", b"t", seq[3], b"p3"), (b"", b"", END_SEQ, b"")))
        t.start()
        assert client.stream(2) == [(2, b"p2"), (3, b"p3")]
        t.join()
        t = threading.Thread(target=answer, args=(  # a 1-byte seq (the end mark ends the wait)
            (b"", b"t", b"\x01", b"p"), (b"", b"", END_SEQ, b"")))
        t.start()
        assert client.stream(0) is None
        t.join()
    finally:
        client.close()
        server.close(linger=0)


@pytest.mark.parametrize("batches", [None, [1, 2], [[1]], "xy", [[0, "p"]], [[5, b"p"]],
                                     [[True, b"p"]]])
def test_check_rejects_malformed_answers(batches):
    from prefixkv.router.replay_client import ReplayError, _check

    with pytest.raises(ReplayError):
        _check({"publisher_epoch": "e", "next_seq": 1, "replayed_batches": batches}, 0)


@pytest.mark.parametrize("reply", [
    None, [1], {"next_seq": 0, "replayed_batches": []},
    {"publisher_epoch": "e", "next_seq": -1, "replayed_batches": []},
    {"publisher_epoch": "e", "next_seq": 2, "replayed_batches": [[0, b"p"]]},  # one short
    {"publisher_epoch": "e", "next_seq": 0, "replayed_batches": [], "snapshot": "s"},
    {"publisher_epoch": "e", "next_seq": 1, "replayed_batches": [[0, b"p"]], "snapshot": b"s"}])
def test_check_rejects_other_shapes(reply):
    from prefixkv.router.replay_client import ReplayError, _check

    with pytest.raises(ReplayError):
        _check(reply, 0)


class BadAnswers(ReplayBuffer):
    """A publisher whose answers to the map request are malformed; ``forced_too``: its
    answers to a forced snapshot as well."""

    def __init__(self, maxlen, bad, forced_too=False):
        super().__init__(maxlen)
        self.bad, self.forced_too = bad, forced_too

    def _answer(self, epoch, start, force, snapshot):
        out = super()._answer(epoch, start, force, snapshot)
        if not force or self.forced_too:
            out.pop("snapshot", None)
            out["replayed_batches"] = self.bad
        return out


def step(pub, mgr, rid, prompt):
    mgr.add_request(rid, prompt)
    pub.publish(mgr.take_events())


@pytest.mark.parametrize("bad", [None, [1, 2], [[1]], "xy"])
@pytest.mark.parametrize("forced_too", [False, True])
def test_a_malformed_replay_answer_counts_and_falls_back(bad, forced_too):
    pub = EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=BS, heartbeat=None)
    pub.replay = BadAnswers(100, bad, forced_too)
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    router = Router(["r"], block_size=BS)
    step(pub, mgr, "a", P[0])  # sent before anyone listens: only a snapshot has it
    wait_until(lambda: pub.published_batches == 1, "a sent")
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        step(pub, mgr, "b", P[1])
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
        if forced_too:  # no usable answer: forgotten, then it follows what comes
            assert (sub.bad_replies, sub.resyncs, sub.snapshots) == (2, 1, 0)
            assert router.cached_tokens(P[0])["r"] == 0
        else:           # the forced snapshot rebuilt it exactly
            assert (sub.bad_replies, sub.resyncs, sub.snapshots) == (1, 0, 1)
            assert router.cached_tokens(P[0])["r"] == 12
        step(pub, mgr, "c", P[2])
        assert poll_until(sub, lambda: router.cached_tokens(P[2])["r"] == 12)
        assert sub.errors == 0 and sub.last_seq["r"] == 2
    finally:
        sub.close()
        pub.close()


class SilentOnForce(BadAnswers):
    """A malformed answer, then no answer at all to the forced snapshot."""

    def serve(self, sock, snapshot, topic=b""):
        frames = sock.recv_multipart()
        if b"force_snapshot" not in frames[-1]:
            super().serve(_Read(frames, sock), snapshot, topic)


class _Read:
    """A request already read from ``sock``, read again frame by frame as ``serve``
    reads a socket (``recv`` and ``RCVMORE``); answers go to ``sock``."""

    def __init__(self, frames, sock):
        self.frames, self.send_multipart = list(frames), sock.send_multipart

    def recv(self, copy=True):
        return self.frames.pop(0)

    def getsockopt(self, option):
        assert option == zmq.RCVMORE
        return int(bool(self.frames))


def test_a_forced_snapshot_not_answered_is_a_resync_not_a_bad_reply():
    pub = EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=BS, heartbeat=None)
    pub.replay = SilentOnForce(100, [1, 2])
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    router = Router(["r"], block_size=BS)
    # the forced request waits out its timeout: 2 s, not LIVE (the bad answer comes at once)
    sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=2.0)
    try:
        await_subscribed(sub)
        step(pub, mgr, "b", P[1])
        assert poll_until(sub, lambda: router.cached_tokens(P[1])["r"] == 12)
        assert (sub.bad_replies, sub.resyncs, sub.snapshots, sub.errors) == (1, 1, 0, 0)
    finally:
        sub.close()
        pub.close()


def test_a_stream_without_end_does_not_hold_the_client():
    import threading

    from prefixkv.router.replay_client import STREAM_TIMEOUTS, ReplayClient

    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    client = ReplayClient(ctx, server.getsockopt_string(zmq.LAST_ENDPOINT), 50)
    stop = threading.Event()

    def flood():  # answers forever, never the end mark
        ident, _, _ = server.recv_multipart()
        while not stop.is_set():
            server.send_multipart((ident, b"", b"t", (0).to_bytes(8, "big"), b"p"))
            time.sleep(0.001)
    t = threading.Thread(target=flood)
    t.start()
    try:
        began = time.monotonic()
        assert client.stream(0) is None
        assert time.monotonic() - began < STREAM_TIMEOUTS * 0.05 + 10  # not the endless flood
    finally:
        stop.set()
        t.join()
        client.close()
        server.close(linger=0)
