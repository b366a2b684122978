"""An injected clock's forward motion: what the router's staleness and TTLs count.

A reading below the last one (a clock stepped back) counts as no time passing
(``steps_back`` counts them): taken at face value, a step back of a day kept a replica
heard before it "heard within ``stale_after``" for a day more, and a load report read
before it counted as read after everything routed since. A reading that is not a finite
number (a bool is not one) raises the caller's error before anything changes: a NaN
compares false with every limit, so nothing would go stale again.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable


def real(value: object) -> bool:
    """``value`` is an int or a float, not a bool (a time or a span of seconds may be)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ForwardClock:
    """``clock``'s readings as forward motion (module doc). ``error``: the exception
    class raised for a bad reading. Thread-safe (a poller's scrape threads read it)."""

    def __init__(self, clock: Callable[[], float], error: type[Exception]) -> None:
        self.clock, self.error = clock, error
        self._now: float | None = None  # the forward motion so far, as a time
        self._last = 0.0  # the last reading
        self._lock = threading.Lock()
        self.steps_back = 0
        """How many readings were below the one before (counted as no time)."""

    def __call__(self) -> float:
        """The time now: the first reading, plus the forward steps since."""
        return self.read()[1]

    def read(self) -> tuple[float, float]:
        """``(reading, time)``: the raw reading and the forward time it stands for."""
        t = self.clock()
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise self.error(f"the clock must read a finite number of seconds, got {t!r}")
        t = float(t)
        with self._lock:
            if self._now is None:
                self._now = t
            elif t >= self._last:
                self._now += t - self._last
            else:
                self.steps_back += 1
            self._last = t
            return t, self._now

    def at(self, reading: float) -> float:
        """The forward time of an earlier raw ``reading`` (taken since the last step
        back: the same offset), never after the last time read (a reading taken before
        a step back would land in the future). The caller checks it is finite."""
        with self._lock:
            if self._now is None:
                return reading
            return self._now - max(0.0, self._last - reading)
