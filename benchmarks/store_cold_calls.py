"""store-r17's figure: what a store hit's three calls on the scheduler's thread (start,
landing poll, re-admission) cost with the CPU caches as the fetch leaves them, against
the same calls after ``--sweep`` bytes of memory were written just before one of them
(``--where start``: before the start; ``land``: after the fetch, before the landing).
The setup of ``bench_store.py --only inline`` (4 KiB blocks, sha256, the fetch run
inline between the start and the landing, four prompts in turn, prepared), rounds in
pairs, every other pair swept, in one process; medians of ``--rounds`` each. Results:
benchmarks/results/store-r17.md (a 512-block start swept costs more than a 2048-block
one unswept: what the larger hit costs more is its calls' working set fetched again).

    PYTHONPATH=src python benchmarks/store_cold_calls.py [--blocks 512 2048]
        [--rounds 200] [--sweep 8388608] [--where start|land]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefixkv import StoreWait  # noqa: E402
from prefixkv.store import RedisStore  # noqa: E402
from store_setup import inline_setup, local_backend  # noqa: E402


def run(backend: RedisStore, blocks: int, rounds: int, sweep: int, where: str) -> None:
    m, ex, shared, prompts = inline_setup(backend, blocks)
    dst, src = bytearray(sweep), bytes(sweep)
    rows: dict[bool, dict[str, list[int]]] = {False: {}, True: {}}
    gc.disable()
    try:
        for r in range(2 * rounds + 8):  # the first rounds fill the pool: not counted
            swept = bool((r // 2) % 2)
            prompt = m.prepare(prompts[r % 4])
            got = {}
            for phase, call in (("start", partial(m.add_request, "r", prompt)),
                                ("land", m.poll_store),
                                ("readmit", partial(m.add_request, "r", prompt))):
                if phase == "land":
                    ex.run()
                if swept and phase == where:
                    dst[:] = src
                c = time.thread_time_ns()
                out = call()
                got[phase] = time.thread_time_ns() - c
                if phase == "start":
                    assert isinstance(out, StoreWait), out
            m.free("r")
            m.take_kv_ops()
            if r >= 8:
                for k, v in got.items():
                    rows[swept].setdefault(k, []).append(v)
    finally:
        gc.enable()
        shared.close()
    print(f"{blocks} blocks, {rounds} rounds each, {sweep >> 20} MiB written before "
          f"{where!r} in the swept rounds, load {os.getloadavg()[0]:.2f}; thread CPU us, medians")
    for swept, times in rows.items():
        med = {k: statistics.median(v) / 1e3 for k, v in times.items()}
        print(f"  {'swept' if swept else 'unswept':8} " + "  ".join(
            f"{k} {v:6.1f}" for k, v in med.items()) + f"  sum {sum(med.values()):6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--sweep", type=int, default=8 << 20)
    ap.add_argument("--where", choices=["start", "land"], default="start")
    args = ap.parse_args()
    with local_backend() as backend:
        for blocks in args.blocks:
            run(backend, blocks, args.rounds, args.sweep, args.where)


if __name__ == "__main__":
    main()
