"""Prometheus metrics of one manager, under the names vLLM's dashboards plot (extra
``prefixkv[metrics]``: prometheus_client).

- ``vllm:prefix_cache_queries_total`` (counter): prompt tokens looked up (new requests)
- ``vllm:prefix_cache_hits_total`` (counter): of those, tokens served from the cache
- ``vllm:kv_cache_usage_perc`` (gauge): fraction of blocks in use, 0..1 (1 = full)
- ``prefixkv:block_evictions_total`` (counter): cached blocks evicted (``BlockRemoved``)
- ``prefixkv:kv_events_dropped_total`` (counter): event batches the publisher dropped
- ``prefixkv:prefix_cache_hits_by_source_total`` (counter, label ``source``): hit tokens
  by the medium that served them ("GPU"; "CPU" once a host tier exists)

Every series carries vLLM's labels ``model_name`` and ``engine``. The hit rate a
dashboard shows is ``rate(hits) / rate(queries)``. Re-admissions after preemption are
not counted (vLLM counts them apart too); they are in the manager's ``preempted_*`` stats.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..events import BlockRemoved
from ..stats import PrefixCacheStats

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


class CacheMetrics:
    """The series above in ``registry`` (default: a new private one, so that several
    engines in one process do not collide; pass ``prometheus_client.REGISTRY`` to use
    the global one). Call ``observe`` once per engine step."""

    def __init__(self, registry: CollectorRegistry | None = None, *, model_name: str = "prefixkv",
                 engine: str = "0") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = reg = CollectorRegistry() if registry is None else registry
        names, labels = ("model_name", "engine"), (model_name, engine)
        self.queries = Counter("vllm:prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache (new requests).",
                               labelnames=names, registry=reg)
        self.hits = Counter("vllm:prefix_cache_hits",
                            "Prompt tokens found in the prefix cache (new requests).",
                            labelnames=names, registry=reg)
        self.usage = Gauge("vllm:kv_cache_usage_perc",
                           "Fraction of KV-cache blocks in use, 0 to 1.", labelnames=names, registry=reg)
        self.evictions = Counter("prefixkv:block_evictions", "Cached blocks evicted.",
                                 labelnames=names, registry=reg)
        self.dropped = Counter("prefixkv:kv_events_dropped",
                               "KV-event batches dropped by a full publisher queue.",
                               labelnames=names, registry=reg)
        self._by_source = Counter("prefixkv:prefix_cache_hits_by_source",
                                  "Prefix cache hit tokens by the medium that served them.",
                                  labelnames=(*names, "source"), registry=reg)
        self._labels = labels
        self._counters = [m.labels(*labels) for m in (self.queries, self.hits, self.evictions,
                                                      self.dropped)]
        self._usage = self.usage.labels(*labels)
        self._dropped_seen = 0

    def observe(self, stats: PrefixCacheStats, usage: float, events: Iterable[object] = (),
                *, dropped_batches: int | None = None,
                hits_by_source: dict[str, int] | None = None) -> None:
        """Add one step: ``stats`` since the previous step (``take_stats()``), the
        manager's ``usage`` now, the step's events (evictions are counted from them),
        the publisher's cumulative ``dropped_batches``, and hit tokens per medium
        (default: all hits from "GPU", the only medium before tiers exist)."""
        queries, hits, evictions, dropped = self._counters
        queries.inc(stats.queries)
        hits.inc(stats.hits)
        self._usage.set(usage)
        evictions.inc(sum(isinstance(e, BlockRemoved) for e in events))
        if dropped_batches is not None and dropped_batches > self._dropped_seen:
            dropped.inc(dropped_batches - self._dropped_seen)
            self._dropped_seen = dropped_batches
        for source, n in (hits_by_source or {"GPU": stats.hits}).items():
            self._by_source.labels(*self._labels, source).inc(n)

    def exposition(self) -> bytes:
        """The text a ``/metrics`` endpoint serves."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
