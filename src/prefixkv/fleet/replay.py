"""A publisher's memory of what it sent: the last ``maxlen`` batches by sequence number,
served on a ROUTER socket (see docs/events.md).

- 8-byte request ``k`` (big-endian), vLLM 0.33's only form: every kept batch with
  ``seq >= k`` as one message ``[topic, seq, payload]``, then the end mark
  ``[b"", -1 as 8 bytes, b""]`` (after the client's identity and empty frame), exactly
  as vLLM's ``ZmqEventPublisher`` answers.
- prefixkv's extension (vLLM has none such), a msgpack map
  ``{"publisher_epoch"?, "start_seq"?, "force_snapshot"?}``: one msgpack map
  ``{"publisher_epoch", "next_seq", "replayed_batches": [[seq, payload], ...]}`` when the
  kept batches cover ``start_seq .. next_seq - 1`` of this epoch, else
  ``{"publisher_epoch", "next_seq", "replayed_batches": [], "snapshot": payload}`` where
  the snapshot batch states everything the replica holds.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST_BYTES = 1024
"""The largest replay request frame read (ZeroMQ's MAXMSGSIZE on the ROUTER): requests
are 8 bytes or a map of under 100; a peer sending a larger one is disconnected before
it is read, so none can make the publisher read a frame of any size into memory."""
PER_STEP = 16
"""Replay requests served between two batches at most: each 8-byte request is answered
with the whole buffer, so a peer asking faster than that is sent would otherwise stop
the replica's batches for as long as it asked."""


class ReplayBuffer:
    """Numbers batches 0, 1, 2, ... and keeps the last ``maxlen``. ``epoch``: a random
    id of this publisher's life (a restart gets a new one)."""

    def __init__(self, maxlen: int) -> None:
        self.epoch = uuid.uuid4().hex
        self.next_seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=maxlen)

    def add(self, payload: bytes) -> int:
        """Keep ``payload`` under the next sequence number; returns that number."""
        seq = self.next_seq
        self.next_seq += 1
        self._kept.append((seq, payload))
        return seq

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """Kept batches with ``seq >= start``, oldest first."""
        return [(s, p) for s, p in self._kept if s >= start]

    def serve(self, sock: object, snapshot: Callable[[], bytes], topic: bytes = b"") -> None:
        """Answer one request waiting on ROUTER ``sock`` (REQ framing ``[id, b"", body]``
        or DEALER ``[id, body]``); requests of another shape are ignored, as vLLM does.
        ``topic``: the publisher's topic, the first frame of each replayed batch."""
        from .wire import pack

        frames = _request_frames(sock)
        if len(frames) not in (2, 3) or len(frames) == 3 and frames[1] != b"":
            return
        head, body = tuple(frames[:-1]), frames[-1]
        if len(body) == 8:
            for seq, payload in self.since(int.from_bytes(body, "big")):
                sock.send_multipart((*head, topic, seq.to_bytes(8, "big"), payload))  # type: ignore[attr-defined]
            sock.send_multipart((*head, b"", END_SEQ, b""))  # type: ignore[attr-defined]
            return
        request = _request(body)
        if request is not None:
            sock.send_multipart((*head, pack(self._answer(*request, snapshot))))  # type: ignore[attr-defined]

    def _answer(self, epoch: object, start: int, force: bool,
                snapshot: Callable[[], bytes]) -> dict[str, object]:
        batches = self.since(start)
        whole = (not force and epoch == self.epoch and 0 <= start <= self.next_seq
                 and len(batches) == self.next_seq - start)
        out: dict[str, object] = {"publisher_epoch": self.epoch, "next_seq": self.next_seq,
                                  "replayed_batches": [[s, p] for s, p in batches] if whole else []}
        if not whole:
            out["snapshot"] = snapshot()
        return out


def _request_frames(sock: object) -> list[bytes]:
    """The next request's frames, at most 4 copied: ZeroMQ's MAXMSGSIZE caps a frame, not
    their number, and a request has 3 (a peer's message of many frames is read and
    dropped uncopied, never held in a Python list)."""
    import zmq

    frames = [sock.recv()]  # type: ignore[attr-defined]
    while sock.getsockopt(zmq.RCVMORE):  # type: ignore[attr-defined]
        frame = sock.recv(copy=len(frames) < 4)  # type: ignore[attr-defined]
        if len(frames) < 4:
            frames.append(frame)
    return frames


def _request(body: bytes) -> tuple[object, int, bool] | None:
    """``(epoch, start_seq, force_snapshot)`` of a msgpack replay request, else None."""
    import msgpack

    try:  # (one whole value first, checked building nothing: unpackb allocates what a
        whole = msgpack.Unpacker(max_buffer_size=len(body))  # header announces before
        whole.feed(body)  # its items, and a KiB of nested headers announcing a KiB
        whole.skip()  # each cost 1.6 MB; once whole, the items are there)
        req = msgpack.unpackb(body, raw=False) if whole.tell() == len(body) else None
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(req, dict):
        return None
    start, force = req.get("start_seq", 0), req.get("force_snapshot", False)
    if not isinstance(start, int) or not isinstance(force, bool):
        return None
    return req.get("publisher_epoch"), start, force
