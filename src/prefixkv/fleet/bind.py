"""Binding a publisher's ZeroMQ socket (extra ``prefixkv[events]``): a replica that
restarts binds its old port again, which ZeroMQ frees only some time after the old
socket closed.
"""

from __future__ import annotations

import time

INBOUND_HWM = 64
"""Messages a publisher's socket queues unread per peer (ZeroMQ's ``RCVHWM``; past it
ZeroMQ stops reading that peer's connection): replay requests on the ROUTER (a router
sends one at a time) and subscriptions on the PUB (a handful). It was ``hwm``, 100,000:
a peer sending 1 KiB requests without reading answers made the replica hold ~100 MB
(tests/fleet/test_socket_caps.py). Not bounded by it: a message's number of frames
(ZeroMQ holds a message whole before it can be read; no option caps its frames), the
number of peers, and the PUB's subscription trie, which keeps every distinct
subscription a connected peer sent (2,000 of 1,000 bytes: 50 MB; an XPUB with
``XPUB_MANUAL`` applying only prefixes of the topic grew as much: docs/router.md)."""


def bound(sock, endpoint: str, hwm: int, inbound: int | None = None,  # type: ignore[no-untyped-def]
          wait: float = 2.0):
    """``sock`` bound to ``endpoint``, queuing ``hwm`` messages per peer to send and
    ``inbound`` (None: ``hwm``) unread. A restarted replica rebinds its old port, which
    ZeroMQ releases asynchronously after close: retry for up to ``wait`` seconds."""
    import zmq

    sock.set_hwm(hwm)
    if inbound is not None:
        sock.setsockopt(zmq.RCVHWM, inbound)
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
