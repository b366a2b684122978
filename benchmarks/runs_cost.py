"""What a cached run costs a step: chat's step (issue 26.5) with the cached history held
as fewer or more runs, the hit's length the same. Each ``store`` records its new blocks
as one run (``core/run.py``), so a chat turn hits one run a turn before it (plus the
system prompt's); ``claim`` takes each run through its head block, one bytes compare
and one segment of the free queue.

    python benchmarks/runs_cost.py [--splits 1,4] [--rounds 6] [--steps 100]

The cached prefix: a 512-token system prompt (its own run), then a 768-token history
stored as ``S`` runs for each ``S`` of ``--splits`` (``S`` admissions, each the prefix
so far plus one more part, freed: as chat's turns store it). Each step admits the
prefix plus 261 new tokens (16 new full blocks, a new tail each step: as a chat turn's
new message), a prepared prompt (``KVCacheManager.prepare``, untimed), with events on:
``add_request``, ``take_pending_events()`` and ``publish`` to a live ``EventPublisher``
timed (this thread's CPU time), then a 2 ms sleep and the free (untimed), as
``bench_vllm_events.py --workloads`` steps. Each round builds a manager per split, in
an order that alternates. Printed per split: the median over rounds of µs a step,
its ratio to the first split's (the median of the rounds' own), and the bytecodes a
step (``sys.settrace`` over a replay of its own; deterministic, whatever the load).
``PREFIXKV_SRC=DIR``: another tree's prefixkv.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.opcodes import count_opcodes  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402

BS = 16
SYSTEM, HISTORY, TAIL = 512, 768, 16 * BS + 5
CLOCK = time.thread_time_ns


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


def manager(system: list[int], parts: list[list[int]]) -> tuple[Any, EventPublisher]:
    """A manager whose cache holds ``system`` as one run, then each of ``parts`` as one
    run after it (each admitted with the prefix before it, then freed), and its publisher."""
    m = KVCacheManager(4096, BS, seed=0, enable_events=True, max_events=1 << 20)
    pub = EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)
    prefix: list[int] = []
    for i, part in enumerate([system, *parts]):
        prefix += part
        m.add_request(("warm", i), m.prepare(prefix))
        m.free(("warm", i))
    pub.publish(m.take_pending_events())
    return m, pub


def replay(m: Any, pub: EventPublisher, prefix: list[int], tails: list[list[int]],
           count: bool = False) -> float:
    """µs a step (or, ``count``: bytecodes a step) over ``tails``."""
    gc.collect()
    gc.freeze()
    total = 0
    for s, tail in enumerate(tails):
        p = m.prepare(prefix + tail)  # (an engine's input thread's: untimed)

        def step(s: int = s, p: Any = p) -> None:
            adm = m.add_request(("step", s), p)
            pub.publish(m.take_pending_events())
            assert adm.num_cached_tokens == len(prefix), adm  # the whole prefix hit

        if count:
            total += count_opcodes(step)
        else:
            t0 = CLOCK()
            step()
            total += CLOCK() - t0
        m.free(("step", s))
        time.sleep(0.002)  # (the forward pass)
    gc.unfreeze()
    return total / len(tails) / (1 if count else 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", default="1,4", help="runs the history is stored as, each")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    splits = [int(x) for x in a.splits.split(",")]
    if any(s < 1 or HISTORY % (s * BS) for s in splits):
        ap.error(f"each split must divide the history's {HISTORY // BS} blocks")
    rng = random.Random(1)
    system, history = tokens(rng, SYSTEM), tokens(rng, HISTORY)
    tails = [tokens(rng, TAIL) for _ in range(a.steps)]
    parts = {s: [history[i:i + HISTORY // s] for i in range(0, HISTORY, HISTORY // s)]
             for s in splits}
    prefix = system + history
    us: dict[int, list[float]] = {s: [] for s in splits}
    for r in range(a.rounds):
        for s in (splits if r % 2 == 0 else splits[::-1]):
            m, pub = manager(system, parts[s])
            us[s].append(replay(m, pub, prefix, tails))
            pub.close()
    first = us[splits[0]]
    for s in splits:
        m, pub = manager(system, parts[s])
        ops = replay(m, pub, prefix, tails[:20], count=True)
        pub.close()
        ratio = statistics.median(x / y for x, y in zip(us[s], first, strict=True))
        print(f"history as {s} run(s) (+ the system prompt's): {statistics.median(us[s]):.2f} µs "
              f"a step, x{ratio:.3f} the first; {ops:,.1f} bytecodes a step; rounds "
              f"{[round(x, 1) for x in us[s]]}; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
