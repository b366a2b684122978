"""Prefix-cache statistics."""

from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counts over admissions. New requests: ``requests`` admitted, prompt tokens
    ``queries``-ed and ``hits`` (prompt tokens served from the cache). Re-admissions of
    preempted requests (``add_request(..., resumed=True)``) count apart, in the
    ``preempted_*`` fields, so that recomputation after preemption does not make the hit
    rate look better than the traffic deserves (vLLM splits them the same way).
    ``host_hits``: the part of ``hits`` served from the host tier (loaded), the rest from
    device blocks (vLLM's ``hits_by_source``). ``store_hits``: the part of ``hits``
    served from the shared store (fetched, then loaded). ``store_errors``: store fetches
    that failed (down, past their deadline, a key that failed): each cost misses, never a
    request. ``store_rejected``: fetches cut short by a stored value that failed the
    content check (another model, layout or prefix under the key; corrupted, truncated)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    host_hits: int = 0
    store_hits: int = 0
    store_errors: int = 0
    store_rejected: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries of new requests; 0.0 when nothing was queried."""
        return self.hits / self.queries if self.queries else 0.0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


class StatsCounter:
    """Cumulative counts, with a get-and-reset view for per-step metrics."""

    __slots__ = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
                 "preempted_hits", "host_hits", "store_hits", "store_errors", "store_rejected",
                 "_taken")

    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0
        self.host_hits = self.store_hits = self.store_errors = self.store_rejected = 0
        self._taken = PrefixCacheStats()

    def record(self, queries: int, hits: int, resumed: bool = False, host_hits: int = 0,
               store_hits: int = 0) -> None:
        if resumed:
            self.preempted_requests += 1
            self.preempted_queries += queries
            self.preempted_hits += hits
        else:
            self.requests += 1
            self.queries += queries
            self.hits += hits
            self.host_hits += host_hits
            self.store_hits += store_hits

    @property
    def total(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests, self.queries, self.hits, self.preempted_requests,
                                self.preempted_queries, self.preempted_hits, self.host_hits,
                                self.store_hits, self.store_errors, self.store_rejected)

    def take(self) -> PrefixCacheStats:
        """Counts since the previous ``take``."""
        s, t = self.total, self._taken
        self._taken = s
        return s - t
