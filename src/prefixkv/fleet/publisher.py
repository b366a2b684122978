"""Publish a manager's events over ZeroMQ the way vLLM does, without ever blocking the
scheduler (extra ``prefixkv[events]``: pyzmq + msgpack).

    engine step ──publish(events)──> bounded queue ──thread──> PUB  (topic, seq, payload)
                 (mirror of held hashes)                   └──> replay buffer ──> ROUTER

``publish`` only puts the batch on a bounded queue: a list of events, or a
``PendingEvents`` (``take_pending_events()``) that the thread builds, so that the chain
hashes are computed off the scheduler's thread. While batches keep coming the thread
polls the queue every millisecond (``POLL_S``), so that ``publish`` wakes no thread.
The thread follows every batch, in order, in a mirror of the hashes the replica holds
(mirror.py).
When the queue is full the batch is dropped and counted, and the thread discards what
is still queued (following it in the mirror) and sends a *snapshot* instead
(``AllBlocksCleared`` then one ``BlockStored`` per medium and layer group holding every
held hash, parent nil, no tokens, as vLLM's own snapshots look), so a consumer that
applies the stream in order is exact again. The thread numbers batches 0, 1, 2, ...,
keeps the last ``buffer_steps`` for replay and answers replay requests on the ROUTER
socket; when idle for ``heartbeat`` seconds it sends an empty batch, so that a router can
tell a quiet replica from a dead one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from ..event_log import NOTHING, PendingEvents, _Taken
from ..events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from .bind import INBOUND_HWM, bound
from .mirror import HeldMirror, snapshot_events
from .options import check_publisher_options
from .replay import MAX_REQUEST_BYTES, PER_STEP, ReplayBuffer
from .wire import WireError, check_options, pack, to_wire_events

_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)
_Item = list[Event] | PendingEvents  # a step's events
_log = logging.getLogger(__name__)

POLL_S = 0.001
"""While batches keep coming (the last one taken less than ``LINGER_S`` ago), the thread
looks for the next one every ``POLL_S`` seconds instead of sleeping on the queue until a
``publish`` wakes it: so ``publish`` wakes no thread, a system call the scheduler's thread
paid each step (~3 µs a step measured, benchmarks/results/events-r11.md); a batch waits
at most ``POLL_S`` more before it is sent. While it polls, the thread asks for the GIL
every ``POLL_S``: a scheduler's thread that holds it past ``sys.getswitchinterval()``
(5 ms) hands it over then, for a look at the queue, as to any thread that waits for it."""
LINGER_S = 0.25
"""How long after its last batch the thread keeps polling before it sleeps on the queue
again (an idle engine costs no wake-ups but the heartbeat's)."""


class EventPublisher:
    """PUB socket bound at ``endpoint`` (``tcp://127.0.0.1:*`` picks a free port; the
    bound address is ``self.endpoint``), ROUTER at ``replay_endpoint`` when given.

    Args:
        block_size: the manager's block size (sent in every BlockStored).
        topic: first frame of each message ("kv-events" is what vLLM's example uses).
        hash_format: "int" (vLLM's default, low 64 bits) or "bytes" (whole digest).
        dp_rank: data-parallel rank written in every batch.
        buffer_steps: batches kept for replay (> 0, at most ``options.MAX_BUFFER_STEPS``).
        max_queue: batches waiting for the thread before ``publish`` drops (> 0).
        heartbeat: seconds of silence before an empty batch is sent (None: never).
        hwm: ZeroMQ's high-water mark of each socket, in messages (0: no limit).

    Raises WireError for an option out of range or of another type (an endpoint or topic
    that is not a str) before any socket is opened.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay_endpoint: str | None = None,
                 *, block_size: int, topic: str = "kv-events", hash_format: str = "int",
                 dp_rank: int = 0, buffer_steps: int = 10_000, max_queue: int = 1024,
                 heartbeat: float | None = 1.0, hwm: int = 100_000) -> None:
        check_options(block_size, hash_format, dp_rank)
        check_publisher_options(endpoint, replay_endpoint, topic, buffer_steps, max_queue,
                                heartbeat, hwm)
        import zmq

        self.block_size, self.hash_format, self.dp_rank = block_size, hash_format, dp_rank
        self.topic = topic.encode()
        self.heartbeat = heartbeat
        self.dropped_batches = 0
        self.published_batches = 0
        self.snapshots = 0
        self.send_errors = 0
        self.last_error: str | None = None
        # A SimpleQueue (C) bounded by hand: ``Queue``'s condition variables cost the
        # scheduler's thread ~3x more per put, each step, when the thread sleeps in get()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._max_queue = max_queue
        self.replay = ReplayBuffer(buffer_steps)
        # what the replica holds, as the batches the thread took say (mirror.py)
        self._held = HeldMirror()
        self._lock = threading.Lock()
        self._resync = False  # a snapshot is due: it states the batches in ``_behind``
        self._behind: list[_Item] = []  # batches published since a drop, not queued
        self._ctx: Any = zmq.Context.instance()
        pub = self._ctx.socket(zmq.PUB)  # (what a PUB reads is its peers' subscriptions:
        pub.setsockopt(zmq.MAXMSGSIZE, max(MAX_REQUEST_BYTES, 1 + len(self.topic)))  # small)
        self._pub = bound(pub, endpoint, hwm, INBOUND_HWM)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # (replay.py)
            self._replay = bound(self._replay, replay_endpoint, hwm, INBOUND_HWM)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False
        self._running = True  # until ``_run`` returns or raises (cheaper than is_alive())
        self._last_sent = time.monotonic()
        self._busy_until = 0.0  # (monotonic) the thread polls the queue until then: ``_step``
        self._thread = threading.Thread(target=self._run, name="prefixkv-events", daemon=True)
        self._thread.start()

    # ---- caller side (the scheduler's thread) --------------------------------------------

    def publish(self, events: Sequence[object] | PendingEvents) -> bool:
        """Queue one step's events, ``mgr.take_events()`` or ``mgr.take_pending_events()``
        (built by the thread: the scheduler's thread computes no hash); never blocks,
        not even while the thread restates the replica in a snapshot (the common case
        takes no lock). Call it from one thread (the scheduler's). An empty batch is not
        sent. Returns False when the batch was dropped (counted in
        ``dropped_batches``): the queue was full (a snapshot follows, which states it),
        or the sender thread is no longer running (``health()["sender_alive"]``; nothing
        will be sent, and a ``PendingEvents`` is built by whoever takes the manager's
        events next). Raises WireError if closed or if an item of a list is not a
        BlockStored/BlockRemoved/AllBlocksCleared (nothing is queued then)."""
        if self._closed:
            raise WireError("publish() after close()")
        if not self._running:
            self.dropped_batches += 1
            return False
        item: _Item
        if events is NOTHING:  # (a step that recorded nothing: most decode steps)
            return True
        # (``type`` first: 3.11 runs ``type(x)`` with no C call; ``isinstance``'s C path
        # is cold after the forward pass, and a step's batch is a ``_Taken``, which mypy
        # does not narrow ``events`` to)
        if type(events) is _Taken or isinstance(events, PendingEvents):
            if events.empty:  # type: ignore[union-attr]
                return True
            item = events  # type: ignore[assignment]
        else:
            if not events:
                return True
            for ev in events:
                if not isinstance(ev, _EVENTS):
                    raise WireError(f"not a prefixkv event: {type(ev).__name__}")
            item = cast("list[Event]", list(events))
        # The common case, without the lock: no snapshot due, none of its batches left
        # (``_behind``), room in the queue. Only this caller puts; the thread, restating
        # (``_drain``, under the lock), clears ``_resync``, empties the queue, then takes
        # ``_behind``: so a batch put here while it drains is either taken in the drain,
        # with no earlier batch in ``_behind`` to come after it, or queued after it, and
        # sent after the snapshot; a ``_resync`` the thread sets after the check here
        # is followed by a drain that takes this batch (or the snapshot precedes it).
        if not self._resync and not self._behind and self._queue.qsize() < self._max_queue:
            self._queue.put(item)
            return True
        with self._lock:
            if self._resync:  # a snapshot is due, which states this batch too
                self._behind.append(item)
                return True
            if self._queue.qsize() >= self._max_queue:  # (only publish puts, under the lock)
                self.dropped_batches += 1
                self._behind.append(item)
                self._resync = True
                return False
            self._queue.put(item)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread, close the
        sockets (left to the daemon thread if it has not stopped by then). Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._queue.put(None)  # (behind what is queued: the thread sends that first)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            return  # sockets belong to the thread (ZeroMQ sockets are not thread-safe)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """The thread: ``_serve`` until it ends, however it ends (then ``publish`` drops)."""
        try:
            self._serve()
        finally:
            self._running = False

    def _serve(self) -> None:
        """Serve replays, send batches and heartbeats until ``close``. A step that raises
        is counted (``send_errors``, ``last_error``, logged) and the thread goes on;
        the batch it was sending is lost, so a snapshot follows at once."""
        while True:
            try:
                if self._step():
                    return
            except Exception as exc:
                self.send_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                _log.error("prefixkv event publisher: %s", self.last_error, exc_info=exc)
                with self._lock:
                    self._resync = True
                time.sleep(0.05)  # a fault that repeats must not spin

    def _step(self) -> bool:
        """One turn of the thread; True when ``close`` was asked. Within ``LINGER_S`` of
        the last batch taken it looks for the next one every ``POLL_S`` (``publish`` then wakes
        nobody); otherwise it waits on the queue (the next ``publish`` wakes it)."""
        if self._replay is not None:
            for _ in range(PER_STEP):  # (replay.py: a flood of requests must not stop us)
                if not self._replay.poll(0):
                    break
                self.replay.serve(self._replay, self._snapshot, self.topic)
        polling = time.monotonic() < self._busy_until
        try:
            item = self._queue.get_nowait() if polling else self._queue.get(timeout=0.02)
        except queue.Empty:
            if self._resync:  # after a failed step: restate what the replica holds
                stop = self._drain()
                self._send(self._snapshot())
                return stop
            if self.heartbeat is not None and time.monotonic() - self._last_sent >= self.heartbeat:
                self._send(pack([time.time(), [], self.dp_rank]))
            if polling:
                time.sleep(POLL_S)
            return False
        if item is None:
            return True
        self._busy_until = time.monotonic() + LINGER_S
        events = self._held.follow(item)
        if self._resync:  # the snapshot covers this item and all queued ones
            stop = self._drain()
            self._send(self._snapshot())
            return stop
        self._send(pack([time.time(), to_wire_events(events, self.block_size, self.hash_format),
                         self.dp_rank]))
        return False

    def health(self) -> dict[str, Any]:
        """``sender_alive`` (the thread runs: batches are being sent), the counters
        ``published_batches``, ``dropped_batches``, ``snapshots``, ``send_errors``,
        ``last_error``, and the replay buffer's ``epoch`` and ``next_seq``."""
        return {"sender_alive": self._thread.is_alive(), "published_batches": self.published_batches,
                "dropped_batches": self.dropped_batches, "snapshots": self.snapshots,
                "send_errors": self.send_errors, "last_error": self.last_error,
                "epoch": self.replay.epoch, "next_seq": self.replay.next_seq}

    def _drain(self) -> bool:
        """After a drop: empty the queue, then take the batches published since, and
        follow them all in the mirror, in order (the next snapshot states them, so nothing
        older follows it); returns whether close() was asked."""
        items: list[_Item | None] = []
        with self._lock:
            self._resync = False
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items += self._behind
            self._behind = []
        for item in items:
            if item is not None:
                self._held.follow(item)
        return None in items

    def _snapshot(self) -> bytes:
        """A batch stating every held hash: ``AllBlocksCleared``, then one ``BlockStored``
        per medium and group (parent nil, no tokens, the group's fields), as vLLM's
        snapshots look: every batch the thread has followed, none that is still queued."""
        with self._lock:
            held = self._held.sorted_copy()
        events = snapshot_events(held, self.block_size, self.hash_format)
        self.snapshots += 1
        return pack([time.time(), events, self.dp_rank])

    def _send(self, payload: bytes) -> None:
        seq = self.replay.add(payload)
        self.published_batches += 1  # before sending: a reader who got it sees the count
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._last_sent = time.monotonic()

