"""Requests that fit a memory budget, and the pool-size sweep."""

from __future__ import annotations

import pytest

from prefixkv.bench.capacity import (
    blocks_needed,
    default_pool_blocks,
    make_allocator,
    requests_that_fit,
    sweep,
    sweep_sizes,
)
from prefixkv.bench.workloads import BenchRequest, Workload, builtin

PREFIX = tuple(range(8))  # two blocks of 4


def _requests(n: int) -> list[BenchRequest]:
    # 8 shared + 1 unique prompt tokens, 2 output tokens: 11 tokens, 3 blocks of 4.
    return [BenchRequest(f"r{i}", PREFIX + (100 + i,), (7, 7)) for i in range(n)]


@pytest.mark.parametrize("name,max_len,want", [
    ("paged", 11, 3),        # 3 blocks each: 9 <= 10 < 12
    ("contiguous", 16, 2),   # 4-block span each: 8 <= 10 < 12
    ("contiguous", 11, 3),   # 3-block span
    ("prefixkv", 11, 8),     # 3 blocks, then 1 new block each (2 prefix blocks shared)
])
def test_requests_that_fit_hand_computed(name, max_len, want):
    alloc = make_allocator(name, 10, 4, max_len)
    assert requests_that_fit(alloc, _requests(12)) == want


def test_all_fit_returns_the_count():
    assert requests_that_fit(make_allocator("prefixkv", 100, 4, 11), _requests(5)) == 5


def test_unknown_allocator():
    with pytest.raises(ValueError, match="choose from contiguous, paged, prefixkv"):
        make_allocator("buddy", 10, 4, 8)


def test_sweep_sizes_never_below_one_request():
    wl = Workload("w", "", tuple(_requests(3)), 64)
    assert default_pool_blocks(wl, 4) == 16
    assert sweep_sizes(wl, 4, 16) == [3, 4, 8, 16, 32]


def test_sweep_hit_rate_grows_with_pool():
    wl = builtin("pressure", scale=0.05, seed=1)
    points = sweep(wl, 16, [blocks_needed(wl, 16), 1024])
    small, large = points
    assert small.prefixkv.hit_rate < large.prefixkv.hit_rate
    assert large.paged.prefill_saved == 0
    assert 0 < large.saved_vs_paged < 1
    assert large.to_dict()["pool_blocks"] == 1024
