"""A publisher that never pauses: ``Subscriber.poll`` must return all the same (its doc:
"handle every message waiting now"), and the background thread must let ``close`` in.
It drained the socket while anything was ready, so a publisher sending faster than the
subscriber applies held a ``poll`` caller for as long as it sent (found by fleet-r10's
wire fuzzing of "never block"). The publisher is another process (a thread of this one
shares the GIL with the subscriber and cannot outpace it)."""

import subprocess
import sys
import threading

from prefixkv.router import Router
from prefixkv.router.sockets import PER_SOCKET
from prefixkv.router.subscriber import Subscriber
from waiting import PATIENCE, await_subscribed

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
