"""The client side of a publisher's replay socket (see docs/events.md, *Sequence numbers
and replay*): ``stream`` speaks vLLM 0.33's only form (the 8-byte start, answered by one
message per batch and an end mark); ``ask`` speaks prefixkv's extension (a msgpack map,
answered by one map: the missed batches or a snapshot, with the publisher's epoch),
which a vLLM publisher does not answer.

Every answer is checked whole before the subscriber uses any of it: a malformed one
raises ReplayError (the subscriber counts it and falls back), never anything else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..errors import PrefixKVError
from .decode_large import STREAM_FROM, read_answer
from .frames import recv_frames
from .show import show
from .whole import unpack_whole

END_SEQ = (-1).to_bytes(8, "big", signed=True)
STREAM_TIMEOUTS = 10
"""How many reply timeouts one streamed replay may take in all."""


class ReplayError(PrefixKVError):
    """A replay answer that does not have the documented shape."""


class ReplayTimeout(ReplayError):
    """No answer to a map request in time: says nothing of the publisher's kind."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A checked answer to ``ask``: ``batches`` are ``start .. next_seq - 1`` in order
    (empty when ``snapshot`` is given: a payload stating everything the replica holds)."""

    epoch: str
    next_seq: int
    batches: list[tuple[int, bytes]]
    snapshot: bytes | None


def read_reply(payload: bytes) -> object:
    """A map request's answer as msgpack gives it: a large one field by field
    (``decode_large.read_answer``), a small one once known whole (whole.py: a kilobyte of
    nested headers announcing items that are not there cost megabytes). Raises
    ReplayError for one that is not msgpack."""
    try:
        return (read_answer(payload) if len(payload) >= STREAM_FROM
                else unpack_whole(payload, raw=False))
    except Exception:  # msgpack raises several unrelated types
        raise ReplayError(f"replay answer is not msgpack: {payload[:40]!r}") from None


class ReplayClient:
    """A DEALER connected to ``endpoint``, speaking as a REQ client would (``[b"", body]``).
    ``timeout_ms``: how long to wait for each reply message. ``topic``: the live
    subscription's prefix; a streamed batch of a topic it does not match fails the
    replay (the live stream would not have delivered it: the endpoint is another
    publisher's).

    Neither form of request carries an id its answer repeats, so an answer is known to be
    this request's only when every earlier request got its whole answer: a request that
    ends without it (a timeout, a stream cut short or of another shape) closes the socket
    and connects a new one. The publisher's ROUTER addresses the late rest to the old
    socket's identity, which is gone, and drops it (ZeroMQ drops what a ROUTER cannot
    route); it is never read as the next request's answer."""

    def __init__(self, ctx: Any, endpoint: str, timeout_ms: int, topic: bytes = b"",
                 max_message_bytes: int = -1) -> None:
        self._ctx, self._endpoint = ctx, endpoint
        self.timeout_ms, self.topic = timeout_ms, topic
        self.max_message_bytes = max_message_bytes  # (ZeroMQ's MAXMSGSIZE; -1: none)
        self._connect()

    def _connect(self) -> None:
        import zmq

        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.sock.connect(self._endpoint)

    def _abandon(self) -> None:
        """The request under way ends without its whole answer: a new socket (class doc)."""
        self.renew()

    def renew(self) -> None:
        """Close the socket and connect a new one. The subscriber renews it whenever the
        replica's SUB connection ends: the publisher's host may have gone, and a request
        sent on a connection whose end ZeroMQ has not read yet (or never will: a host
        that vanished sends nothing) is lost, which cost a ``replay_timeout`` and the
        replica's index (forgotten, not rebuilt). Never while a request is under way."""
        self.sock.close(linger=0)
        self._connect()

    def ask(self, epoch: str | None, start: int, *, force_snapshot: bool = False
            ) -> Answer | None:
        """The publisher's answer to ``{publisher_epoch, start_seq, force_snapshot}``;
        None when it does not answer in this form (a vLLM publisher streams an end mark
        instead, which is drained). Raises ReplayTimeout when nothing answers in time,
        ReplayError for a map answer that is not an Answer for ``start`` (see
        ``_check``)."""
        import msgpack

        self._drain()
        request: dict[str, Any] = {"start_seq": start}
        if epoch is not None:
            request["publisher_epoch"] = epoch
        if force_snapshot:
            request["force_snapshot"] = True
        self.sock.send_multipart((b"", msgpack.packb(request)))
        if not self.sock.poll(self.timeout_ms):
            self._abandon()
            raise ReplayTimeout(f"no replay answer within {self.timeout_ms} ms")
        frames = recv_frames(self.sock)
        if len(frames) != 2:  # a vLLM publisher read the map as a start: its end mark
            if _replayed(frames)[0] != END_SEQ and not self._drain(self.timeout_ms):
                self._abandon()
            return None
        return _check(read_reply(frames[1]), start)

    def stream(self, start: int, until: int | None = None) -> list[tuple[int, bytes]] | None:
        """Batches ``start .. until - 1`` (``until`` None: every batch from ``start`` on)
        by the 8-byte request; None unless all of them came, consecutive (the buffer
        lost some, or ``replayed`` gave None)."""
        got = self.replayed(start)
        if got is None:
            return None
        if until is not None:
            got = [(s, p) for s, p in got if s < until]
        whole = all(s == k for k, (s, _) in enumerate(got, start))
        complete = until is None or start + len(got) == until
        return got if whole and complete else None

    def replayed(self, start: int) -> list[tuple[int, bytes]] | None:
        """What the publisher's buffer answers to the 8-byte request for ``start``: its
        batches, in the order it sent them (consecutive or not); None when there is no
        such answer (no end mark in time, a message of another shape or topic). The
        whole reply must come within ``STREAM_TIMEOUTS`` timeouts: a publisher that
        streams without end cannot hold the subscriber; and its payloads must add up to
        at most ``max_message_bytes`` (when set; else None): one that streams more cannot
        fill the subscriber's memory (a vLLM buffer of 10,000 steps is far less)."""
        self._drain()
        self.sock.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        room = self.max_message_bytes if self.max_message_bytes > 0 else None
        deadline = time.monotonic() + STREAM_TIMEOUTS * self.timeout_ms / 1000
        while time.monotonic() < deadline and self.sock.poll(self.timeout_ms):
            frames = recv_frames(self.sock)
            seq_bytes, payload = _replayed(frames)
            if seq_bytes is None or len(frames) == 4 and seq_bytes != END_SEQ \
                    and not frames[1].startswith(self.topic):
                if not self._drain(self.timeout_ms):
                    self._abandon()
                return None
            if seq_bytes == END_SEQ:
                return got
            if room is not None:
                room -= len(payload)
                if room < 0:
                    break  # (the rest, if any, would come late: abandoned below)
            got.append((int.from_bytes(seq_bytes, "big"), payload))
        self._abandon()  # no end mark in time: the rest would come late
        return None

    def _drain(self, wait_ms: int = 0) -> bool:
        """Drop what is left of the answer under way, waiting up to ``wait_ms`` for each
        message until its end mark; whether the end mark came (else the caller abandons
        the socket). With ``wait_ms`` 0, before a request: drops anything unread. Gives
        up after ``STREAM_TIMEOUTS`` timeouts in all, whatever comes: a peer that
        streams without end cannot hold it (it did, for ever)."""
        ended = False
        deadline = time.monotonic() + STREAM_TIMEOUTS * max(wait_ms, self.timeout_ms) / 1000
        while time.monotonic() < deadline and self.sock.poll(wait_ms):
            frames = recv_frames(self.sock)
            if _replayed(frames)[0] == END_SEQ:
                wait_ms, ended = 0, True
        return ended

    def close(self) -> None:
        self.sock.close(linger=0)


def _replayed(frames: list[bytes]) -> tuple[bytes | None, bytes]:
    """``(seq frame, payload)`` of one streamed reply: vLLM 0.33's ``[b"", topic, seq,
    payload]`` (end mark ``[b"", b"", END, b""]``), or the ``[b"", seq, payload]`` of
    prefixkv publishers before they spoke vLLM's form; ``(None, b"")`` for another shape."""
    if len(frames) in (3, 4) and frames[0] == b"" and len(frames[-2]) == 8:
        return frames[-2], frames[-1]
    return None, b""


def _check(reply: object, start: int) -> Answer:
    """``reply`` as an Answer to a request for ``start``; ReplayError unless it is a map
    with a str ``publisher_epoch``, an int ``next_seq`` >= 0 and either a bin
    ``snapshot`` (with no replayed batches) or ``replayed_batches`` holding exactly the
    ``[seq, bin payload]`` pairs ``start .. next_seq - 1``."""
    if not isinstance(reply, dict):
        raise ReplayError(f"replay answer must be a map, got {show(reply)}")
    epoch, next_seq = reply.get("publisher_epoch"), reply.get("next_seq")
    batches, snapshot = reply.get("replayed_batches"), reply.get("snapshot")
    if not isinstance(epoch, str):
        raise ReplayError(f"publisher_epoch must be a str, got {show(epoch)}")
    if not isinstance(next_seq, int) or isinstance(next_seq, bool) or next_seq < 0:
        raise ReplayError(f"next_seq must be an int >= 0, got {show(next_seq)}")
    if not isinstance(batches, list):
        raise ReplayError(f"replayed_batches must be an array, got {show(batches)}")
    if snapshot is not None:
        if not isinstance(snapshot, bytes) or batches:
            raise ReplayError("a snapshot answer has a bin snapshot and no replayed batches")
        return Answer(epoch, next_seq, [], snapshot)
    pairs: list[tuple[int, bytes]] = []
    for seq, item in enumerate(batches, start):
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and item[0] == seq and isinstance(item[1], bytes)):
            raise ReplayError(f"replayed_batches[{seq - start}] must be [{seq}, bin], "
                              f"got {show(item)}")
        pairs.append((seq, item[1]))
    if start + len(pairs) != next_seq:
        raise ReplayError(f"replayed_batches cover {start}..{start + len(pairs) - 1}, "
                          f"next_seq is {next_seq}")
    return Answer(epoch, next_seq, pairs, None)
