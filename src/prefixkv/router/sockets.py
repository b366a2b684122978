"""The ZeroMQ sockets a ``Subscriber`` reads N replicas through (extra ``prefixkv[events]``).

Per replica a SUB socket on its publisher, a monitor of that socket (disconnects and
handshakes), and a ReplayClient on its replay socket when it has one; one poller over
the SUB sockets and the monitors. What arrives is handed on as frames: the sequence
handling (``subscriber.py``) decides what they mean.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from ..errors import is_endpoint, is_utf8
from .frames import recv_frames
from .replay_client import ReplayClient
from .router import RouterError

__all__ = ["MAX_MESSAGE_BYTES", "MAX_PING", "PER_SOCKET", "PING", "ReplicaSockets", "check_options",
           "check_timeout"]
PER_SOCKET = 1000
"""Messages one ``messages`` call takes per socket, at most (ZeroMQ's default receive
high-water mark: about what a socket holds)."""
PING = 1.0
"""The default seconds between pings on each SUB connection (``ReplicaSockets``)."""
MAX_PING = 600.0
"""The longest ``ping`` (three of them must fit ZeroMQ's int of milliseconds, with room)."""
MAX_MESSAGE_BYTES = 1 << 28
"""The default cap on one frame's bytes (256 MiB; ZeroMQ's ``MAXMSGSIZE`` on every
SUB and replay socket): a peer that sends a larger one is disconnected, never read into
memory. ZeroMQ caps no message's number of frames (frames.py)."""


def check_options(replicas: Collection[str], endpoints: object, topic: object,
                  replay_timeout: object, max_message_bytes: object = MAX_MESSAGE_BYTES,
                  ping: object = PING) -> None:
    """RouterError unless ``endpoints`` maps replicas among ``replicas`` to ``(pub
    endpoint, replay endpoint or None)``, ZeroMQ endpoint strs (``transport://address``), ``topic`` is a str,
    ``replay_timeout`` a finite number of seconds > 0, ``max_message_bytes`` an int
    >= 1 and ``ping`` None or a number of seconds from 0.001 to ``MAX_PING`` (checked
    before any socket)."""
    if ping is not None:
        check_timeout(ping, "ping", positive=True)
        if not 0.001 <= ping <= MAX_PING:  # type: ignore[operator]
            raise RouterError(f"ping must be None or seconds from 0.001 to {MAX_PING}, "
                              f"got {ping!r}")
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or not (
            1 <= max_message_bytes < 1 << 63):
        raise RouterError(f"max_message_bytes must be an int >= 1, got {max_message_bytes!r}")
    if not isinstance(endpoints, Mapping):
        raise RouterError(f"endpoints must map replicas to (pub, replay), got {endpoints!r}")
    for replica, pair in endpoints.items():
        if replica not in replicas:
            raise RouterError(f"unknown replica {replica!r}; known: {list(replicas)}")
        if not (isinstance(pair, tuple) and len(pair) == 2 and is_endpoint(pair[0])
                and (pair[1] is None or is_endpoint(pair[1]))):
            raise RouterError(f"endpoints[{replica!r}] must be (pub endpoint, replay endpoint "
                              f"or None), each a ZeroMQ endpoint str (transport://address), "
                              f"got {pair!r}"[:300])
    if not is_utf8(topic):
        raise RouterError(f"topic must be a str of UTF-8 text, got {topic!r}"[:200])
    check_timeout(replay_timeout, "replay_timeout", positive=True)


def check_timeout(value: object, name: str, *, positive: bool = False) -> None:
    """RouterError unless ``value`` is a finite number of seconds ``>= 0`` (``> 0`` when
    ``positive``); a bool is not one. (ZeroMQ reads a negative wait as for ever.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0 or positive and value == 0:
        raise RouterError(f"{name} must be a finite number of seconds {'>' if positive else '>='}"
                          f" 0, got {value!r}")


class ReplicaSockets:
    """The sockets of ``endpoints`` (replica -> ``(pub_endpoint, replay_endpoint or
    None)``), connected at construction: SUB sockets subscribed to ``topic``, replay
    clients waiting ``replay_timeout_ms`` for an answer; every socket reads messages of
    at most ``max_message_bytes`` (``MAX_MESSAGE_BYTES``).

    ``ping`` (seconds; None: none): each SUB connection sends ZeroMQ's heartbeat (a ZMTP
    PING, answered by the publisher's ZeroMQ itself, vLLM's too) at that interval and is
    dropped after three without any answer or message: a connection to a host that
    vanished (crashed, cut off) is otherwise never known to be dead, since a SUB socket
    sends nothing once subscribed: it waited on it for ever, the replica's restart
    unheard and the old life's index kept."""

    def __init__(self, endpoints: Mapping[str, tuple[str, str | None]], topic: str,
                 replay_timeout_ms: int, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 ping: float | None = PING) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._poller = zmq.Poller()
        self.subs: dict[Any, str] = {}  # SUB socket -> its replica
        self.monitors: dict[Any, str] = {}  # monitor socket -> its replica
        self.replay: dict[str, ReplayClient] = {}
        self._endpoints = {replica: pub for replica, (pub, _) in endpoints.items()}
        self._topic = topic.encode()
        self._max_message_bytes = max_message_bytes
        self._ping = ping
        for replica, (_, replay) in endpoints.items():
            self._open(replica)
            if replay is not None:
                self.replay[replica] = ReplayClient(self._ctx, replay, replay_timeout_ms,
                                                    self._topic, max_message_bytes)

    def _open(self, replica: str) -> None:
        """A new SUB socket on ``replica``'s publisher, with its monitor, both polled."""
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self._ping is not None:
            sub.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(self._ping * 1000)))
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(self._ping * 3000)))
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self._endpoints[replica])
        self.subs[sub] = replica
        self.monitors[monitor] = replica
        self._poller.register(monitor, zmq.POLLIN)
        self._poller.register(sub, zmq.POLLIN)

    def messages(self, timeout: float) -> Iterator[tuple[Any, list[bytes]]]:
        """The messages waiting now, as ``(socket, frames)``, until none is (waiting up
        to ``timeout`` s for the first), at most ``PER_SOCKET`` per socket: a publisher
        that sends faster than they are handled must not hold the caller (it held one
        ``poll`` for 139,500 messages). Of the sockets ready together, the monitors come
        first: a disconnect must be known before the messages that follow it."""
        import zmq

        budget = PER_SOCKET * (len(self.subs) + len(self.monitors))
        ready = dict(self._poller.poll(int(timeout * 1000)))
        while ready and budget > 0:
            for sock in sorted(ready, key=lambda s: s not in self.monitors):
                if sock not in self.subs and sock not in self.monitors:
                    continue  # replaced (``reconnect``) since the poll: closed
                try:  # (frames.py: a message of many frames is not copied whole)
                    frames = recv_frames(sock, zmq.NOBLOCK)
                except zmq.Again:
                    continue
                yield sock, frames
                budget -= 1
            ready = dict(self._poller.poll(0))

    @staticmethod
    def is_disconnect(frames: list[bytes]) -> bool:
        """Whether a monitor's message reports a disconnect (else a handshake succeeded)."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        return bool(parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED)

    def reconnect(self, replica: str) -> None:
        """Replace ``replica``'s SUB socket (and its monitor) by a new one connected to
        the same publisher, after its connection ended. ZeroMQ reconnects by itself after
        a connection error, but not after a protocol error (a message over
        ``MAXMSGSIZE``, a malformed frame): the replica's stream would stop for good.

        The old socket is closed with what it still holds unread: the connection that
        died sent it, and it would be read after the verification (``Subscriber._verify``)
        as if the publisher found then (maybe a new life, numbering from 0 again) had sent
        it; what the publisher did not restart for is not lost: the verification replays
        everything after the batch applied last. A new socket, not ``disconnect`` and
        ``connect`` on the old one: libzmq aborts the process (``Assertion failed: !_more
        (src/fq.cpp:80)``) when a disconnected connection's pipe ends while a message of
        it is read part-way, which a socket never read again cannot do. Its replay client
        gets a new socket too (``ReplayClient.renew``)."""
        if replica in self.replay:
            self.replay[replica].renew()
        sub = next(sock for sock, r in self.subs.items() if r == replica)
        monitor = next(sock for sock, r in self.monitors.items() if r == replica)
        for sock in (sub, monitor):
            self._poller.unregister(sock)
        del self.subs[sub], self.monitors[monitor]
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        self._open(replica)

    def close(self) -> None:
        """Close every socket and replay client."""
        for sub in self.subs:
            sub.disable_monitor()
        for sock in [*self.monitors, *self.subs]:
            sock.close(linger=0)
        for client in self.replay.values():
            client.close()
