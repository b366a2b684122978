"""Where the fetch runs, and what the scheduler's calls after it cost: ``store_pair.py``'s
loop (``bench_store.py --only inline --stepped``'s setup: prepared prompts, 4 KiB blocks,
sha256), this thread pinned to one CPU, the fetch run either on this thread (``inline``,
as ``store_pair.py`` and ``store_cold_calls.py`` run it) or on a thread pinned to another
CPU (``apart``, as a fetcher thread of ``SharedStore``'s executor runs it in an engine),
joined before the landing poll; rounds alternating ABBA in one process, thread CPU of the
start, the landing poll and the re-admission, medians. On a CPU whose last level is
shared and not inclusive of each core's own caches (AMD Zen), a fetch on another core
leaves this core's L1 and L2 as they were; inline, it sweeps them with its payload
(results/store25-r27.md).

    python benchmarks/store_fetch_core.py [--blocks 512 2048 8192] [--rounds 60]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefixkv import StoreWait  # noqa: E402
from prefixkv.store import RedisStore  # noqa: E402
from store_setup import BS, inline_setup, local_backend  # noqa: E402

COLUMNS = ("start", "land", "readmit")


def run(backend: RedisStore, blocks: int, rounds: int, here: int, there: int) -> None:
    m, ex, shared, prompts = inline_setup(backend, blocks)

    def apart() -> None:
        os.sched_setaffinity(0, {there})  # (this thread alone: Linux)
        ex.run()

    rows: dict[str, dict[str, list[float]]] = {w: {k: [] for k in COLUMNS}
                                               for w in ("inline", "apart")}
    def timed(call: Any, *args: Any) -> tuple[Any, float]:
        c = time.thread_time()
        out = call(*args)
        return out, time.thread_time() - c

    gc.disable()
    try:
        for r in range(2 * rounds + 8):  # the first rounds fill the pool: not counted
            where = "apart" if r % 4 in (1, 2) else "inline"  # (ABBA)
            prompt = m.prepare(prompts[r % 4])
            wait, start = timed(m.add_request, "r", prompt)
            assert isinstance(wait, StoreWait), wait
            m.take_kv_ops()  # (a step ends while the fetch runs)
            if where == "inline":
                ex.run()
            else:
                t = threading.Thread(target=apart)
                t.start()
                t.join()
            _, land = timed(m.poll_store)
            got, readmit = timed(m.add_request, "r", prompt)
            assert got.num_cached_tokens == blocks * BS, got
            m.free("r")
            m.take_kv_ops()
            if r >= 8:
                for k, v in zip(COLUMNS, (start, land, readmit), strict=True):
                    rows[where][k].append(v)
    finally:
        gc.enable()
        shared.close()
    print(f"{blocks} blocks, {rounds} rounds each, this thread on CPU {here}, the apart fetch "
          f"on CPU {there}, load {os.getloadavg()[0]:.2f}; thread CPU us, medians")
    show(rows)


def show(rows: dict[str, dict[str, list[float]]]) -> None:
    """One line per placement: the medians of each call, in us, and their sum."""
    for where, cols in rows.items():
        us = [statistics.median(cols[k]) * 1e6 for k in COLUMNS]
        print(f"  {where:7} " + "  ".join(f"{k} {t:6.1f}" for k, t in zip(COLUMNS, us, strict=True))
              + f"  sum {sum(us):6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("store_fetch_core.py needs two CPUs")
    here, there = cpus[0], cpus[1]
    os.sched_setaffinity(0, {here})  # (this thread: the scheduler's)
    with local_backend() as backend:
        for blocks in args.blocks:
            run(backend, blocks, args.rounds, here, there)


if __name__ == "__main__":
    main()
