"""What the vLLM plug-in's event conversion costs a step of a peer workload: the core's
events of each step (``KVCacheManager`` with events on, the workload replayed request by
request as ``bench_vllm_events.py --workloads`` does: admitted, events taken, freed)
turned into vLLM's objects by ``integrations.vllm.events.to_vllm_events``, which the
plug-in's ``take_events()`` runs on the scheduler's thread where it does not hand the
build off (``Telemetry.built_events``; with vLLM's ``ZmqEventPublisher`` it runs on the
publisher's thread instead).

    PYTHONPATH=src python benchmarks/plugin_removed_cost.py [WORKLOAD ...] [--passes 5]

Prints per step: the core's events, vLLM's events made, ``BlockRemoved`` hashes, the
conversion's bytecodes (``count_opcodes``, load-independent) and its thread CPU µs (the
least of ``--passes`` passes over every step). ``PREFIXKV_SRC=DIR`` imports prefixkv
from ``DIR`` (an A/B: run once for each tree).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from prefixkv import BlockRemoved, KVCacheManager  # noqa: E402
from prefixkv.bench.opcodes import count_opcodes  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.integrations.vllm.events import to_vllm_events  # noqa: E402

BS = 16
SPECS = (("full_attention", None),)


def steps(name: str) -> list[list[object]]:
    """Each request's step's core events (built), the workload replayed once."""
    wl = builtin(name)
    m = KVCacheManager(wl.pool_tokens // BS, BS, seed=0, enable_events=True, max_events=1 << 20)
    out = []
    for q in wl.requests:
        assert m.add_request(q.rid, list(q.prompt)) is not None
        out.append(list(m.take_events()))
        m.free(q.rid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*", default=["pressure", "chat"])
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args()
    for name in a.workloads:
        got = steps(name)
        n = len(got)
        made = sum(len(to_vllm_events(e, BS, SPECS)) for e in got)
        hashes = sum(len(x.block_hashes) for e in got for x in e if isinstance(x, BlockRemoved))
        ops = count_opcodes(lambda: [to_vllm_events(e, BS, SPECS) for e in got])  # noqa: B023
        best = min(_timed(got) for _ in range(a.passes))
        print(f"{name}: {n} steps; a step: {sum(map(len, got)) / n:.2f} core events -> "
              f"{made / n:.2f} vLLM events, {hashes / n:.2f} hashes removed; "
              f"to_vllm_events {ops / n:.1f} bytecodes, {best / n / 1e3:.2f} us (thread CPU)")


def _timed(got: list[list[object]]) -> int:
    t0 = time.thread_time_ns()
    for e in got:
        to_vllm_events(e, BS, SPECS)  # type: ignore[arg-type]
    return time.thread_time_ns() - t0


if __name__ == "__main__":
    main()
