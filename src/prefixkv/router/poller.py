"""The metrics poller: reads each replica's load from the ``/metrics`` it already serves
and hands it to the router on the router's own thread.

A background thread scrapes every replica's URL once per ``period`` (up to 16 at once,
each within ``timeout`` seconds from connect to the last byte, at most ``max_bytes``) and
parses the text with ``load.from_metrics``. It keeps, per replica, only the latest good
load and counts what failed (refused, timed out, an HTTP status other than 200, too
large, not UTF-8, not Prometheus text with ``vllm:kv_cache_usage_perc``). It never
touches the router: the ``Router`` is not thread-safe. ``apply()``, called on the
router's thread (before ``route``, under the subscriber's lock if one runs), hands the
new loads to ``Router.report_load`` with the time each was read, and forgets
(``Router.drop_load``) the load of a replica not read for ``stale_periods`` periods, so
that the router falls back to its own estimate instead of trusting an old figure::

    poller = MetricsPoller(router, {"r0": "http://10.0.0.5:8000/metrics", ...})
    poller.start()
    ...
    poller.apply()            # on the router's thread, before each route()
    choice = router.route(prompt)

``health()`` counts scrapes, failures and stale spells per replica;
``prefixkv.fleet.metrics.HealthMetrics.observe_poller`` exposes them to Prometheus.
Standard library only (``http.client``): no extra to install.
"""

from __future__ import annotations

import http.client
import io
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .clock import ForwardClock
from .load import ReplicaLoad, from_metrics
from .options import check_blocks, check_int, check_number, check_router
from .router import Router, RouterError


class ScrapeError(Exception):
    """One scrape failed (kept as the replica's ``last_error``; never raised to callers)."""


class MetricsPoller:
    """Args:
        router: the router to feed (``apply`` calls its ``report_load``/``drop_load``).
        urls: replica name -> its metrics URL (``http://`` or ``https://``); every name
            must be one of the router's replicas, at least one.
        period: seconds between the starts of two rounds of scrapes (> 0).
        timeout: seconds one scrape may take, connect to last byte (> 0, <= period).
        stale_periods: a replica not read for this many periods (since the poller
            started, if never) is stale: its load is dropped (>= 1).
        max_bytes: a larger answer is a failed scrape (>= 1).
        num_blocks: polled replica -> its pool in blocks (>= 1), passed to
            ``from_metrics`` (None, or a replica left out: the router's ``capacity``).
        clock: seconds; must be the router's clock (default: the router's ``clock``).
            Staleness counts its forward motion (a step back is no time: ``clock.py``).

    Raises RouterError for a bad option (of another type or range; a ``router`` that is
    not a Router), before any thread starts.
    """

    def __init__(self, router: Router, urls: Mapping[str, str], *, period: float = 1.0,
                 timeout: float = 0.5, stale_periods: int = 3, max_bytes: int = 1 << 22,
                 num_blocks: Mapping[str, int] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        replicas = check_router("router", router, RouterError)
        if not isinstance(urls, Mapping):
            raise RouterError(f"urls must map replicas to metrics URLs, got {urls!r}"[:200])
        urls = dict(urls)
        unknown = set(urls) - set(replicas)
        if not urls or unknown:
            raise RouterError(f"urls must name router replicas, at least one; unknown: "
                              f"{sorted(unknown)}, known: {list(replicas)}")
        for name, url in urls.items():
            parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise RouterError(f"metrics URL of {name!r} must be http(s)://host..., got "
                                  f"{url!r}")
        check_number("period", period, RouterError, lambda v: v > 0, "seconds > 0")
        check_number("timeout", timeout, RouterError, lambda v: 0 < v <= period,
                     f"seconds > 0 and <= period ({period})")
        check_int("stale_periods", stale_periods, RouterError, 1)
        check_int("max_bytes", max_bytes, RouterError, 1)
        # refused here: otherwise every scrape of the replica fails at from_metrics
        pools = check_blocks("num_blocks", num_blocks, RouterError, urls)
        self.router, self.urls = router, urls
        self.period, self.timeout, self.max_bytes = period, timeout, max_bytes
        self.stale_periods = stale_periods
        self.num_blocks = pools
        self.clock = router.clock if clock is None else clock
        self._clock = ForwardClock(self.clock, RouterError)  # staleness: forward motion
        self._lock = threading.Lock()  # guards the scrape thread's side below
        self._latest: dict[str, tuple[float, float, ReplicaLoad]] = {}  # not yet applied
        self._scrapes = dict.fromkeys(urls, 0)
        self._failures = dict.fromkeys(urls, 0)
        self._last_error: dict[str, str | None] = dict.fromkeys(urls)
        self._loop_errors = 0
        # the router thread's side (apply, health)
        self._started = self._clock()
        self._read_at: dict[str, float] = {}
        self._stale: set[str] = set()
        self._stale_spells = dict.fromkeys(urls, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(min(16, len(urls)), thread_name_prefix="prefixkv-scrape")

    # ---- the scrape thread's side --------------------------------------------------------

    def scrape(self) -> None:
        """One round: scrape every replica now (16 at once) and keep what came back for
        the next ``apply``. Blocks about ``timeout`` seconds per 16 replicas at most. A
        failed scrape is counted, never raised; RuntimeError after ``close``, RouterError
        for a clock reading that is not a finite number (the thread counts it in ``loop_errors``)."""
        list(self._pool.map(self._scrape_one, self.urls))

    def start(self) -> None:
        """Scrape every ``period`` in a background thread until ``close``; the scrapes
        reach the router only through ``apply``. Raises RouterError when the poller was
        started before (one thread per poller, started once: make another after ``close``)."""
        if self._thread is not None:
            raise RouterError("MetricsPoller.start() called twice")

        def loop() -> None:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    self.scrape()
                except Exception:  # noqa: BLE001 - the thread must outlive any failure
                    with self._lock:
                        self._loop_errors += 1
                self._stop.wait(max(0.0, self.period - (time.monotonic() - began)))

        self._thread = threading.Thread(target=loop, name="prefixkv-router-poller", daemon=True)
        self._thread.start()

    def _scrape_one(self, replica: str) -> None:
        read_at, at = self._clock.read()  # (a bad reading: RouterError, loop_errors)
        try:
            text = _fetch(self.urls[replica], self.timeout, self.max_bytes)
            load = from_metrics(text, num_blocks=self.num_blocks.get(replica))
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none escapes
            with self._lock:
                self._failures[replica] += 1
                self._last_error[replica] = f"{type(exc).__name__}: {exc}"[:300]
            return
        with self._lock:
            self._scrapes[replica] += 1
            self._latest[replica] = (read_at, at, load)

    # ---- the router thread's side --------------------------------------------------------

    def apply(self) -> int:
        """On the router's thread: report each replica's newest load read since the last
        call (``Router.report_load`` with when it was read), then drop the load of every
        replica not read for ``stale_periods`` periods (``Router.drop_load``; once per
        stale spell). Returns how many loads were reported."""
        limit = self._clock() - self.stale_periods * self.period  # (before any change)
        with self._lock:
            latest, self._latest = self._latest, {}
        for replica, (read_at, at, load) in latest.items():
            self.router.report_load(replica, load, read_at)
            self._read_at[replica] = at
            self._stale.discard(replica)
        for replica in self.urls:
            if replica not in self._stale and self._read_at.get(replica, self._started) < limit:
                self._stale.add(replica)
                self._stale_spells[replica] += 1
                self.router.drop_load(replica)
        return len(latest)

    def health(self) -> dict[str, Any]:
        """``alive`` (the thread runs), ``loop_errors``, and per replica (``replicas``):
        ``scrapes`` and ``failures`` (cumulative), ``last_error`` (None: none yet),
        ``stale`` (its load is dropped now, as of the last ``apply``), ``stale_spells``
        (times it became stale), ``age`` (seconds since the newest applied load was read;
        None: never). Call it on the router's thread."""
        now = self._clock()
        with self._lock:
            return {"alive": self.alive, "loop_errors": self._loop_errors, "replicas": {
                r: {"scrapes": self._scrapes[r], "failures": self._failures[r],
                    "last_error": self._last_error[r], "stale": r in self._stale,
                    "stale_spells": self._stale_spells[r],
                    "age": now - self._read_at[r] if r in self._read_at else None}
                for r in self.urls}}

    @property
    def alive(self) -> bool:
        """Whether the background thread (``start``) is running."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (it ends within about ``timeout``) and the scrape workers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout + self.period + 1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> MetricsPoller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fetch(url: str, timeout: float, max_bytes: int) -> str:
    """GET ``url``'s body as text, within ``timeout`` seconds from connect to the last
    byte (every read of the answer, status line and headers included, waits only for
    what is left, so a server that trickles bytes cannot stretch it). Raises
    ScrapeError, OSError or http.client.HTTPException."""
    deadline = time.monotonic() + timeout
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain"})
        conn.sock = _Bounded(conn.sock, deadline)  # the response reads through makefile()
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeError(f"HTTP {resp.status} {resp.reason}")
        body = bytearray()
        while chunk := resp.read1(65536):
            body += chunk
            if len(body) > max_bytes:
                raise ScrapeError(f"answer larger than {max_bytes} bytes")
        return body.decode("utf-8")
    finally:
        conn.close()


class _Bounded:
    """A connected socket whose ``makefile`` (what ``HTTPResponse`` reads through) reads
    within ``deadline``; everything else is the socket's."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str = "rb", *args: object, **kwargs: object) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """The socket's own raw reader (which keeps the socket open while the response
    reads, as ``HTTPResponse`` expects), each read waiting only for what is left before
    ``deadline``: the socket's timeout bounds one read, not the answer."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ScrapeError("timed out")
        self._sock.settimeout(left)
        n: int | None = self._raw.readinto(buffer)
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()
