"""Hybrid managers in the states the free-order benchmarks time (bench_free_order.py,
uncache_cost.py). Each builder takes the ``prefixkv.groups`` module to build with, so that
a benchmark comparing two trees in one process builds each tree's own manager."""

from __future__ import annotations

from types import ModuleType
from typing import Any

CHUNK = 8192  # tokens a prefill step schedules


def _prefill(m: Any, n: int) -> None:
    """Admit request "r" of ``n`` tokens and schedule them in steps of ``CHUNK``."""
    assert m.add_request("r", list(range(1000, 1000 + n)), num_new_tokens=CHUNK) is not None
    while m.num_scheduled_tokens("r") < n:
        assert m.extend("r", min(CHUNK, n - m.num_scheduled_tokens("r"))) is not None


def finished(groups: ModuleType, k: int, block_size: int) -> Any:
    """Full attention beside a window of 4096 tokens, request "r" of ``k`` full blocks
    and a token prefilled (the window's blocks below its reach released): ``free("r")``
    next."""
    m = groups.HybridKVCacheManager([groups.full_attention(), groups.sliding_window(4096)],
                                    2 * k + 600, block_size, seed=0)
    _prefill(m, k * block_size + 1)
    return m


def decoding(groups: ModuleType, k: int, block_size: int, after: int = 0) -> Any:
    """gemma3-like groups (full attention, five windows of 1024 tokens), request "r" of a
    ``k``-block prompt prefilled and decoded up to a block's last slot (the windows then
    release one block each per boundary), then ``after`` tokens appended in one step: the
    next token's step releases what that step's queries no longer read (four blocks a
    window after 64 tokens)."""
    specs = [groups.full_attention()] + [groups.sliding_window(1024)] * 5
    m = groups.HybridKVCacheManager(specs, k + 6 * 1200, block_size, seed=0)
    _prefill(m, k * block_size - 1)
    for t in range(block_size + 1):
        assert m.append_tokens("r", [7 + t]) is not None
    while (m.num_scheduled_tokens("r") + 1) % block_size:
        assert m.append_tokens("r", [7]) is not None
    if after:
        assert m.append_tokens("r", [7] * after) is not None
    return m
