"""Per function, what a step with KV events on runs: the account of ``events_account.py``
(the same replay: each request of a peer workload admitted, its step's events taken and
published to a live publisher, freed) broken down by function, for a step's cold-code
cost: after a forward pass the CPU's caches are cold, so how many distinct functions a
step touches (code objects, each its own bytecode and inline caches) matters beside its
bytecodes.

    python benchmarks/events_functions.py [--workloads chat,system-prompt] [--sides prefixkv]
                                          [--top 25]

Prints per workload and side: bytecodes, calls and distinct functions a step (every
request after the first three, ``sys.settrace`` call and opcode events over the step's
parts, the free apart), then the functions by bytecodes a step (their own, not their
callees'), with calls a step. Deterministic, whatever the load. ``PREFIXKV_SRC=DIR``:
another tree's prefixkv (as ``events_account.py``).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from events_steps import SIDES, SKIP  # noqa: E402
from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402
from vllm_side import BS, vllm_manager  # noqa: E402


def replay(side: str, name: str, pub: Any) -> tuple[int, collections.Counter[str],
                                                    collections.Counter[str], int]:
    """Steps counted, bytecodes and calls per function over them, and distinct functions
    summed over the steps."""
    wl = builtin(name, 1.0)
    pool = wl.pool_tokens // BS
    m = (vllm_manager(True, pool) if side == "vLLM" else
         KVCacheManager(pool, BS, seed=0, enable_events=True, max_events=1 << 20))
    make = SIDES[side][0]
    ops: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    seen: set[str] = set()
    distinct = 0

    def tracer(frame: Any, event: str, arg: object) -> Any:
        code = frame.f_code
        where = f"{code.co_qualname} ({Path(code.co_filename).name})"
        if event == "call":
            frame.f_trace_opcodes = True
            calls[where] += 1
            seen.add(where)
        elif event == "opcode":
            ops[where] += 1
        return tracer

    gc.collect()
    gc.freeze()
    for i, q in enumerate(wl.requests):
        *parts, free = make(m, pub, q)
        on = i >= SKIP
        seen.clear()
        for part in parts:
            sys.settrace(tracer if on else None)
            part()
            sys.settrace(None)
        distinct += len(seen)
        free()
    gc.unfreeze()
    return len(wl.requests) - SKIP, ops, calls, distinct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="system-prompt,chat,pressure,document")
    ap.add_argument("--sides", default="prefixkv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    pub = EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)
    vpub = None
    try:
        for name in a.workloads.split(","):
            for side in a.sides.split(","):
                if side == "vLLM" and vpub is None:
                    from vllm.distributed.kv_events import ZmqEventPublisher
                    vpub = ZmqEventPublisher(0, endpoint="inproc://events-functions", topic="kv")
                n, ops, calls, distinct = replay(side, name, pub if side == "prefixkv" else vpub)
                print(f"\n### {name}, {side}: {sum(ops.values()) / n:,.0f} bytecodes, "
                      f"{sum(calls.values()) / n:.1f} calls, {distinct / n:.1f} distinct "
                      f"functions a step ({n} steps)\n")
                print("| function | bytecodes a step | calls a step |\n|---|---:|---:|")
                for f, v in ops.most_common(a.top):
                    print(f"| {f} | {v / n:,.1f} | {calls[f] / n:.2f} |")
    finally:
        pub.close(timeout=30)
        if vpub is not None:
            vpub.shutdown()


if __name__ == "__main__":
    main()
