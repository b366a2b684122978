"""Feed a Router from N replicas' ZeroMQ event streams (extra ``prefixkv[events]``).

Per replica a SUB socket (live stream) and a DEALER socket (replay requests, spoken as a
REQ client would: ``[b"", start_seq]``). For each message ``(topic, seq, payload)``:

- the first message ever: if ``seq > 0`` ask replay from 0 (history before we joined);
- ``seq == last + 1``: apply;
- ``seq <= last``, or any message after the SUB socket lost its connection (a restarted
  replica numbers from 0 again, and may pass ``last`` before we reconnect): forget what
  the replica held and rebuild it from its replay buffer, as for a first message;
- ``seq > last + 1``: a gap; replay ``last + 1 ..``. If the replay does not start at
  ``last + 1`` (the buffer no longer has it) or times out, the gap cannot be filled:
  forget the replica (the index may only under-, never over-state what it holds) and
  go on from ``seq``.

Batches that fail to decode are counted in ``bad_batches`` and skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from .decode import DecodeError, decode_batch
from .router import Router

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """``endpoints``: replica -> ``(pub_endpoint, replay_endpoint or None)``.
    ``topic``: subscription prefix ("" takes everything). ``replay_timeout``: seconds.
    Raises RouterError for a replica the router does not know (before any socket)."""

    def __init__(self, router: Router, endpoints: Mapping[str, tuple[str, str | None]], *,
                 topic: str = "kv-events", replay_timeout: float = 1.0) -> None:
        import zmq

        self.router = router
        self.replay_timeout_ms = int(replay_timeout * 1000)
        self.last_seq: dict[str, int] = {}
        self.gaps_filled = self.resyncs = self.restarts = self.bad_batches = 0
        self._ctx = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._sub: dict[object, str] = {}
        self._monitors: dict[object, str] = {}
        self._reconnected: set[str] = set()
        self._replay: dict[str, object] = {}
        for replica in endpoints:
            router.forget(replica)  # RouterError for an unknown name; starts it empty
        for replica, (pub, replay) in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(pub)
            self._sub[sub] = replica
            self._poller.register(sub, zmq.POLLIN)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[monitor] = replica
            self._poller.register(monitor, zmq.POLLIN)
            if replay is not None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.connect(replay)
                self._replay[replica] = dealer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lock = threading.Lock()  # held while the index changes (thread mode)

    def poll(self, timeout: float = 0.0) -> int:
        """Handle every message waiting now (waiting up to ``timeout`` s for the first);
        returns how many live messages were handled."""
        import zmq

        handled = 0
        events = dict(self._poller.poll(int(timeout * 1000)))
        while events:
            for sock in events:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[attr-defined]
                except zmq.Again:
                    continue
                if sock in self._monitors:  # the connection dropped: restart or not, unknown
                    self._reconnected.add(self._monitors[sock])
                    continue
                if len(frames) == 3:
                    with self.lock:
                        self._on_message(self._sub[sock], int.from_bytes(frames[1], "big"),
                                         frames[2])
                    handled += 1
            events = dict(self._poller.poll(0))
        return handled

    def start(self) -> None:
        """Poll in a background thread until ``close``."""
        def loop() -> None:
            while not self._stop.is_set():
                self.poll(0.05)
        self._thread = threading.Thread(target=loop, name="prefixkv-router-sub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (if any) and close every socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for sub in self._sub:
            sub.disable_monitor()  # type: ignore[attr-defined]
        for sock in [*self._monitors, *self._sub, *self._replay.values()]:
            sock.close(linger=0)  # type: ignore[attr-defined]

    # ---- sequence handling ---------------------------------------------------------------

    def _on_message(self, replica: str, seq: int, payload: bytes) -> None:
        last = self.last_seq.get(replica)
        if last is not None and (seq <= last or replica in self._reconnected):
            self.restarts += 1
            self.router.forget(replica)
            last = None
        self._reconnected.discard(replica)
        if last is None and seq > 0 or last is not None and seq > last + 1:
            start = 0 if last is None else last + 1
            if self._fill(replica, start, seq):
                self.gaps_filled += 1
            else:
                self.resyncs += 1
                self.router.forget(replica)
        self._apply(replica, seq, payload)

    def _fill(self, replica: str, start: int, until: int) -> bool:
        """Replay ``start .. until-1`` and apply it; False when that range is not whole."""
        dealer = self._replay.get(replica)
        if dealer is None:
            return False
        while dealer.poll(0):  # type: ignore[attr-defined]
            dealer.recv_multipart()  # type: ignore[attr-defined]  # late replies of a timed-out replay
        dealer.send_multipart((b"", start.to_bytes(8, "big")))  # type: ignore[attr-defined]
        expect, whole = start, True
        while dealer.poll(self.replay_timeout_ms):  # type: ignore[attr-defined]
            frames = dealer.recv_multipart()  # type: ignore[attr-defined]
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                return whole and expect >= until
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= until:
                continue
            if seq != expect:
                whole = False
                continue
            if whole:
                self._apply(replica, seq, payload)
                expect += 1
        return False

    def _apply(self, replica: str, seq: int, payload: bytes) -> None:
        self.last_seq[replica] = seq
        try:
            _, events, _ = decode_batch(payload)
        except DecodeError:
            self.bad_batches += 1
            return
        self.router.apply(replica, events)
