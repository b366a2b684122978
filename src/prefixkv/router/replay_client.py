"""The client side of a publisher's replay socket, in both of vLLM 0.33's forms (see
docs/events.md): ``ask`` (a msgpack request answered by one map: the missed batches or
a snapshot, with the publisher's epoch) and ``stream`` (the 8-byte request answered by
one message per batch, which every vLLM release with replay serves).
"""

from __future__ import annotations

from typing import Any

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayClient:
    """A DEALER connected to ``endpoint``, speaking as a REQ client would (``[b"", body]``).
    ``timeout_ms``: how long to wait for each reply message."""

    def __init__(self, ctx: Any, endpoint: str, timeout_ms: int) -> None:
        import zmq

        self.sock = ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.timeout_ms = timeout_ms

    def ask(self, epoch: str | None, start: int) -> dict[str, Any] | None:
        """The publisher's answer to ``{publisher_epoch, start_seq}``: a map with
        ``publisher_epoch``, ``next_seq``, ``replayed_batches`` and maybe ``snapshot``;
        None when it does not answer in this form (an older publisher streams its 8-byte
        reply instead, which is drained) or not in time."""
        import msgpack

        self._drain()
        request: dict[str, Any] = {"start_seq": start}
        if epoch is not None:
            request["publisher_epoch"] = epoch
        self.sock.send_multipart((b"", msgpack.packb(request)))
        if not self.sock.poll(self.timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        if len(frames) != 2:
            self._drain(self.timeout_ms)
            return None
        try:
            reply = msgpack.unpackb(frames[1], raw=False)
            ok = isinstance(reply, dict) and isinstance(reply.get("next_seq"), int)
        except Exception:  # msgpack raises several unrelated types
            ok = False
        return reply if ok else None

    def stream(self, start: int, until: int) -> list[tuple[int, bytes]] | None:
        """Batches ``start .. until-1`` by the 8-byte request; None unless all of them
        came (the buffer lost some, or no reply in time)."""
        self._drain()
        self.sock.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        while self.sock.poll(self.timeout_ms):
            seq_bytes, payload = self.sock.recv_multipart()[-2:]
            if seq_bytes == END_SEQ:
                whole = [s for s, _ in got] == list(range(start, until))
                return got if whole else None
            seq = int.from_bytes(seq_bytes, "big")
            if seq < until:
                got.append((seq, payload))
        return None

    def _drain(self, wait_ms: int = 0) -> None:
        """Drop late replies to an earlier, timed-out request."""
        while self.sock.poll(wait_ms):
            frames = self.sock.recv_multipart()
            if frames[-2:-1] == [END_SEQ]:
                wait_ms = 0

    def close(self) -> None:
        self.sock.close(linger=0)
