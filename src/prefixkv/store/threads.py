"""``FetchThreads``: the threads that run a store's fetches.

A fetch is handed over from the scheduler's thread, so handing it over must cost that
thread as little as possible: one ``SimpleQueue.put`` (a C call, no ``Future``) under
one uncontended lock (the lock keeps a call from being queued behind ``shutdown``'s stop
signals, where no thread would run it), which wakes one idle thread.
``ThreadPoolExecutor.submit`` does the same job with a ``Future``, a work item, a lock
and an idle-thread semaphore: measured here on an idle pool, about 4 times the put's
cost on the submitting thread (tens of microseconds against one wake-up).
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
    thread survives it and takes the next call. Once ``shutdown`` has sent its stop
    signals, ``submit`` refuses (RuntimeError): no call waits behind them, run by none."""

    def __init__(self, count: int, name: str = "prefixkv-fetch") -> None:
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = SimpleQueue()
        self._fence = threading.Barrier(count + 1)  # (``shutdown``'s: every thread, and it)
        self._ended = False  # (``shutdown`` was called: the threads end or have ended)
        self._stopped = False  # (the stop signals are queued: ``submit`` refuses)
        # (``submit``'s check and put against ``shutdown``'s stop signals; uncontended
        # but while a shutdown sends them. Its cost is in ``bench_store.py --only split``'s
        # "hand the fetch over" step)
        self._gate = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on one of the threads (returns at once, nothing to wait on):
        one put under an uncontended lock, nothing counted. Raises RuntimeError once
        ``shutdown`` has stopped the threads (nothing is queued: the caller runs or drops
        the call; ``StoreWaits.start`` ends the admission as a miss)."""
        with self._gate:
            if self._stopped:
                raise RuntimeError("the fetch threads were shut down")
            self._queue.put((fn, args))

    def shutdown(self, wait: bool = True) -> None:
        """Wait until every call handed over has ended, those they handed over included
        (a fetch's parts), then end the threads. ``wait``: also join them. Call it once
        nothing is handed over from outside the threads any more.

        In rounds: one fence per thread goes into the queue, after every call queued
        before it, and each thread that takes one waits at it; once all are there, none
        runs a call (so none can hand one over), and an empty queue means nothing is
        left. Calls that the calls ahead of the fences handed over are queued behind
        them: the threads run those, and the next round fences them in. A second call
        only joins (``wait``)."""
        if self._ended:
            if wait:
                for t in self._threads:
                    t.join()
            return
        self._ended = True
        while True:
            for _ in self._threads:
                self._queue.put((self._at_fence, ()))
            self._fence.wait()  # every thread at a fence, between two calls
            done = self._queue.empty()
            self._fence.wait()  # (they go on)
            if done:
                break
        with self._gate:  # (no ``submit`` between the check and its put)
            self._stopped = True
            for _ in self._threads:
                self._queue.put(_STOP)
        if wait:
            for t in self._threads:
                t.join()

    def _at_fence(self) -> None:
        """A fence of ``shutdown``'s: wait until every thread is at one, then until
        ``shutdown`` has looked at the queue."""
        self._fence.wait()
        self._fence.wait()

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
