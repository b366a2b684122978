"""Wall time of a forgetting abort and of a normal free, medians of 200 rounds each
alternated, with ``cached`` other contents cached (noisy: compare trees run alternately).

    PYTHONPATH=src python benchmarks/orphans_wall.py 10000,50000 LABEL
"""

from __future__ import annotations

import statistics
import sys
import time

from prefixkv import KVCacheManager

BS = 4


def run(cached: int) -> tuple[float, float]:
    """Median µs of an abort (8 own blocks forgotten) and of a normal free."""
    m = KVCacheManager(cached + 64, BS, seed=0)
    for i in range(cached):
        m.add_request(("c", i), [10_000_000 + i] * BS + [1])
        m.free(("c", i))
    aborts, frees = [], []
    for r in range(200):
        m.add_request("x", [r * 1000 + j for j in range(8 * BS)] + [7])
        t = time.perf_counter()
        m.free("x", num_computed_tokens=0)
        aborts.append(time.perf_counter() - t)
        m.add_request("y", [r * 1000 + 500 + j for j in range(8 * BS)] + [7])
        t = time.perf_counter()
        m.free("y")
        frees.append(time.perf_counter() - t)
    return statistics.median(aborts) * 1e6, statistics.median(frees) * 1e6


def main() -> None:
    for c in map(int, sys.argv[1].split(",")):
        a, f = run(c)
        print(f"{sys.argv[2]} cached={c} abort={a:.1f}us free={f:.2f}us")


if __name__ == "__main__":
    main()
