"""Prefix-cache statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counts over admissions: ``requests`` admitted, prompt tokens ``queries``-ed and
    ``hits`` (prompt tokens served from the cache)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries; 0.0 when nothing was queried."""
        return self.hits / self.queries if self.queries else 0.0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.requests + other.requests, self.queries + other.queries, self.hits + other.hits
        )


class StatsCounter:
    """Cumulative counts, with a get-and-reset view for per-step metrics."""

    __slots__ = ("total", "_taken")

    def __init__(self) -> None:
        self.total = PrefixCacheStats()
        self._taken = PrefixCacheStats()

    def record(self, queries: int, hits: int) -> None:
        t = self.total
        self.total = PrefixCacheStats(t.requests + 1, t.queries + queries, t.hits + hits)

    def take(self) -> PrefixCacheStats:
        """Counts since the previous ``take``."""
        s, t = self.total, self._taken
        self._taken = s
        return PrefixCacheStats(s.requests - t.requests, s.queries - t.queries, s.hits - t.hits)
