"""``StoreWriter``: store writes off the caller's thread.

The engine reads a ``StorePut``'s block into bytes while it runs the plan (before the
forward pass that could overwrite the block) and hands key and value here; a daemon
thread sends them in batches, one round trip each. A full queue drops the write (a
later miss, never a wait); a failed batch is counted and dropped. ``close`` sends what
is queued and ends the thread.
"""

from __future__ import annotations

import queue
import threading

from ..errors import ConfigError, check_positive
from ..results import StorePut
from .mistakes import own_mistake
from .protocol import StoreBackend
from .record import encode_value


class StoreWriter:
    """Writes to ``backend`` from one daemon thread; at most ``max_pending`` values wait,
    sent ``batch`` at a time. ``dropped``/``errors``/``written``: values dropped (queue
    full), values refused or lost in failed batches, values written. Raises ConfigError,
    before the thread starts, for a ``max_pending`` or ``batch`` that is not a positive
    int (``queue.Queue`` takes 0 or less as no bound) or a backend without ``put``.
    ``close`` ends the thread; writes given after it are dropped (counted)."""

    def __init__(self, backend: StoreBackend, *, max_pending: int = 1024, batch: int = 64) -> None:
        check_positive("max_pending", max_pending)
        check_positive("batch", batch)
        if not callable(getattr(backend, "put", None)):
            raise ConfigError(f"backend must be a StoreBackend (with put), got {backend!r}")
        self._backend, self._batch = backend, batch
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(max_pending)
        self._closed = False
        self.dropped = self.errors = self.written = 0
        self._thread = threading.Thread(target=self._run, name="prefixkv-store-writer", daemon=True)
        self._thread.start()

    def put(self, op: StorePut, payload: bytes | memoryview) -> bool:
        """Queue the write of ``op``'s block, whose KV bytes are ``payload`` (copied
        into the value now). Returns False when the queue was full or the writer
        closed (dropped). Raises ConfigError, nothing queued, for an ``op`` that is not
        a ``StorePut`` or a payload that is not bytes or a C-contiguous buffer."""
        if type(op) is not StorePut:
            raise ConfigError(f"StoreWriter.put takes a plan's StorePut, got {type(op).__name__}")
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait((op.key, encode_value(op.head, payload)))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued value was sent (or counted as failed)."""
        self._queue.join()

    def close(self) -> None:
        """Send every queued value (or count it as failed), then end the thread; a
        second call does nothing. Each batch's wait on the store is bounded by the
        backend's own timeout."""
        if self._closed:
            return
        self._closed = True
        # the thread ends when it takes None: behind every queued value (waits for room)
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        q = self._queue
        while True:
            first = q.get()
            if first is None:  # (``close``'s)
                q.task_done()
                return
            items = [first]
            stop = False
            while len(items) < self._batch:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                items.append(item)
            try:
                refused = self._backend.put(items) or 0  # (each value on its own)
                self.written += len(items) - refused
                self.errors += refused
            except Exception as exc:
                own_mistake(exc, "StoreBackend.put (StoreWriter)")
                self.errors += len(items)
            for _ in items:
                q.task_done()
            if stop:
                q.task_done()
                return
