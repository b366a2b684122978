"""What ``KVCacheManager.check_invariants()`` costs on its passing path, in the state
docs/design.md quotes: 2,500 blocks of 16, 2,450 of them cached (49 freed prompts of 50
blocks), 50 live requests of one partial block each.

    PYTHONPATH=src python benchmarks/bench_check_invariants.py

Prints the per-call thread CPU time of 7 rounds of 10 calls, sorted.
"""

from __future__ import annotations

import random
import time

from prefixkv import KVCacheManager


def main() -> None:
    m = KVCacheManager(2500, 16, hash_mode="xxhash")
    rng = random.Random(0)
    for i in range(49):  # cached: freed prompts of 50 full blocks
        assert m.add_request(f"c{i}", [rng.randrange(32000) for _ in range(50 * 16)]) is not None
        m.free(f"c{i}")
    for i in range(50):  # live: one partial block each (the 50 blocks never used)
        assert m.add_request(f"l{i}", [rng.randrange(32000) for _ in range(10)]) is not None
    rounds = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        for _ in range(10):
            m.check_invariants()
        rounds.append((time.thread_time_ns() - t0) / 10 / 1e6)
    print(f"2,500 blocks, {m.num_cached_blocks:,} cached, 50 live requests: check_invariants() "
          f"ms a call (thread CPU, 7 rounds of 10): " + " ".join(f"{r:.2f}" for r in sorted(rounds)))


if __name__ == "__main__":
    main()
