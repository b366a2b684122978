"""``FetchCost``: whether fetching a store hit beats computing it again.

    fetch   = latency + blocks x block_bytes / bandwidth        (measured, per store)
    compute = blocks x block_size / prefill_tokens_per_s          (stated by the engine)

A hit is fetched only when ``fetch < compute``. Latency and bandwidth start from stated
guesses and then follow the last ``WINDOW`` fetches (bytes, seconds): a straight line
fitted through them (slope: 1 / bandwidth, intercept: latency) when their sizes differ,
else the latency alone (what the same bytes took, at the bandwidth known). A store that
slows down (or fails, which measures its time and no bytes) stops being asked for hits
it cannot deliver in time; one that was judged too slow is asked again once its figures
are ``STALE`` seconds old, so a recovery is seen. The prefill side is a linear
estimate: attention's cost grows with the prefix, so long prefixes cost more to compute
than this says (the rule errs towards computing).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import ConfigError

WINDOW = 16
"""Fetches the figures are fitted to."""
STALE = 10.0
"""Seconds after which a store judged too slow is asked again (its figures re-measured)."""
_REAL = (float, int)
_INF = float("inf")


class FetchCost:
    """``prefill_tokens_per_s``: the engine's prefill throughput, tokens per second, for
    the model it serves (default 20,000: about Llama-3-8B on one H100 at 40% of its bf16
    peak, 16 GFLOP a token). ``latency`` (seconds) and ``bandwidth`` (bytes per second):
    the starting guesses for the store (1 ms, 1 GB/s), then measured. Raises ConfigError
    for a figure that is not a positive finite number."""

    def __init__(self, prefill_tokens_per_s: float = 20_000.0, *, latency: float = 0.001,
                 bandwidth: float = 1e9) -> None:
        for name, v in (("prefill_tokens_per_s", prefill_tokens_per_s), ("latency", latency),
                        ("bandwidth", bandwidth)):
            if type(v) not in (int, float) or not 0 < v < float("inf"):
                raise ConfigError(f"{name} must be a positive finite number, got {v!r}")
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.latency, self.bandwidth = float(latency), float(bandwidth)
        self.measured_at = time.monotonic()
        self._seen: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()  # fetcher threads observe; ``worth`` reads floats

    def fetch_seconds(self, nbytes: int) -> float:
        """The expected time to fetch ``nbytes`` of values. Raises ConfigError unless
        ``nbytes`` is an int >= 0."""
        if type(nbytes) is not int or nbytes < 0:
            raise ConfigError(f"fetch_seconds: nbytes must be an int >= 0, got {nbytes!r}"[:200])
        return self.latency + nbytes / self.bandwidth

    def compute_seconds(self, tokens: int) -> float:
        """The engine's time to prefill ``tokens`` tokens (stated throughput). Raises
        ConfigError unless ``tokens`` is an int >= 0."""
        if type(tokens) is not int or tokens < 0:
            raise ConfigError(f"compute_seconds: tokens must be an int >= 0, got {tokens!r}"[:200])
        return tokens / self.prefill_tokens_per_s

    def worth(self, num_blocks: int, block_bytes: int, block_size: int, now: float) -> bool:
        """Whether fetching ``num_blocks`` blocks beats computing their tokens, or the
        figures are stale (then the fetch measures them again). Raises ConfigError
        unless the three counts are ints (``num_blocks``, ``block_bytes`` >= 0,
        ``block_size`` >= 1) and ``now`` a finite int or float."""
        if not (type(num_blocks) is int and type(block_bytes) is int and type(block_size) is int
                and num_blocks >= 0 and block_bytes >= 0 and block_size > 0
                and type(now) in _REAL and -_INF < now < _INF):
            raise ConfigError(f"worth: num_blocks, block_bytes (ints >= 0), block_size (an int "
                              f">= 1) and now (a finite time), got "
                              f"{(num_blocks, block_bytes, block_size, now)!r}"[:300])
        # (``fetch_seconds`` < ``compute_seconds``, inlined: the scheduler's thread asks)
        fetch = self.latency + num_blocks * block_bytes / self.bandwidth
        return (fetch < num_blocks * block_size / self.prefill_tokens_per_s
                or now - self.measured_at > STALE)

    def worth_for(self, block_bytes: int, block_size: int) -> Callable[[int, float], bool]:
        """``worth`` for blocks of ``block_bytes`` bytes and ``block_size`` tokens, those
        two checked once, here: the call ``(num_blocks, now)`` checks nothing (prefixkv's
        store link asks it, on the scheduler's thread, with a count of its own and
        ``time.monotonic()``). A subclass's own ``worth`` is asked through it. Raises
        ConfigError unless ``block_bytes`` is an int >= 0 and ``block_size`` one >= 1."""
        if not (type(block_bytes) is int and type(block_size) is int and block_bytes >= 0
                and block_size > 0):
            raise ConfigError(f"worth_for: block_bytes (an int >= 0) and block_size (an int "
                              f">= 1), got {(block_bytes, block_size)!r}"[:300])
        if type(self).worth is not FetchCost.worth:
            return lambda num_blocks, now: self.worth(num_blocks, block_bytes, block_size, now)

        def worth(num_blocks: int, now: float) -> bool:
            return (self.latency + num_blocks * block_bytes / self.bandwidth
                    < num_blocks * block_size / self.prefill_tokens_per_s
                    or now - self.measured_at > STALE)
        return worth

    def observe(self, nbytes: int, seconds: float, now: float) -> None:
        """A fetch moved ``nbytes`` (0: a miss or a failure) in ``seconds``. Called by
        the fetcher threads (``StoreLink``), several at once: the fit is taken under a
        lock, and each figure is one float assignment for ``worth`` to read. Raises
        ConfigError, nothing changed, unless ``nbytes`` is an int >= 0, ``seconds`` a
        finite number >= 0 and ``now`` a finite number (a NaN duration made the latency
        NaN: no fetch was worth it until the figures went stale)."""
        if not (type(nbytes) is int and nbytes >= 0 and type(seconds) in _REAL
                and 0 <= seconds < _INF and type(now) in _REAL and -_INF < now < _INF):
            raise ConfigError(f"observe: nbytes (an int >= 0), seconds (a finite number >= 0) "
                              f"and now (a finite time), got {(nbytes, seconds, now)!r}"[:300])
        with self._lock:
            seen = self._seen
            seen.append((float(nbytes), max(seconds, 1e-6)))
            n = len(seen)
            mb = sum(b for b, _ in seen) / n
            mt = sum(t for _, t in seen) / n
            var = sum((b - mb) ** 2 for b, _ in seen)
            slope = sum((b - mb) * (t - mt) for b, t in seen) / var if var else 0.0
            if slope > 0:  # sizes differ and bigger took longer: both figures
                self.bandwidth = 1 / slope
            self.latency = max(mt - mb / self.bandwidth, 1e-6)
            self.measured_at = now

    def crossover_tokens(self, bytes_per_token: float) -> float | None:
        """Tokens above which a fetch beats computing them, with these figures; None when
        it never does (the store moves a token's bytes slower than the engine computes it).
        Raises ConfigError unless ``bytes_per_token`` is a finite number >= 0."""
        if (not isinstance(bytes_per_token, (int, float)) or isinstance(bytes_per_token, bool)
                or not 0 <= bytes_per_token < _INF):
            raise ConfigError(f"crossover_tokens: bytes_per_token must be a finite number >= 0, "
                              f"got {bytes_per_token!r}"[:200])
        per_token = 1 / self.prefill_tokens_per_s - bytes_per_token / self.bandwidth
        return self.latency / per_token if per_token > 0 else None
