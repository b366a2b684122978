"""The publisher on real ZeroMQ sockets over loopback: numbering, replay, drops."""

import time

import msgpack
import pytest
import zmq

from prefixkv import BlockStored, ExtraKeys, KVCacheManager
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.replay import END_SEQ
from prefixkv.fleet.wire import WireError
from prefixkv.router import Cleared, Removed, Stored, decode_batch
from waiting import PATIENCE, connect_sub, wait_until


@pytest.fixture
def ctx():
    return zmq.Context.instance()


def sub_to(ctx, pub):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    connect_sub(sub, pub.endpoint)  # PUB drops messages sent before a subscription arrives
    return sub


def recv(sock):
    assert sock.poll(PATIENCE * 1000), "nothing received"
    return sock.recv_multipart()


def stepped_manager():
    m = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
    for i in range(3):
        m.add_request(i, list(range(10 * i + 1, 10 * i + 10)))
        yield m.take_events()


def test_frames_numbering_and_payload(ctx):
    with EventPublisher(block_size=4, heartbeat=None) as pub:
        sub = sub_to(ctx, pub)
        for events in stepped_manager():
            assert pub.publish(events)
        got = [recv(sub) for _ in range(3)]
        assert [f[0] for f in got] == [b"kv-events"] * 3
        assert [f[1] for f in got] == [i.to_bytes(8, "big") for i in range(3)]
        for _, _, payload in got:
            _, events, rank = decode_batch(payload)
            assert rank == 0 and isinstance(events[0], Stored)
        assert pub.publish([]) and pub.published_batches == 3
        sub.close(linger=0)


def test_batches_are_sent_while_the_thread_polls_and_after_it_sleeps_again(ctx, monkeypatch):
    """After a batch the thread polls the queue (``POLL_S``), so ``publish`` wakes
    nobody; past ``LINGER_S`` without one it sleeps on the queue again and ``publish``
    wakes it. Every batch is sent either way, in order. (Each state is asserted with a
    margin: LINGER_S short where it must have passed, PATIENCE where it must not.)"""
    from prefixkv.fleet import publisher

    steps = [*stepped_manager(), *stepped_manager()]
    with EventPublisher(block_size=4, heartbeat=None) as pub:
        sub = sub_to(ctx, pub)
        monkeypatch.setattr(publisher, "LINGER_S", 0.05)
        assert pub.publish(steps[0]) and recv(sub)[1] == (0).to_bytes(8, "big")
        time.sleep(0.2)  # past LINGER_S: the thread waits on the queue again
        assert pub._busy_until < time.monotonic()
        monkeypatch.setattr(publisher, "LINGER_S", PATIENCE)
        assert pub.publish(steps[1]) and recv(sub)[1] == (1).to_bytes(8, "big")  # woken
        assert pub._busy_until > time.monotonic()  # polling: the next publish wakes nobody
        for seq in (2, 3):
            assert pub.publish(steps[seq]) and recv(sub)[1] == seq.to_bytes(8, "big")
        sub.close(linger=0)


def test_publish_does_not_wait_for_the_thread_restating_the_replica(ctx):
    """While the thread holds the lock (a snapshot sorts every held hash, long for a
    large replica), ``publish`` does not wait for it: it never blocks (its contract); it
    waited on the lock before."""
    import threading

    steps = list(stepped_manager())
    with EventPublisher(block_size=4, heartbeat=None) as pub:
        sub = sub_to(ctx, pub)
        done = threading.Event()
        with pub._lock:  # (as ``_snapshot`` and ``_drain`` hold it)
            t = threading.Thread(target=lambda: (pub.publish(steps[0]), done.set()))
            t.start()
            assert done.wait(10), "publish waited for the thread's lock"
        t.join()
        assert recv(sub)[1] == (0).to_bytes(8, "big")
        sub.close(linger=0)


@pytest.mark.parametrize("kind", [zmq.REQ, zmq.DEALER])
def test_replay_since_k(ctx, kind):
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None, buffer_steps=2) as pub:
        sub = sub_to(ctx, pub)
        for events in stepped_manager():
            pub.publish(events)
        live = [recv(sub) for _ in range(3)]
        req = ctx.socket(kind)
        req.connect(pub.replay_endpoint)
        head = [] if kind == zmq.REQ else [b""]
        req.send_multipart([*head, (0).to_bytes(8, "big")])
        replies = []
        while True:
            frames = recv(req)
            replies.append(frames[-2:])
            if frames[-2] == END_SEQ or kind == zmq.REQ:
                break
        if kind == zmq.DEALER:  # the buffer keeps the last 2 batches, then the end mark
            assert [int.from_bytes(s, "big", signed=True) for s, _ in replies] == [1, 2, -1]
            assert [p for _, p in replies[:2]] == [f[2] for f in live[1:]]
            assert replies[-1][1] == b""
        else:  # a REQ socket takes the first reply only (vLLM's example subscriber too)
            assert replies[0] == [(1).to_bytes(8, "big"), live[1][2]]
        req.close(linger=0)
        sub.close(linger=0)


@pytest.mark.parametrize("handed_off", [False, True])
def test_dropped_batch_is_counted_and_followed_by_a_snapshot(ctx, handed_off):
    """A consumer applying the stream in order (stores, removals, the snapshot) ends
    exact; with ``take_pending_events()`` the thread builds the batches, the dropped
    ones too (the snapshot states them)."""
    pub = EventPublisher(block_size=4, heartbeat=None, max_queue=1)
    sub = sub_to(ctx, pub)
    m = KVCacheManager(256, 4, hash_mode="sha256", enable_events=True)
    ref = KVCacheManager(256, 4, hash_mode="sha256", enable_events=True)  # the truth
    results, truth = [], set()
    for i in range(200):  # faster than the thread sends: the queue of 1 overflows
        for mgr in (m, ref):
            if i >= 100:
                mgr.free(i - 100)  # later admissions evict: removals get dropped too
            mgr.add_request(i, list(range(1000 * i + 1, 1000 * i + 9)))
        for ev in ref.take_events():
            for d in ev.block_hashes:
                h = int.from_bytes(d[-8:], "big")
                truth.add(h) if isinstance(ev, BlockStored) else truth.discard(h)
        results.append(pub.publish(m.take_pending_events() if handed_off else m.take_events()))
    assert pub.dropped_batches == results.count(False) > 0
    # Read until the subscriber holds the truth, with a deadline, before closing: closing
    # first (linger 0) could discard what the thread had sent but ZeroMQ had not yet
    # delivered, and a fixed quiet period ended the read early on a loaded machine.
    held: set = set()
    deadline = time.monotonic() + PATIENCE
    while held != truth and time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        _, _, payload = sub.recv_multipart()
        for ev in decode_batch(payload)[1]:
            if isinstance(ev, Cleared):
                held.clear()
            elif isinstance(ev, Stored):
                held.update(ev.hashes)
            elif isinstance(ev, Removed):
                held.difference_update(ev.hashes)
    pub.close()
    assert held == truth and pub.snapshots >= 1  # exact, although batches were dropped
    sub.close(linger=0)


def test_heartbeat_sends_empty_batches(ctx):
    with EventPublisher(block_size=4, heartbeat=0.05) as pub:
        sub = sub_to(ctx, pub)
        frames = recv(sub)
        ts, events, rank = msgpack.unpackb(frames[2])
        assert events == [] and rank == 0
        sub.close(linger=0)


def test_errors():
    with pytest.raises(WireError, match="buffer_steps"):
        EventPublisher(block_size=4, buffer_steps=0)
    with pytest.raises(WireError, match="max_queue"):
        EventPublisher(block_size=4, max_queue=0)
    with pytest.raises(WireError, match="heartbeat"):
        EventPublisher(block_size=4, heartbeat=0)
    with pytest.raises(WireError, match="hash_format"):
        EventPublisher(block_size=4, hash_format="hex")
    pub = EventPublisher(block_size=4)
    with pytest.raises(WireError, match="not a prefixkv event"):
        pub.publish(["BlockStored"])
    assert pub.published_batches == 0 and pub.dropped_batches == 0
    pub.close()
    pub.close()
    with pytest.raises(WireError, match="after close"):
        pub.publish([])


def test_msgpack_replay_requests_get_batches_or_a_snapshot(ctx):
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None, buffer_steps=2) as pub:
        sub = sub_to(ctx, pub)
        mgr = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
        for i in range(3):
            mgr.add_request(i, list(range(10 * i + 1, 10 * i + 10)))
            pub.publish(mgr.take_events())
        live = [recv(sub) for _ in range(3)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)

        def ask(**request):
            dealer.send_multipart([b"", msgpack.packb(request)])
            frames = recv(dealer)
            assert frames[0] == b""
            return msgpack.unpackb(frames[1])

        first = ask(start_seq=0)  # no epoch yet: a snapshot, and the epoch to use
        assert list(first) == ["publisher_epoch", "next_seq", "replayed_batches", "snapshot"]
        assert first["publisher_epoch"] == pub.replay.epoch and first["next_seq"] == 3
        _, events, _ = decode_batch(first["snapshot"])
        assert isinstance(events[0], Cleared) and len(events[1].hashes) == 6
        epoch = first["publisher_epoch"]
        again = ask(publisher_epoch=epoch, start_seq=1)
        assert again == {"publisher_epoch": epoch, "next_seq": 3,
                         "replayed_batches": [[1, live[1][2]], [2, live[2][2]]]}
        assert "snapshot" in ask(publisher_epoch=epoch, start_seq=0)   # past the buffer
        assert "snapshot" in ask(publisher_epoch=epoch, start_seq=2, force_snapshot=True)
        assert ask(publisher_epoch=epoch, start_seq=3)["replayed_batches"] == []
        dealer.send_multipart([b"", b"not msgpack \xc1"])  # ignored; the socket still works
        assert ask(publisher_epoch=epoch, start_seq=2)["replayed_batches"] == [[2, live[2][2]]]
        dealer.close(linger=0)
        sub.close(linger=0)


def test_multimodal_offsets_follow_a_chain_across_batches(ctx):
    """Issue 26.2: the publisher knows where each held block starts, so a chain continued
    in a later batch still states each multimodal input's offset in its block."""
    from prefixkv import ExtraKeys, MultiModalInput

    m = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
    with EventPublisher(block_size=4, heartbeat=None) as pub:
        sub = sub_to(ctx, pub)
        m.add_request("a", list(range(1, 10)))
        pub.publish(m.take_events())
        extra = ExtraKeys(cache_salt=None, mm=(MultiModalInput("img-1", 9, 4),))
        m.add_request("b", list(range(1, 18)), extra=extra)  # continues a's chain
        pub.publish(m.take_events())
        batches = [msgpack.unpackb(recv(sub)[2]) for _ in range(2)]
        assert batches[0][1][0]["extra_keys"] == [None, None]
        assert batches[1][1][0]["extra_keys"] == [[["img-1", 1]], [["img-1", -3]]]
        sub.close(linger=0)


class Unpackable(BlockStored):
    """A stored block whose tokens msgpack cannot write (a token id past 64 bits): the
    sender thread fails on it."""


def test_a_failing_send_is_counted_and_the_thread_goes_on(ctx):
    """Issue 26.3: before, one exception ended the sender thread silently: publish()
    kept returning True, nothing was sent, heartbeats stopped."""
    with EventPublisher(block_size=4, heartbeat=0.05) as pub:
        sub = sub_to(ctx, pub)
        bad = BlockStored([b"\x01" * 32], None, bytes(16), [0],  # lora_id past uint64
                          ExtraKeys(lora="x", lora_id=2**70), 0)
        assert pub.publish([bad])
        wait_until(lambda: pub.send_errors > 0, "the send to fail")
        health = pub.health()
        assert health["send_errors"] == 1 and "OverflowError" in health["last_error"]
        assert health["sender_alive"]
        # the lost batch is restated by a snapshot, then heartbeats and batches go on
        kinds = []
        while len(kinds) < 3:
            _, events, _ = decode_batch(recv(sub)[2])
            if events or kinds:  # heartbeats may come before the snapshot
                kinds.append([type(e).__name__ for e in events])
        assert kinds == [["Cleared", "Stored"], [], []]
        m = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
        m.add_request("a", list(range(1, 10)))
        assert pub.publish(m.take_events())
        while True:
            _, events, _ = decode_batch(recv(sub)[2])
            if events:
                break
        assert [type(e).__name__ for e in events] == ["Stored"]
        sub.close(linger=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_sender_thread_makes_publish_return_false():
    pub = EventPublisher(block_size=4, heartbeat=None)

    def die():
        raise SystemExit  # not an Exception: ends the thread, as a fatal fault would
    pub._step = die
    pub._thread.join(2)
    assert not pub.health()["sender_alive"]
    m = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
    m.add_request("a", list(range(1, 10)))
    assert pub.publish(m.take_events()) is False and pub.dropped_batches == 1
    pub.close()


@pytest.mark.parametrize("kw, name", [
    ({"topic": b"kv-events"}, "topic"), ({"topic": None}, "topic"),
    ({"heartbeat": "1"}, "heartbeat"), ({"heartbeat": True}, "heartbeat"),
    ({"heartbeat": float("nan")}, "heartbeat"),
    ({"hwm": -1}, "hwm"), ({"hwm": "1000"}, "hwm"), ({"hwm": 1.5}, "hwm"),
    ({"endpoint": 5555}, "endpoint"), ({"replay_endpoint": b"tcp://127.0.0.1:*"}, "replay_endpoint"),
    # (fleet-r10: a str that is no UTF-8 raised UnicodeEncodeError)
    ({"topic": "kv-\udc80"}, "topic"), ({"endpoint": "tcp://\ud800:*"}, "endpoint"),
])
def test_options_of_other_types_are_wire_errors_before_any_socket(kw, name, monkeypatch):
    """They raised AttributeError, TypeError or ZeroMQ's errors, some after a socket was
    made (and left open), or were taken (a heartbeat of True: every second)."""
    import zmq

    made = []
    real = zmq.Context.socket
    monkeypatch.setattr(zmq.Context, "socket", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    with pytest.raises(WireError, match=name):
        EventPublisher(block_size=4, **kw)
    assert made == []
