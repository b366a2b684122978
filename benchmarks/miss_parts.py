"""Where a long miss's time goes, per part: ``add_request`` + ``free`` of prompts that
share nothing with the cache (each evicting as many blocks as it stores, in a pool
filled by the warm-up ones), as ``radix_timing.py``'s miss rows admit them (lists of
ids, made fresh, so their ints are as cold as there). Each part is a wrapped function,
timed inclusively in this thread's CPU time; medians over the prompts after the
warm-up. Run it once per tree (``PYTHONPATH=<tree>/src``), alternating trees.

    PYTHONPATH=src python benchmarks/miss_parts.py [--tokens 32768] [--rounds 3]

Parts: ``encode_prompt`` (the list of ids to the uint32 array and the block chunks),
``claim`` (the one probe that misses), ``prepare``, ``take`` (of which ``_evict``, of
which ``drop``: the index's part of the eviction), ``store``, ``release`` (in
``free``); ``add_request`` and ``free`` whole, and the two together (``total``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Callable
from time import thread_time_ns
from typing import Any

import prefixkv.core.admission as admission
from prefixkv import KVCacheManager
from prefixkv.core.pool import BlockPool
from prefixkv.index.content import ContentIndex

PARTS: list[tuple[Any, str]] = [
    (admission, "encode_prompt"), (ContentIndex, "claim"), (ContentIndex, "prepare"),
    (BlockPool, "take"), (BlockPool, "_evict"), (ContentIndex, "drop"),
    (ContentIndex, "store"), (KVCacheManager, "add_request"), (BlockPool, "release"),
    (KVCacheManager, "free"),
]


def wrapped(f: Callable[..., Any], name: str, spent: dict[str, int]) -> Callable[..., Any]:
    def timed(*args: Any, **kw: Any) -> Any:
        t = thread_time_ns()
        try:
            return f(*args, **kw)
        finally:
            spent[name] = spent.get(name, 0) + thread_time_ns() - t
    return timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3, help="rounds of 20 timed misses")
    args = p.parse_args(argv)
    spent: dict[str, int] = {}
    for owner, name in PARTS:
        setattr(owner, name, wrapped(getattr(owner, name), name, spent))
    m = KVCacheManager(10_000, 16)
    rng = random.Random(0)
    got: dict[str, list[float]] = {}
    for r in range(args.rounds):
        prompts = [[rng.randrange(32000) for _ in range(args.tokens)] for _ in range(26)]
        for i, prompt in enumerate(prompts):
            spent.clear()
            t = thread_time_ns()
            m.add_request((r, i), prompt)
            m.free((r, i))
            total = thread_time_ns() - t
            if i >= 6:  # (the pool is full, and each prompt evicts, from here on)
                for name, ns in [*spent.items(), ("total", total)]:
                    got.setdefault(name, []).append(ns / 1e3)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.tokens}-token misses, "
          f"{len(got['total'])} timed; µs, median")
    for name, v in got.items():
        print(f"| {name} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    main()
