"""A publisher that never pauses: ``Subscriber.poll`` must return all the same (its doc:
"handle every message waiting now"), and the background thread must let ``close`` in.
It drained the socket while anything was ready, so a publisher sending faster than the
subscriber applies held a ``poll`` caller for as long as it sent (found by fleet-r10's
wire fuzzing of "never block"). The publisher is another process (a thread of this one
shares the GIL with the subscriber and cannot outpace it)."""

import subprocess
import sys
import threading

import msgpack
import pytest

from prefixkv.router import Router
from prefixkv.router.sockets import PER_SOCKET
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE, await_subscribed, poll_until, wait_until

BS = 4


FLOOD = """
import sys, zmq
from prefixkv.fleet.wire import encode_batch
pub = zmq.Context.instance().socket(zmq.PUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
payload, seq = encode_batch([], block_size=4), 0
while True:
    pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))
    seq += 1
"""


def test_poll_returns_while_a_publisher_floods_the_socket():
    flood = subprocess.Popen([sys.executable, "-c", FLOOD], stdout=subprocess.PIPE, text=True)
    sub = None
    try:
        port = int(flood.stdout.readline())
        router = Router(["r"], block_size=BS)
        sub = Subscriber(router, {"r": (f"tcp://127.0.0.1:{port}", None)})
        await_subscribed(sub)
        handled: list[int] = []
        poller = threading.Thread(target=lambda: handled.append(sub.poll(1.0)), daemon=True)
        poller.start()
        poller.join(PATIENCE)
        assert not poller.is_alive(), "poll did not return while the publisher sent"
        # at most PER_SOCKET from each of its SUB socket and monitor (139,500 before)
        assert 1 <= handled[0] <= 2 * PER_SOCKET and sub.errors == 0
    finally:
        flood.kill()
        flood.wait()
        if sub is not None:
            sub.close()


def test_a_publisher_announcing_without_end_fills_its_index_to_the_cap_only():
    from prefixkv.router import InProcessIndex

    router = Router(["r", "s"], block_size=BS, index=InProcessIndex(max_per_replica=64))
    sub = Subscriber(router, {"r": ("tcp://127.0.0.1:1", None), "s": ("tcp://127.0.0.1:2", None)})
    try:
        for seq in range(10):  # 10 batches of 50 new blocks each
            hashes = list(range(seq * 50, seq * 50 + 50))
            payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": hashes,
                                            "parent_block_hash": None, "token_ids": [],
                                            "block_size": BS}], 0])
            with sub.lock:
                sub._on_message("r", seq, payload, b"kv-events")
        assert router.index.num_blocks("r") == 64
        health = sub.health()
        assert health["replicas"]["r"]["index_refused"] == 500 - 64
        assert health["replicas"]["s"]["index_refused"] == 0 and sub.errors == 0
    finally:
        sub.close()


def test_a_message_over_max_message_bytes_is_never_read():
    # (fleet-r10: no socket capped a message's size, so one peer could make the router
    # read a frame of any size into memory; ZeroMQ now disconnects it first)
    import zmq

    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.getsockopt_string(zmq.LAST_ENDPOINT), None)},
                     max_message_bytes=1 << 20)
    try:
        await_subscribed(sub)
        pub.send_multipart((b"kv-events", (0).to_bytes(8, "big"), b"\x00" * (2 << 20)))
        wait_until(lambda: sub.disconnects >= 1, "the oversized message's disconnect",
                   step=lambda: sub.poll(0.05))
        await_subscribed(sub)  # ZeroMQ connects again by itself
        good = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [7, 8],
                                     "parent_block_hash": None, "token_ids": [],
                                     "block_size": BS}], 0])
        pub.send_multipart((b"kv-events", (1).to_bytes(8, "big"), good))
        assert poll_until(sub, lambda: router.index.num_blocks("r") == 2)
        assert sub.bad_batches == 0 and sub.errors == 0  # the big one was never read
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_max_message_bytes_that_is_no_count_is_a_router_error(bad):
    from prefixkv.router import RouterError

    with pytest.raises(RouterError, match="max_message_bytes"):
        Subscriber(Router(["r"], block_size=BS), {"r": ("tcp://127.0.0.1:1", None)},
                   max_message_bytes=bad)
