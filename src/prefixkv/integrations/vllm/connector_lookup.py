"""``Lookups``: the connector's store lookups (EXISTS) off vLLM's scheduler thread.

vLLM 0.33 lets ``get_num_new_matched_tokens`` answer ``(None, False)``, "cannot tell
yet": the scheduler skips the request this step and asks again the next. So::

    ask      a request's first question only records its keys (blocks past the local
             hit) and answers None
    flush    at the step's end (``build_connector_meta``) every key asked about in the
             step goes to the lookup thread, which sends them as one pipelined EXISTS
    answer   a later question takes the answer once it arrived, re-based on the local
             hit vLLM passes then (a hit that grew into the held blocks shrinks the
             answer; one outside what was asked asks again)
    fail     a lookup that failed, or was sent more than ``deadline`` seconds ago and
             has not come back, answers FAILED (the request recomputes), never waits
    forget   a request's lookup is dropped once its answer was used (its blocks were
             allocated), or when it finishes (ends, is aborted), answered or not

No call on the scheduler's thread touches the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Final

from ...store.mistakes import own_mistake
from ...store.protocol import StoreBackend
from ...store.redis_store import RedisStore

__all__ = ["FAILED", "Lookups"]

FAILED: Final = -1  # ``Lookups.answer``: the lookup failed or passed its deadline


class _Asked:
    """One request's lookup: blocks from ``start`` named by ``keys``; ``result`` None
    until the thread answers (the blocks held from ``start`` on, or FAILED)."""

    __slots__ = ("req_id", "start", "keys", "sent", "result")

    def __init__(self, req_id: str, start: int, keys: list[bytes]) -> None:
        self.req_id, self.start, self.keys = req_id, start, keys
        self.sent: float | None = None
        self.result: int | None = None


class Lookups:
    """Lookups of ``backend`` on a thread of their own. ``deadline``: seconds an answer
    may take once sent before the lookup counts as failed."""

    def __init__(self, backend: StoreBackend, deadline: float) -> None:
        self._backend, self._deadline = backend, deadline
        self._asked: dict[str, _Asked] = {}
        self._queue: list[_Asked] = []  # asked this step, not sent yet
        self._sending: list[_Asked] = []  # handed to the thread, not taken yet
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="prefixkv-lookup", daemon=True)
        self._thread.start()

    def answer(self, req_id: str, start: int, keys: list[bytes]) -> int | None:
        """How many of ``keys`` (the request's blocks from ``start``) the store holds,
        in a row from the first; None while the lookup is not back (asked now if it
        was not); FAILED when it failed or passed its deadline (then forgotten)."""
        a = self._asked.get(req_id)
        if a is not None:
            result = a.result
            if result is None:
                if a.sent is not None and time.monotonic() > a.sent + self._deadline:
                    del self._asked[req_id]
                    return FAILED
                return None
            if result == FAILED:
                del self._asked[req_id]
                return FAILED
            skip = start - a.start  # (a run that ended on a missing block tells that
            # block missing; one that held all it asked tells nothing past it)
            if 0 <= skip <= result and (skip < result or result < len(a.keys)):
                n = min(result - skip, len(keys))
                if keys[:n] == a.keys[skip:skip + n]:
                    return n
        a = self._asked[req_id] = _Asked(req_id, start, keys)
        self._queue.append(a)
        return None

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s lookup (an answer still under way is then ignored)."""
        self._asked.pop(req_id, None)

    def pending(self) -> int:
        """Requests with a lookup kept (asked, in flight or answered, not used yet)."""
        return len(self._asked)

    def in_flight(self) -> int:
        """Lookups sent and not back yet."""
        return sum(a.sent is not None and a.result is None for a in self._asked.values())

    def flush(self) -> None:
        """Send the lookups asked since the last flush (one pipeline), if any."""
        batch = [a for a in self._queue if self._asked.get(a.req_id) is a]
        self._queue = []
        if not batch:
            return
        now = time.monotonic()
        for a in batch:
            a.sent = now
        with self._cv:
            self._sending += batch
            self._cv.notify()

    def close(self) -> None:
        """Stop the thread (a lookup under way finishes first, within the backend's
        timeout); later answers never come."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._sending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._sending = self._sending, []
            try:
                held = held_runs(self._backend, [a.keys for a in batch])
            except Exception as exc:
                own_mistake(exc, "StoreBackend.held (vLLM connector's lookup thread)")
                held = [FAILED] * len(batch)
            for a, n in zip(batch, held, strict=True):
                a.result = n


def held_runs(backend: StoreBackend, runs: Sequence[Sequence[bytes]]) -> list[int]:
    """For each run of keys, how many the store holds in a row from its first: a
    RedisStore asks them all in one call under one deadline (``RedisStore.held_runs``),
    another backend one ``held`` per run. Raises the backend's errors."""
    if isinstance(backend, RedisStore):
        return backend.held_runs(runs)
    return [backend.held(keys) for keys in runs]
