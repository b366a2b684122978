"""Feed a Router from N replicas' ZeroMQ event streams (extra ``prefixkv[events]``).

Per replica a SUB socket (the live stream), a monitor of that socket, a ReplayClient on
its replay socket, and the last sequence number applied. ``seq == last + 1`` is applied;
anything else (first contact, a gap, a smaller ``seq``, a reconnection) is checked with
the publisher: prefixkv's map request (map_replay.py: missed batches or a snapshot), or
for a vLLM publisher its buffer's answer to the 8-byte request (buffered.py: a frame it
does not hold was not sent by it and is not applied). A frame of another topic or rank
than the replica's is another publisher's (origin.py). The index may understate what a
replica holds, never overstate it; docs/router.md tabulates each case and its counter.
Nothing from the wire stops the thread: what it cannot explain is counted (``COUNTERS``,
``health()``), anything raised while handling a message in ``errors`` (logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from .buffered import run_to, sent
from .follow import ReplicaFollower
from .options import check_router
from .router import Router, RouterError
from .sockets import MAX_MESSAGE_BYTES, PING, ReplicaSockets, check_options, check_timeout

_log = logging.getLogger(__name__)
COUNTERS = ("gaps_filled", "snapshots", "resyncs", "restarts", "bad_batches", "bad_replies",
            "disconnects", "errors", "foreign_frames", "unsent_frames", "duplicates",
            "lossy_batches", "earlier_frames")
"""The subscriber's counters, as ``health()`` names them."""


class Subscriber(ReplicaFollower):
    """``endpoints``: replica -> ``(pub_endpoint, replay_endpoint or None)``.
    ``topic``: subscription prefix ("" takes everything). ``replay_timeout``: seconds.
    ``max_message_bytes``: the largest frame read (``sockets.MAX_MESSAGE_BYTES``,
    256 MiB): a publisher or replay endpoint sending a larger one is disconnected by
    ZeroMQ before it is read (counted in ``disconnects``; the replica is verified, its
    batch lost or replayed, as after any disconnect). ZeroMQ bounds no message's number
    of frames and holds a message whole before it is read; the subscriber copies at
    most ``frames.MAX_FRAMES`` + 1 of them (frames.py). ``ping``: seconds between ZeroMQ heartbeats
    on each SUB connection (``sockets.PING``, 1 s); one with no answer for three of them
    is dropped (``disconnects``) and made again: a host that vanished without closing
    its connections is noticed (``ReplicaSockets``; None: never noticed).
    Raises RouterError, before any change or socket, for a ``router`` that is not a
    Router, for a replica the router does not know and for arguments of other types or
    ranges (``sockets.check_options``)."""

    def __init__(self, router: Router, endpoints: Mapping[str, tuple[str, str | None]], *,
                 topic: str = "kv-events", replay_timeout: float = 1.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, ping: float | None = PING) -> None:
        check_options(check_router("router", router, RouterError), endpoints, topic,
                      replay_timeout, max_message_bytes, ping)
        super().__init__(router, endpoints, replay_timeout)
        for replica in endpoints:
            router.forget(replica)  # each starts empty
        self._sockets = ReplicaSockets(endpoints, topic, self.replay_timeout_ms,  # sockets.py
                                       max_message_bytes, ping)
        self._replay = self._sockets.replay
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, timeout: float = 0.0) -> int:
        """Handle the messages waiting now (waiting up to ``timeout`` s for the first),
        at most ``sockets.PER_SOCKET`` per socket (what is left waits for the next call:
        a publisher that never pauses cannot hold the caller); returns how many live
        messages were handled. Never raises for what it reads;
        RouterError for a ``timeout`` that is not a finite number of seconds >= 0."""
        check_timeout(timeout, "timeout")
        handled = 0
        for sock, frames in self._sockets.messages(timeout):
            try:  # (the lock is taken where the index changes: follow.py)
                handled += self._on_frames(sock, frames)
            except Exception as exc:  # a defect, not bad input (that is checked): go on
                self._failed(exc)
        return handled

    def start(self) -> None:
        """Poll in a background thread until ``close``. Take ``lock`` around ``route``
        calls then: the thread holds it while it changes the index, never while it waits
        for a replay answer."""
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll(0.05)
                except Exception as exc:  # the poller itself failed: count, retry
                    self._failed(exc)
                    time.sleep(0.05)
        self._thread = threading.Thread(target=loop, name="prefixkv-router-sub", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the background thread (``start``) is running."""
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict[str, Any]:
        """``counters`` (name -> count, the names of ``COUNTERS``), ``last_error``,
        ``alive``, and per replica (``replicas``): ``connected``, ``last_seq`` (None: not
        following), ``protocol`` ("prefixkv" or "vllm": which replay form it answers;
        None before it was asked), ``block_size_mismatches`` (the router's count, see
        ``Router.apply``), ``hash_mismatches`` and ``hash_checked`` (the router's counts
        of stored runs whose hashes it computes otherwise, and of blocks compared: see
        ``Router.check_hashes``), ``lossy`` (``Router.lossy``: batches of its events lost
        since its index was last emptied; > 0, the index may overstate what it holds)
        and ``index_refused`` (blocks not indexed: its index at its cap,
        ``InProcessIndex.refused``; 0 for an index without a cap)."""
        out: dict[str, Any] = {"counters": {name: getattr(self, name) for name in COUNTERS}}
        refused = getattr(self.router.index, "refused", {})  # (InProcessIndex's cap)
        out.update(last_error=self.last_error, alive=self.alive, replicas={
            r: {"connected": self.connected[r], "last_seq": self.last_seq.get(r),
                "protocol": "vllm" if r in self._legacy else
                            "prefixkv" if r in self._epoch else None,
                "block_size_mismatches": self.router.block_size_mismatches[r],
                "hash_mismatches": self.router.hash_mismatches[r],
                "hash_checked": self.router.hash_checked[r],
                "lossy": self.router.lossy[r], "index_refused": refused.get(r, 0)}
            for r in self.connected})
        return out

    def close(self) -> None:
        """Stop the thread (if any) and close every socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._sockets.close()

    # ---- what arrives --------------------------------------------------------------------

    def _on_frames(self, sock: Any, frames: list[bytes]) -> int:
        """Handle one message of a SUB or monitor socket; 1 for a live message."""
        if sock in self._sockets.monitors:
            self._on_monitor(self._sockets.monitors[sock], frames)
            return 0
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_batches += 1  # not (topic, 8-byte seq, payload)
            return 1
        self._on_message(self._sockets.subs[sock], int.from_bytes(frames[1], "big"), frames[2],
                         frames[0])
        return 1

    def _on_monitor(self, replica: str, frames: list[bytes]) -> None:
        if ReplicaSockets.is_disconnect(frames):
            self.disconnects += 1
            self.connected[replica] = False
            self._unverified.add(replica)
            with self.lock:  # (a reconnection may find another life: its hashes sampled)
                self.router._hash_check.rearm(replica)
            # a new socket: what the dead connection sent and is unread goes with the old
            self._sockets.reconnect(replica)  # (ZeroMQ may not reconnect: a message over the cap)
            return
        self.connected[replica] = True  # a handshake with a publisher succeeded
        if replica in self._unverified:
            self._verify(replica)

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        _log.error("prefixkv router subscriber: %s", self.last_error, exc_info=exc)

    # ---- sequence handling ---------------------------------------------------------------

    def _on_message(self, replica: str, seq: int, payload: bytes, topic: bytes | None = None
                    ) -> None:
        """A live message (``topic`` its first frame; None: not known)."""
        if replica in self._unverified:
            self._verify(replica)
        if self._origins.foreign(replica, topic, payload):
            self.foreign_frames += 1
            return
        last = self.last_seq.get(replica)
        # an undecodable frame is checked with its publisher, whose copy may be whole (cut
        # on the way: taken as applied, its events were lost and the index kept stale entries)
        whole = replica not in self._replay or self._origins.decode(payload) is not None
        # the next number, stamped before the batch applied last: another publisher's
        # with the same topic and rank, or the clock set back (origin.py); asked below
        earlier = last is not None and seq == last + 1 and self._origins.earlier(replica, payload)
        self.earlier_frames += earlier
        if last is not None:
            if seq == last + 1 and whole and not earlier:
                if self._replayed:  # (the live duplicates came before this: in order)
                    self._replayed.pop(replica, None)
                self._apply(replica, seq, payload, topic)
                return
            if replica not in self._legacy and seq <= self._skip_through.get(replica, -1):
                return
            if seq <= last and self._replayed.get(replica, {}).get(seq) == payload:
                return  # a vLLM publisher's batch that its verification applied
        bad = self.bad_batches
        if replica not in self._legacy and self._catch_up(replica, last):
            # The answer, sent after this message arrived, covers it: a message it does
            # not cover was not sent by this life (a dead life's, a foreign or corrupt
            # frame) and is not applied. Only a replica forgotten after bad answers or
            # none (map_replay.py: no ``_skip_through``; an answer's -1
            # is a publisher that sent nothing yet) follows from this message on.
            if self.last_seq[replica] < 0 and replica not in self._skip_through and not earlier:
                self._apply(replica, seq, payload, topic)
            else:  # cut on the way, if the publisher's copy of it was not bad too
                self.unsent_frames += not whole and self.bad_batches == bad
            return
        if last is not None and seq <= last:  # numbering started again: a restart, if
            held = self._held(replica, seq)  # the publisher there now sent it (else a
            if held is not None and not sent(held, seq, payload):  # foreign or corrupt
                self._unsent(replica)  # frame, not applied)
                return
            if held is not None and sent(held, last, self._last_payload.get(replica, b"")):
                self.duplicates += 1  # it sent what was applied last too: an old frame again
                return
            self.restarts += 1
            self._forget(replica)
            last = None
        start = 0 if last is None else last + 1
        if seq > start or last is None or not whole or earlier:  # a gap, nothing applied
            # (first contact, after a forget), a cut or an earlier-stamped frame: the
            # publisher's buffer says what it sent
            held = self._held(replica, last if last is not None and last >= 0 else start)
            if held is not None and last is not None and replica in self._last_payload and any(
                    s == last for s, _ in held) and not sent(held, last, self._last_payload[replica]):
                self._verify(replica)  # its batch ``last`` is not the one applied: a new
                # life (its monitor's report missed or not read yet), rebuilt from its buffer
                self.unsent_frames += self._replayed.get(replica, {}).get(seq) != payload
                return
            run = None if held is None else run_to(held, start, seq, payload)
            if run is not None:
                self.gaps_filled += len(run) > 1
                for s, p in run[:-1]:
                    self._apply(replica, s, p)
                self._apply(replica, seq, payload, topic)  # (the message: its topic known)
                return
            if held is not None and not sent(held, seq, payload):
                self._unsent(replica)  # not this life's (buffered.py): is it still that life?
                return
            if seq > start or earlier or not whole:  # its buffer lost the gap, or no
                self.resyncs += 1  # answer: follow from here (an earlier-stamped or cut
                self._forget(replica)  # frame unjudged: not applied, nor the index kept,
                if earlier or not whole:  # whose entries its removals may have ended;
                    self.last_seq[replica] = seq  # no payload kept: none was applied, and
                    self._origins.passed(replica, payload)  # its copy, compared with this
                    return  # one, made the live publisher pass for a new life)
        self._apply(replica, seq, payload, topic)
