"""Feed a Router from N replicas' ZeroMQ event streams (extra ``prefixkv[events]``).

Per replica a SUB socket (the live stream), a ReplayClient on its replay socket, and the
last sequence number applied. For each message ``(topic, seq, payload)``:

- ``seq == last + 1``: apply;
- ``seq`` at or below what a replay already applied: a duplicate, skipped;
- anything else (first contact, a gap, a smaller ``seq``, or any message after the SUB
  socket lost its connection, which a restarted replica needs): catch up.

Catching up asks the replica for ``last + 1 ..`` with the epoch it announced before
(vLLM 0.33's msgpack replay request). The answer is the missed batches (applied,
``gaps_filled``) or, on first contact, after a restart (a new epoch: ``restarts``) or
past the buffer, a snapshot of everything it holds (the replica is rebuilt from it,
``snapshots``). A publisher that does not answer this form (older vLLM) is asked by the
8-byte request from then on: missed batches are applied if the buffer still has them
all; otherwise, and on a smaller ``seq`` (a restart), the replica is forgotten
(``resyncs``, ``restarts``): the index may understate what a replica holds, never
overstate it.

Batches that fail to decode are counted in ``bad_batches`` and skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from .decode import DecodeError, decode_batch
from .replay_client import ReplayClient
from .router import Router


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
        self.gaps_filled = self.snapshots = self.resyncs = self.restarts = self.bad_batches = 0
        self._epoch: dict[str, str] = {}
        self._skip_through: dict[str, int] = {}  # live duplicates of replayed batches
        self._legacy: set[str] = set()  # replicas that answer only the 8-byte request
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._sub: dict[object, str] = {}
        self._monitors: dict[object, str] = {}
        self._reconnected: set[str] = set()
        self._replay: dict[str, ReplayClient] = {}
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
                self._replay[replica] = ReplayClient(self._ctx, replay, self.replay_timeout_ms)
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
        for sock in [*self._monitors, *self._sub]:
            sock.close(linger=0)  # type: ignore[attr-defined]
        for client in self._replay.values():
            client.close()

    # ---- sequence handling ---------------------------------------------------------------

    def _on_message(self, replica: str, seq: int, payload: bytes) -> None:
        last = self.last_seq.get(replica)
        reconnected = replica in self._reconnected
        self._reconnected.discard(replica)
        if last is not None and not reconnected:
            if seq == last + 1:
                self._apply(replica, seq, payload)
                return
            if seq <= self._skip_through.get(replica, -1):
                return
        if replica not in self._legacy and self._catch_up(replica, last):
            if seq > self.last_seq[replica]:  # the answer predates this message
                self._apply(replica, seq, payload)
            return
        if last is not None and (seq <= last or reconnected):
            self.restarts += 1
            self.router.forget(replica)
            last = None
        if last is None and seq > 0 or last is not None and seq > last + 1:
            client = self._replay.get(replica)
            batches = client.stream(0 if last is None else last + 1, seq) if client else None
            if batches is None:
                self.resyncs += 1
                self.router.forget(replica)
            else:
                self.gaps_filled += 1
                for s, p in batches:
                    self._apply(replica, s, p)
        self._apply(replica, seq, payload)

    def _catch_up(self, replica: str, last: int | None) -> bool:
        """Bring ``replica`` up to date by the msgpack replay request; False (and the
        replica is marked legacy) when it does not answer in that form."""
        client = self._replay.get(replica)
        epoch = self._epoch.get(replica)
        reply = client.ask(epoch, 0 if last is None else last + 1) if client else None
        if reply is None:
            self._legacy.add(replica)
            return False
        if epoch is not None and reply.get("publisher_epoch") != epoch:
            self.restarts += 1
        self._epoch[replica] = reply.get("publisher_epoch")  # type: ignore[assignment]
        if reply.get("snapshot") is not None:
            self.snapshots += 1
            self.router.forget(replica)
            self._decode_apply(replica, reply["snapshot"])
        else:
            self.gaps_filled += 1
            for _, p in reply.get("replayed_batches", ()):
                self._decode_apply(replica, p)
        self.last_seq[replica] = self._skip_through[replica] = reply["next_seq"] - 1
        return True

    def _apply(self, replica: str, seq: int, payload: bytes) -> None:
        self.last_seq[replica] = seq
        self._decode_apply(replica, payload)

    def _decode_apply(self, replica: str, payload: bytes) -> None:
        try:
            _, events, _ = decode_batch(payload)
        except DecodeError:
            self.bad_batches += 1
            return
        self.router.apply(replica, events)
