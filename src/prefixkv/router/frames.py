"""Reading one ZeroMQ message from a peer without copying more of it than a reader needs.

ZeroMQ's ``MAXMSGSIZE`` caps each frame of a message, not how many frames it has, and
ZeroMQ holds a message whole before any frame of it can be read; no socket option bounds
that. ``recv_multipart`` then copied every frame into Python beside ZeroMQ's own copy
(a publisher's 200 MB message of 4,000-byte frames, read with frames capped at 4,096
bytes: the reader's peak grew 385 MB while ZeroMQ held it, 579 MB once read).
``recv_frames`` keeps the first ``MAX_FRAMES`` and reads the rest without copying them:
no message the subscriber or replay client reads has more, so one that has is bad
whatever the rest holds.
"""

from __future__ import annotations

from typing import Any

MAX_FRAMES = 5
"""Frames kept of one message (a live message has 3, a replay answer 4 or 2 after a
DEALER's envelope, a monitor's 2): a message with more is kept as its first
``MAX_FRAMES + 1``, enough to see it has too many."""


def recv_frames(sock: Any, flags: int = 0) -> list[bytes]:
    """The frames of the next message on ZeroMQ ``sock`` (``flags`` for the first
    ``recv``: ``zmq.NOBLOCK`` raises ``zmq.Again`` when none waits), at most
    ``MAX_FRAMES + 1`` of them; the rest are read and dropped uncopied."""
    import zmq

    frames = [sock.recv(flags)]
    while sock.getsockopt(zmq.RCVMORE):
        if len(frames) <= MAX_FRAMES:
            frames.append(sock.recv())
        else:
            sock.recv(copy=False)  # (a zmq.Frame: the frame is not copied into Python)
    return frames
