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
