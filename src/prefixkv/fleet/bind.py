"""Binding a publisher's ZeroMQ socket (extra ``prefixkv[events]``): a replica that
restarts binds its old port again, which ZeroMQ frees only some time after the old
socket closed.
"""

from __future__ import annotations

import time


def bound(sock, endpoint: str, hwm: int, wait: float = 2.0):  # type: ignore[no-untyped-def]
    """``sock`` bound to ``endpoint``. A restarted replica rebinds its old port, which
    ZeroMQ releases asynchronously after close: retry for up to ``wait`` seconds."""
    import zmq

    sock.set_hwm(hwm)
    deadline = time.monotonic() + wait
    while True:
        try:
            sock.bind(endpoint)
            return sock
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.05)
