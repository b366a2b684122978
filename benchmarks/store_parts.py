"""Where a store hit's scheduler-thread time goes, per function: the setup of
``bench_store.py --only inline --stepped`` (4 KiB blocks, sha256, prepared prompts, the
fetch run inline after a step ended), each named function below wrapped in this
thread's CPU clock (``time.thread_time_ns``: inclusive, a nested function counted in
its caller too, ~0.5 us a wrapper), medians of ``--rounds`` rounds for each hit size.
Results: benchmarks/results/store25-r20.md, store25b-r21.md.

    PYTHONPATH=src python benchmarks/store_parts.py [--blocks 512 2048] [--rounds 150]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prefixkv.core.store_landing as store_landing  # noqa: E402
import prefixkv.core.store_waits as store_waits  # noqa: E402
from prefixkv.core.pool import BlockPool  # noqa: E402
from prefixkv.index.content import ContentIndex  # noqa: E402
from prefixkv.store import RedisStore  # noqa: E402
from prefixkv.store.link import StoreLink  # noqa: E402
from prefixkv.tiers.host import HostTier  # noqa: E402
from store_setup import inline_setup, local_backend  # noqa: E402

WRAPPED: list[tuple[Any, list[str]]] = [
    (store_waits.StoreWaits, ["start", "reuse", "cancel", "take"]),
    (BlockPool, ["take", "acquire", "_evict", "release"]),
    (HostTier, ["reserve", "hold", "load", "load_ids", "transit", "find", "demote", "unreserve"]),
    (ContentIndex, ["match", "holds", "land_run", "adopt", "new_ids"]),
    (StoreLink, ["worth", "submit", "ended"]),
]
MODULE_WRAPPED = [(store_waits, "land"), (store_waits, "promote"),
                  (store_landing, "_on_device"), (store_waits, "Fetch")]

spent: defaultdict[str, int] = defaultdict(int)  # ns per label, this call


def wrap(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)
    clock = time.thread_time_ns

    def timed(*a: Any, **k: Any) -> Any:
        c = clock()
        try:
            return fn(*a, **k)
        finally:
            spent[label] += clock() - c

    setattr(owner, name, timed)


def wrap_all() -> None:
    for owner, names in WRAPPED:
        for name in names:
            wrap(owner, name, f"{owner.__name__}.{name}")
    for module, name in MODULE_WRAPPED:
        wrap(module, name, f"{name}()" if name == "Fetch" else name)


def run(backend: RedisStore, blocks: int, rounds: int) -> None:
    m, ex, shared, prompts = inline_setup(backend, blocks)
    rows: defaultdict[tuple[str, str], list[int]] = defaultdict(list)
    clock = time.thread_time_ns
    gc.disable()
    try:
        for r in range(rounds + 4):  # the first admissions fill the pool: not counted
            prompt = m.prepare(prompts[r % 4])
            for phase, call in (("start", partial(m.add_request, "r", prompt)),
                                ("land", m.poll_store),
                                ("readmit", partial(m.add_request, "r", prompt))):
                if phase == "land":  # a step ends while the fetch runs
                    m.take_kv_ops()
                    ex.run()
                spent.clear()
                c = clock()
                call()
                total = clock() - c
                if r >= 4:
                    rows[(phase, "(the call)")].append(total)
                    for label, ns in spent.items():
                        rows[(phase, label)].append(ns)
            m.free("r")
            m.take_kv_ops()
    finally:
        gc.enable()
        shared.close()
    order = {"start": 0, "land": 1, "readmit": 2}
    for (phase, label), ns in sorted(rows.items(),
                                     key=lambda kv: (order[kv[0][0]], -statistics.median(kv[1]))):
        print(f"{blocks:5} {phase:8} {label:24} {statistics.median(ns) / 1e3:7.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=150)
    args = ap.parse_args()
    wrap_all()
    with local_backend() as backend:
        print(f"load average {os.getloadavg()[0]:.1f}")
        for blocks in args.blocks:
            run(backend, blocks, args.rounds)
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
