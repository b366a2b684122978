"""Capacity planning: how many requests fit a memory budget, and how the cache's hit rate
and the prefill it saves change with the pool size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..allocator import Allocator
from ..baselines import ContiguousAllocator, PagedAllocator
from ..core.block import blocks_for
from ..core.manager import KVCacheManager
from .replay import ReplayResult, replay
from .workloads import BenchRequest, Workload

ALLOCATORS = ("contiguous", "paged", "prefixkv")
SWEEP_FACTORS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2)


def make_allocator(name: str, num_blocks: int, block_size: int, max_model_len: int) -> Allocator:
    """A fresh allocator: ``contiguous`` (reserves ``max_model_len`` tokens per request),
    ``paged`` (no caching) or ``prefixkv`` (KVCacheManager, seed 0). Raises ValueError
    for another name."""
    if name == "contiguous":
        return ContiguousAllocator(num_blocks, block_size, max_model_len=max_model_len)
    if name == "paged":
        return PagedAllocator(num_blocks, block_size)
    if name == "prefixkv":
        return KVCacheManager(num_blocks, block_size, seed=0)
    raise ValueError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")


def requests_that_fit(alloc: Allocator, requests: Sequence[BenchRequest]) -> int:
    """Admit requests in order, each with its whole output appended at once, freeing
    none, and return how many are resident when the first one does not fit."""
    for i, req in enumerate(requests):
        if alloc.add_request(req.rid, req.prompt, extra=req.extra) is None:
            return i
        if alloc.append_tokens(req.rid, req.output) is None:
            return i
    return len(requests)


def blocks_needed(workload: Workload, block_size: int) -> int:
    """Blocks of the longest request: the smallest pool every allocator can run it in."""
    return blocks_for(workload.max_tokens(), block_size)


def default_pool_blocks(workload: Workload, block_size: int) -> int:
    """The workload's own pool in blocks, never below one longest request."""
    return max(workload.pool_tokens // block_size, blocks_needed(workload, block_size))


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One pool size of a sweep: prefixkv's counts and the paged baseline's."""

    pool_blocks: int
    prefixkv: ReplayResult
    paged: ReplayResult

    @property
    def saved_vs_paged(self) -> float:
        """Prefill compute saved against the paged baseline in the same pool (0.0 to 1.0;
        recomputes after preemption count on both sides)."""
        paged = self.paged.prefill_computed
        return 1 - self.prefixkv.prefill_computed / paged if paged else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"pool_blocks": self.pool_blocks, "saved_vs_paged": self.saved_vs_paged,
                "prefixkv": self.prefixkv.to_dict(), "paged": self.paged.to_dict()}


def sweep_sizes(workload: Workload, block_size: int, pool_blocks: int) -> list[int]:
    """Pool sizes around ``pool_blocks`` (``SWEEP_FACTORS``), none below one request."""
    low = blocks_needed(workload, block_size)
    return sorted({max(low, round(pool_blocks * f)) for f in SWEEP_FACTORS})


def sweep(workload: Workload, block_size: int, sizes: Sequence[int],
          tick: Callable[[str], None] = lambda label: None) -> list[SweepPoint]:
    """Replay the workload with prefixkv and the paged baseline at each pool size."""
    points = []
    for n in sizes:
        runs = []
        for name in ("prefixkv", "paged"):
            tick(f"{workload.name} sweep {name} {n} blocks")
            runs.append(replay(make_allocator(name, n, block_size, 1), workload, name))
        points.append(SweepPoint(n, *runs))
    return points
