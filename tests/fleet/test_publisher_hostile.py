"""Hostile peers of a publisher's replay socket (found by wirefuzz-r16):

- its ROUTER had no cap on what it reads: any peer that reaches the replay port could
  make the publisher read a request of any size into memory (a real request is 8 bytes
  or a map of under 100); one over ``replay.MAX_REQUEST_BYTES`` is now never read
  (ZeroMQ drops the connection);
- the thread served replay requests for as long as any waited, so a peer sending them
  faster than they were answered (each 8-byte request is answered with the whole
  buffer) stopped the replica's batches for as long as it sent; at most
  ``replay.PER_STEP`` are served between two batches now.

- a request of many frames (each under the cap) was copied whole into a Python list
  before it was found to have too many; at most 4 are copied now.

Plus a fuzzer: requests of any frames and bodies leave the server answering.
"""

import subprocess
import sys

import msgpack
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.replay import END_SEQ, MAX_REQUEST_BYTES
from waiting import PATIENCE, connect_sub, wait_until


def steps(pub, n):
    mgr = KVCacheManager(256, 4, hash_mode="sha256", enable_events=True)
    for i in range(n):
        mgr.add_request(i, list(range(10 * i + 1, 10 * i + 10)))
        pub.publish(mgr.take_events())
        mgr.free(i)


def ask_8(sock, start=0):
    """Batches answered to the 8-byte request, up to the end mark."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        assert sock.poll(PATIENCE * 1000), "no replay answer"
        frames = sock.recv_multipart()
        if frames[2] == END_SEQ:
            return got
        got.append(int.from_bytes(frames[2], "big"))


def test_a_replay_request_over_the_cap_is_never_read():
    ctx = zmq.Context.instance()
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None) as pub:
        peer = ctx.socket(zmq.DEALER)
        monitor = peer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        peer.connect(pub.replay_endpoint)
        events = []

        def seen(kind):
            while monitor.poll(0):
                events.append(monitor.recv_multipart())
            return any(int.from_bytes(e[0][:2], "little") == kind for e in events)

        try:
            wait_until(lambda: seen(zmq.EVENT_CONNECTED), "the peer's connection")
            peer.send_multipart([b"", b"\x00" * (MAX_REQUEST_BYTES + 1)])
            wait_until(lambda: seen(zmq.EVENT_DISCONNECTED), "the publisher dropping the peer",
                       timeout=10)
            honest = ctx.socket(zmq.DEALER)
            honest.connect(pub.replay_endpoint)
            steps(pub, 2)
            wait_until(lambda: pub.replay.next_seq == 2, "two batches")
            assert ask_8(honest) == [0, 1] and pub.send_errors == 0
            honest.close(linger=0)
        finally:
            peer.disable_monitor()
            monitor.close(linger=0)
            peer.close(linger=0)


def test_a_request_of_many_frames_is_not_copied_whole():
    import tracemalloc

    ctx = zmq.Context.instance()
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None) as pub:
        peer = ctx.socket(zmq.DEALER)
        try:
            peer.connect(pub.replay_endpoint)
            steps(pub, 1)
            wait_until(lambda: pub.replay.next_seq == 1, "a batch")
            frame = b"q" * MAX_REQUEST_BYTES
            tracemalloc.start()
            peer.send_multipart([b""] + [frame] * 4000)  # 4 MB in one request
            assert ask_8(peer) == [0]  # (one connection: served after the bad one)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 1 << 20, f"{peak} bytes traced serving one bad request"
            assert pub.send_errors == 0
        finally:
            tracemalloc.stop()
            peer.close(linger=0)


FLOOD = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(sys.argv[1])
n = 0
while True:
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    n += 1
    if n == 5000:  # (past both high-water marks: the publisher is reading the flood)
        print("up", flush=True)
"""


def test_a_flood_of_replay_requests_does_not_stop_the_batches():
    ctx = zmq.Context.instance()
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        connect_sub(sub, pub.endpoint)
        steps(pub, 50)  # each 8-byte request for 0 is answered with 50 batches
        wait_until(lambda: pub.replay.next_seq == 50, "50 batches")
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, pub.replay_endpoint],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout.readline() == "up\n"
            while sub.poll(0):
                sub.recv_multipart()
            steps(pub, 1)
            assert sub.poll(20_000), "no batch sent while the flood lasted"
            assert int.from_bytes(sub.recv_multipart()[1], "big") == 50
        finally:
            flood.kill()
            flood.wait()
            sub.close(linger=0)


frames = st.lists(st.binary(max_size=64) | st.sampled_from([
    b"", (0).to_bytes(8, "big"), END_SEQ, msgpack.packb({"start_seq": -5}),
    msgpack.packb({"start_seq": 1 << 63}), msgpack.packb({"start_seq": True}),
    msgpack.packb({"publisher_epoch": [1], "start_seq": 0, "force_snapshot": 1}),
    msgpack.packb([0]), b"\xc1"]), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(frames, min_size=1, max_size=6))
def test_any_request_leaves_the_server_answering(requests):
    ctx = zmq.Context.instance()
    with EventPublisher(replay_endpoint="tcp://127.0.0.1:*", block_size=4,
                        heartbeat=None, buffer_steps=3) as pub:
        hostile, honest = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            hostile.connect(pub.replay_endpoint)
            honest.connect(pub.replay_endpoint)
            steps(pub, 4)
            for request in requests:
                hostile.send_multipart(request)
            wait_until(lambda: pub.replay.next_seq == 4, "four batches")
            assert ask_8(honest, 0) == [1, 2, 3]
            honest.send_multipart([b"", msgpack.packb({"start_seq": 2})])
            assert honest.poll(PATIENCE * 1000)
            answer = msgpack.unpackb(honest.recv_multipart()[1])
            assert answer["next_seq"] == 4 and "snapshot" in answer  # (no epoch given)
            assert pub.send_errors == 0 and pub.health()["sender_alive"]
        finally:
            hostile.close(linger=0)
            honest.close(linger=0)
