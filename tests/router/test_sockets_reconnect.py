"""``ReplicaSockets.reconnect`` under a publisher that never pauses. It disconnected the
SUB socket and connected it again; libzmq aborted the whole process (``Assertion failed:
!_more (src/fq.cpp:80)``) when the disconnected connection's pipe ended while a message
of it was being read part-way: 3 of 3 runs of the script below before the fix,
by reading what the socket held right after each reconnect. ``Subscriber`` drained the
socket first (``drop_queued``, at most RCVHWM messages), which made it rare, not
impossible (ZeroMQ's own reconnection may have filled a new pipe by then). Now each
reconnect replaces the socket: the old one, with what it holds, is never read again.
The script runs in another process (an abort would take pytest with it), and so does the
publisher (a thread here would share the GIL and could not outpace the reader)."""

import subprocess
import sys

from waiting import PATIENCE

PUBLISHER = """
import sys, zmq
pub = zmq.Context.instance().socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
seq = 0
while True:
    pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), b"x" * 64))
    seq += 1
"""

READER = """
import sys, time, zmq
from prefixkv.router.sockets import ReplicaSockets
sockets = ReplicaSockets({"r": ("tcp://127.0.0.1:" + sys.argv[1], None)}, "kv-events", 100)
def read_all(deadline):
    got = 0
    while time.monotonic() < deadline and not got:
        got = sum(1 for _ in sockets.messages(0.05))
    return got
assert read_all(time.monotonic() + float(sys.argv[2])), "nothing before the reconnects"
end = time.monotonic() + 1.0
while time.monotonic() < end:  # the stream at full speed
    sum(1 for _ in sockets.messages(0.05))
for _ in range(40):
    time.sleep(0.01)  # the pipe fills
    sockets.reconnect("r")
    sub = next(iter(sockets.subs))  # the replica's SUB socket now
    for _ in range(5000):  # whatever it holds, read at once, without a poll
        try:
            sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
assert len(sockets.subs) == len(sockets.monitors) == 1, "a socket kept or lost"
assert read_all(time.monotonic() + float(sys.argv[2])), "nothing after the reconnects"
sockets.close()
print("done", flush=True)
"""


def test_reconnects_under_a_flooding_publisher_neither_abort_nor_stop_the_stream():
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdout=subprocess.PIPE,
                                 text=True)
    try:
        port = publisher.stdout.readline().strip()
        reader = subprocess.run([sys.executable, "-c", READER, port, str(PATIENCE)],
                                capture_output=True, text=True, timeout=6 * PATIENCE)
    finally:
        publisher.kill()
        publisher.wait()
    assert reader.returncode == 0 and reader.stdout.strip() == "done", (
        reader.returncode, reader.stdout[-500:], reader.stderr[-2000:])
