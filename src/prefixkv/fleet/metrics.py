"""Prometheus metrics of one manager, under the names vLLM's dashboards plot (extra
``prefixkv[metrics]``: prometheus_client).

- ``vllm:prefix_cache_queries_total`` (counter): prompt tokens looked up (new requests)
- ``vllm:prefix_cache_hits_total`` (counter): of those, tokens served from the cache
- ``vllm:kv_cache_usage_perc`` (gauge): fraction of blocks in use, 0..1 (1 = full)
- ``vllm:num_requests_waiting`` / ``vllm:num_requests_running`` (gauges): the engine's
  queue and batch, when the engine says (``observe``'s ``num_waiting``/``num_running``);
  with the usage, what a router's ``MetricsPoller`` reads (``router.load.from_metrics``)
- ``prefixkv:block_evictions_total`` (counter): cached blocks evicted (``BlockRemoved``)
- ``prefixkv:kv_events_dropped_total`` (counter): event batches the publisher dropped
- ``prefixkv:prefix_cache_hits_by_source_total`` (counter, label ``source``): hit tokens
  by the medium that served them ("GPU"; "CPU" once a host tier exists)

Every series carries vLLM's labels ``model_name`` and ``engine``. The hit rate a
dashboard shows is ``rate(hits) / rate(queries)``. Re-admissions after preemption are
not counted (vLLM counts them apart too); they are in the manager's ``preempted_*`` stats.

``HealthMetrics`` exposes the failures the fleet parts detect, from their ``health()``:

- ``prefixkv:kv_events_sender_up`` (gauge) and ``prefixkv:kv_events_send_errors_total``
  (counter): the publisher's sender thread runs; the steps it failed
- ``prefixkv:router_subscriber_up`` (gauge): the router's subscriber thread runs
- ``prefixkv:router_stream_events_total`` (counter, label ``event``): what the
  subscriber met on the streams (``bad_batches``, ``bad_replies``, ``restarts``,
  ``disconnects``, ``resyncs``, ``snapshots``, ``gaps_filled``, ``errors``,
  ``foreign_frames``, ``unsent_frames``, ``duplicates``, ``lossy_batches``,
  ``earlier_frames``:
  ``subscriber.COUNTERS``)
- ``prefixkv:router_replica_connected`` (gauge, label ``replica``): 1 while its SUB
  socket is connected
- ``prefixkv:router_block_size_mismatches_total`` (counter, label ``replica``): stored
  blocks not indexed because the replica's block size differs from the router's
- ``prefixkv:router_hash_mismatches_total`` (counter, label ``replica``): stored runs
  whose hashes the router computes otherwise (``Router.check_hashes``, a sample): the
  replica hashes with another mode, seed or format, and never hits
- ``prefixkv:router_index_refused_total`` (counter, label ``replica``): blocks not
  indexed because the replica's index reached its cap (``InProcessIndex``
  ``max_per_replica``)
- ``prefixkv:router_replica_lossy_batches`` (gauge, label ``replica``): batches of its
  events lost (undecodable) since its index was last emptied; above 0 the index may
  hold blocks the replica removed since
- ``prefixkv:router_load_scrapes_total`` / ``prefixkv:router_load_scrape_failures_total``
  (counters, label ``replica``): the router's ``MetricsPoller`` reads of the replica's
  ``/metrics``, and those that failed (refused, timed out, not Prometheus text, ...)
- ``prefixkv:router_load_stale`` (gauge, label ``replica``): 1 while its load is too old
  and the router routes on its own estimate; ``prefixkv:router_load_stale_spells_total``
  (counter): times it became so
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import PrefixKVError
from ..events import BlockRemoved
from ..stats import PrefixCacheStats


class MetricsError(PrefixKVError):
    """A bad argument to ``CacheMetrics.observe`` (refused before any series moves)."""


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked(stats: object, usage: object, events: object, hits_by_source: object,
             **counts: object) -> tuple[list[object], dict[str, int] | None]:
    """``observe``'s arguments checked (its doc): the events as a list (an iterator is
    read once, here) and ``hits_by_source`` as a dict; MetricsError otherwise."""
    if not isinstance(stats, PrefixCacheStats) or not (_count(stats.queries) and _count(stats.hits)):
        raise MetricsError(f"stats must be a PrefixCacheStats with queries and hits ints >= 0, "
                           f"got {stats!r}"[:300])
    if isinstance(usage, bool) or not isinstance(usage, (int, float)) or not 0 <= usage <= 1:
        raise MetricsError(f"usage must be a number in [0, 1], got {usage!r}"[:200])
    for name, value in counts.items():
        if value is not None and not _count(value):
            raise MetricsError(f"{name} must be an int >= 0 or None, got {value!r}"[:200])
    if hits_by_source is not None and not (isinstance(hits_by_source, Mapping) and all(
            isinstance(k, str) and _count(n) for k, n in hits_by_source.items())):
        raise MetricsError(f"hits_by_source must map sources (str) to hit tokens (ints >= 0), "
                           f"got {hits_by_source!r}"[:300])
    if not isinstance(events, Iterable):
        raise MetricsError(f"events must be an iterable of events, got {events!r}"[:200])
    return list(events), None if hits_by_source is None else dict(hits_by_source)


class CacheMetrics:
    """The series above in ``registry`` (default: a new private one, so that several
    engines in one process do not collide; pass ``prometheus_client.REGISTRY`` to use
    the global one). Call ``observe`` once per engine step."""

    def __init__(self, registry: Any = None, *, model_name: str = "prefixkv",
                 engine: str = "0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry: Any = CollectorRegistry() if registry is None else registry
        names, labels = ("model_name", "engine"), (model_name, engine)
        kw: dict[str, Any] = {"labelnames": names, "registry": self.registry}
        self.queries = Counter("vllm:prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache (new requests).", **kw)
        self.hits = Counter("vllm:prefix_cache_hits",
                            "Prompt tokens found in the prefix cache (new requests).", **kw)
        self.usage = Gauge("vllm:kv_cache_usage_perc",
                           "Fraction of KV-cache blocks in use, 0 to 1.", **kw)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests waiting to be admitted by the engine.", **kw)
        self.running = Gauge("vllm:num_requests_running",
                             "Requests in the engine's running batch.", **kw)
        self.evictions = Counter("prefixkv:block_evictions", "Cached blocks evicted.", **kw)
        self.dropped = Counter("prefixkv:kv_events_dropped",
                               "KV-event batches the publisher dropped (its queue full, or its "
                               "sender thread stopped).", **kw)
        self._by_source = Counter("prefixkv:prefix_cache_hits_by_source",
                                  "Prefix cache hit tokens by the medium that served them.",
                                  labelnames=(*names, "source"), registry=self.registry)
        self._labels = labels
        self._series: list[Any] = [m.labels(*labels) for m in
                        (self.queries, self.hits, self.usage, self.evictions, self.dropped)]
        self._dropped_seen = 0

    def observe(self, stats: PrefixCacheStats, usage: float, events: Iterable[object] = (),
                *, dropped_batches: int | None = None,
                hits_by_source: dict[str, int] | None = None, num_waiting: int | None = None,
                num_running: int | None = None) -> None:
        """Add one step: ``stats`` since the previous step (``take_stats()``), the
        manager's ``usage`` now, the step's events (evictions are counted from them),
        the publisher's cumulative ``dropped_batches``, hit tokens per medium (default:
        all hits from "GPU", the only medium before tiers exist), and the engine's
        waiting and running requests now (None: the gauge keeps its value).

        Raises MetricsError, before any series moves (a retry does not count the step
        twice), unless ``stats`` is a PrefixCacheStats with ``queries`` and ``hits`` ints
        >= 0, ``usage`` a number in [0, 1], ``events`` an iterable, ``hits_by_source``
        None or a mapping of str to ints >= 0, and each of ``dropped_batches``,
        ``num_waiting`` and ``num_running`` None or an int >= 0."""
        events, sources = _checked(stats, usage, events, hits_by_source,
                                   dropped_batches=dropped_batches, num_waiting=num_waiting,
                                   num_running=num_running)
        queries, hits, usage_g, evictions, dropped = self._series
        queries.inc(stats.queries)
        hits.inc(stats.hits)
        usage_g.set(usage)
        evictions.inc(sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)))
        if dropped_batches is not None and dropped_batches > self._dropped_seen:
            dropped.inc(dropped_batches - self._dropped_seen)
            self._dropped_seen = dropped_batches
        for source, n in (sources or {"GPU": stats.hits}).items():
            self._by_source.labels(*self._labels, source).inc(n)
        for gauge, value in ((self.waiting, num_waiting), (self.running, num_running)):
            if value is not None:
                gauge.labels(*self._labels).set(value)

    def exposition(self) -> bytes:
        """The text a ``/metrics`` endpoint serves."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class HealthMetrics:
    """The health series above in ``registry`` (default: a new private one). Feed it
    ``EventPublisher.health()`` and ``Subscriber.health()`` as often as it is scraped;
    counters advance by what the cumulative figures grew since the last call."""

    def __init__(self, registry: Any = None, *, model_name: str = "prefixkv",
                 engine: str = "0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry() if registry is None else registry
        reg, labels = self.registry, ("model_name", "engine")
        self._engine = (model_name, engine)
        self.sender_up = Gauge("prefixkv:kv_events_sender_up",
                               "1 while the KV-event publisher's sender thread runs.",
                               labels, registry=reg)
        self.send_errors = Counter("prefixkv:kv_events_send_errors",
                                   "Steps of the KV-event sender thread that failed.",
                                   labels, registry=reg)
        self.subscriber_up = Gauge("prefixkv:router_subscriber_up",
                                   "1 while the router's subscriber thread runs.", registry=reg)
        self.stream_events = Counter("prefixkv:router_stream_events",
                                     "What the router's subscriber met on the event streams.",
                                     ("event",), registry=reg)
        self.connected = Gauge("prefixkv:router_replica_connected",
                               "1 while the router's SUB socket to the replica is connected.",
                               ("replica",), registry=reg)
        self.mismatches = Counter("prefixkv:router_block_size_mismatches",
                                  "Stored blocks not indexed: the replica's block size differs.",
                                  ("replica",), registry=reg)
        self.hash_mismatches = Counter("prefixkv:router_hash_mismatches",
                                       "Stored runs whose hashes the router computes "
                                       "otherwise: the replica never hits.",
                                       ("replica",), registry=reg)
        self.refused = Counter("prefixkv:router_index_refused",
                               "Stored blocks not indexed: the replica's index is at its cap.",
                               ("replica",), registry=reg)
        self.lossy = Gauge("prefixkv:router_replica_lossy_batches",
                           "Batches of the replica's events lost since its index was emptied.",
                           ("replica",), registry=reg)
        self.load_scrapes = Counter("prefixkv:router_load_scrapes",
                                    "Reads of the replica's /metrics by the router's poller.",
                                    ("replica",), registry=reg)
        self.load_failures = Counter("prefixkv:router_load_scrape_failures",
                                     "Reads of the replica's /metrics that failed.",
                                     ("replica",), registry=reg)
        self.load_stale = Gauge("prefixkv:router_load_stale",
                                "1 while the replica's load is too old to route on.",
                                ("replica",), registry=reg)
        self.load_stale_spells = Counter("prefixkv:router_load_stale_spells",
                                         "Times the replica's load became too old.",
                                         ("replica",), registry=reg)
        self._seen: dict[tuple[str, ...], int] = {}

    def observe_publisher(self, health: Mapping[str, Any]) -> None:
        """Update from ``EventPublisher.health()``."""
        self.sender_up.labels(*self._engine).set(1 if health["sender_alive"] else 0)
        self._advance(self.send_errors.labels(*self._engine), ("send_errors",),
                      health["send_errors"])

    def observe_subscriber(self, health: Mapping[str, Any]) -> None:
        """Update from ``Subscriber.health()``."""
        self.subscriber_up.set(1 if health["alive"] else 0)
        for name, total in health["counters"].items():
            self._advance(self.stream_events.labels(name), ("stream", name), total)
        for replica, state in health["replicas"].items():
            self.connected.labels(replica).set(1 if state["connected"] else 0)
            self.lossy.labels(replica).set(state["lossy"])
            self._advance(self.mismatches.labels(replica), ("mismatch", replica),
                          state["block_size_mismatches"])
            self._advance(self.hash_mismatches.labels(replica), ("hash", replica),
                          state.get("hash_mismatches", 0))
            self._advance(self.refused.labels(replica), ("refused", replica),
                          state.get("index_refused", 0))

    def observe_poller(self, health: Mapping[str, Any]) -> None:
        """Update from ``MetricsPoller.health()``."""
        for replica, state in health["replicas"].items():
            self.load_stale.labels(replica).set(1 if state["stale"] else 0)
            for counter, name in ((self.load_scrapes, "scrapes"), (self.load_failures, "failures"),
                                  (self.load_stale_spells, "stale_spells")):
                self._advance(counter.labels(replica), (name, replica), state[name])

    def _advance(self, counter: Any, key: tuple[str, ...], total: int) -> None:
        """Add what ``total`` grew since the last call (a smaller one: a new process,
        counted from 0)."""
        seen = self._seen.get(key, 0)
        counter.inc(total - seen if total >= seen else total)
        self._seen[key] = total

    def exposition(self) -> bytes:
        """The text a ``/metrics`` endpoint serves."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
