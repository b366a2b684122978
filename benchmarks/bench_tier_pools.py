"""What a host tier costs in large pools (``bench_allocator.py``'s setting), side by side:
a pool without a tier and one with a tier as large as the pool, both filled to capacity
with cached blocks and alive together, measured in alternating rounds so that the drift
of this VM weighs on both alike.

    python benchmarks/bench_tier_pools.py [--pools 10000,1000000] [--rounds 8]
                                          [--out benchmarks/results]

Rows: admission of fresh 2k- and 32k-token prompts (every block evicts a cached one; with
the tier each eviction offloads, and once the tier is full each offload also drops the
least recently used slot's content), the same prompt again (device hits), and decode of
one request in the full pool (each new block evicts and offloads), the plan taken after
each admission and each decoded block (untimed), as an engine takes it every step.
Figures: medians of the rounds' medians (best round in brackets).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's prefixkv

from prefixkv import KVCacheManager

BS = 16
KINDS = ("no tier", "host tier 1x")


def prompt(rng: random.Random, n: int) -> list[int]:
    return list(array("H", rng.randbytes(2 * n)))


def filled(num_blocks: int, host_blocks: int, rng: random.Random) -> KVCacheManager:
    m = KVCacheManager(num_blocks, BS, seed=0, host_blocks=host_blocks)
    i = 0
    while m.num_cached_blocks < m.num_blocks:
        m.add_request(("fill", i), prompt(rng, 32768))
        m.take_kv_ops()
        m.free(("fill", i))
        i += 1
    return m


def admissions(m: KVCacheManager, prompts: list[list[int]]) -> float:
    """Median ns of ``add_request`` over ``prompts``, each planned and freed after."""
    out = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter_ns()
        m.add_request(i, p)
        out.append(time.perf_counter_ns() - t0)
        m.take_kv_ops()
        m.free(i)
    return statistics.median(out)


def decode(m: KVCacheManager, rng: random.Random, blocks: int) -> float:
    """ns per token of one request decoding ``blocks`` blocks' worth, one token a call."""
    m.add_request("d", prompt(rng, 100))
    m.take_kv_ops()
    total = 0
    for _ in range(blocks):
        tokens = [[rng.randrange(32000)] for _ in range(BS)]
        t0 = time.perf_counter_ns()
        for t in tokens:
            m.append_tokens("d", t)
        total += time.perf_counter_ns() - t0
        m.take_kv_ops()
    m.free("d")
    m.take_kv_ops()
    return total / (blocks * BS)


def run(num_blocks: int, rounds: int, rng: random.Random) -> dict[str, dict[str, list[float]]]:
    pools = {kind: filled(num_blocks, num_blocks if kind != "no tier" else 0, rng) for kind in KINDS}
    gc.collect()
    gc.freeze()  # as engines do after start-up (and bench_allocator.py)
    rows: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    for _ in range(rounds):
        for kind, m in pools.items():
            for n, count in ((2048, 60), (32768, 6)):
                fresh = [prompt(rng, n) for _ in range(count)]
                rows[kind].setdefault(f"{n // 1024}k miss", []).append(admissions(m, fresh))
                rows[kind].setdefault(f"{n // 1024}k hit", []).append(
                    admissions(m, [fresh[0]] * (count + 1)))  # the first one: a hit already
            rows[kind].setdefault("decode", []).append(decode(m, rng, 200))
    gc.unfreeze()
    return rows


def report(results: dict[int, dict], rounds: int) -> str:
    def cell(v: list[float], unit: float, digits: int) -> str:
        return f"{statistics.median(v) / unit:.{digits}f} ({min(v) / unit:.{digits}f})"

    lines = ["# A host tier's cost in large pools, side by side", "",
             f"{platform.platform()}, Python {platform.python_version()}; {rounds} alternating "
             "rounds, medians of the rounds' medians (best round in brackets).", "",
             "| pool blocks | row | no tier | host tier 1x | unit |", "|---:|---|---:|---:|---|"]
    for nb, rows in results.items():
        for row in rows["no tier"]:
            unit, scale, digits = (("us/token", 1e3, 3) if row == "decode" else
                                   ("ms", 1e6, 2) if row.startswith("32k") else ("us", 1e3, 1))
            lines.append(f"| {nb:,} | {row} | {cell(rows['no tier'][row], scale, digits)} | "
                         f"{cell(rows['host tier 1x'][row], scale, digits)} | {unit} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="10000,1000000", help="pool sizes in blocks, comma separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results", help="folder for tier-pools-cpu.{json,md}")
    args = ap.parse_args()
    pools = [int(p) for p in args.pools.split(",")]
    if min(pools) < 4096 or args.rounds < 1:
        ap.error("each pool needs >= 4096 blocks (two 32k-token prompts), and --rounds >= 1")
    rng = random.Random(0)
    results = {nb: run(nb, args.rounds, rng) for nb in pools}
    text = report(results, args.rounds)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier-pools-cpu.md").write_text(text)
    (out / "tier-pools-cpu.json").write_text(json.dumps(
        {str(nb): rows for nb, rows in results.items()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
