"""Patience for tests on a busy machine: how long a call to a live server may take, and
how a test waits for what another thread or process does.

CI runs the suite on two shared cores (two pytest-xdist workers, the Triton interpreter
and replica subprocesses beside them): what takes a millisecond on a quiet machine may
take ten times as long, or stall for a while. So a test waits for a condition, never for
a fixed time, and its bounds (``LIVE`` on a call to a healthy server, ``PATIENCE`` on a
wait) only stop a hang: a run that passes never comes near them. Where a deadline is what
a test checks (a stalled server must be cut off at it), that deadline stays short and
only the calls to healthy servers around it are generous.
"""

import time

LIVE = 10.0
"""Seconds a call to a live, healthy server (Redis, an HTTP endpoint, a replay socket) may
take before its client gives up. (CI once timed out a first write to a local Redis at 0.2 s.)"""

PATIENCE = 60.0
"""Seconds a test waits for what should happen soon before it fails; above ``LIVE``, as
what it waits for may include a call that takes up to ``LIVE``."""

GRACE = 0.1
"""Seconds a ZeroMQ subscription is given to travel to the publisher once the connection
is made (it is sent right behind the handshake, by ZeroMQ's own threads): a PUB socket
drops what it sends before the subscription arrives, and says nothing about it. One hop
between ZeroMQ's I/O threads on loopback: with 0.02 s, the 80 tests that wait on it
(router/test_subscriber, test_replay, test_wire_fuzz, fleet/test_publisher,
test_wire_groups, test_vllm_interop) passed 5 runs out of 5 beside 2 and then 6 busy
loops (load 3 to 8); 0.1 keeps five times that. (It was 0.5: 17 s of those files' 30.)"""


def wait_until(cond, what, *, timeout=PATIENCE, step=lambda: time.sleep(0.005)):
    """Call ``step`` until ``cond()`` is true; AssertionError naming ``what`` once
    ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        step()


def connect_sub(sock, endpoint):
    """Connect the ZeroMQ SUB socket ``sock`` (its subscription set) to ``endpoint`` and
    return once what the publisher sends from now on reaches it: the handshake done (a
    socket monitor says so), then ``GRACE`` for the subscription behind it."""
    import zmq

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        assert monitor.poll(PATIENCE * 1000), f"no handshake with {endpoint} in {PATIENCE:g} s"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    time.sleep(GRACE)


def await_subscribed(sub):
    """Return once every replica's stream reaches the ``Subscriber`` ``sub``: each
    connection made (``sub.connected``, which its polls follow: the test's polls here,
    or its own thread's once started), then ``GRACE`` for the subscriptions."""
    step = (lambda: time.sleep(0.01)) if sub.alive else (lambda: sub.poll(0.05))
    wait_until(lambda: all(sub.connected.values()), "the subscriber's connections", step=step)
    time.sleep(GRACE)


def poll_until(sub, cond):
    """Poll the ``Subscriber`` ``sub`` (on this thread) until ``cond()``, for up to
    ``PATIENCE``; returns ``cond()``."""
    deadline = time.monotonic() + PATIENCE
    while not cond() and time.monotonic() < deadline:
        sub.poll(0.05)
    return cond()
