"""A peer workload's step with KV events on, vLLM 0.33 and prefixkv side by side, with
the work the step's timing leaves out counted too: is the comparison of
``events_pair.py`` / ``bench_vllm_events.py --workloads`` between equal work?

    python benchmarks/events_offpath.py [chat] [rounds 4]

Each side replays the workload as ``events_pair.py`` does (a fresh manager, each request
admitted, its step's events taken and published to the side's own live publisher, freed,
a 2 ms sleep), in rounds that alternate which side goes first. Printed per side, µs a
request, the median round: the step (timed as there), the input thread's part
(vLLM's ``Request()``, which hashes the prompt's blocks; prefixkv's ``prepare``), the
free, the other threads' CPU (the publishers', which build, encode and send the batch
during the sleep: the process's CPU over the replay less the main thread's) and all
of it; then whether each request's hit was the same on both sides, and vLLM's events a
step. ``PREFIXKV_SRC=DIR``: another tree's prefixkv.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402
from vllm_side import BS, vllm_manager, vllm_request, vllm_step  # noqa: E402

THREAD, PROCESS = time.thread_time_ns, time.process_time_ns
PARTS = ("step", "input", "free", "others", "all")


def replay(side: str, requests: Any, pool: int, pub: Any) -> tuple[dict[str, float], list[int], float]:
    """µs a request of each part (module doc), each request's hit in tokens, and the
    events a step (vLLM's; 0 for prefixkv, whose batch is built on its thread)."""
    ours = side != "vLLM"
    m = (KVCacheManager(pool, BS, seed=0, enable_events=True, max_events=1 << 20) if ours
         else vllm_manager(True, pool))
    got = dict.fromkeys(("input", "step", "free"), 0)
    hits: list[int] = []
    events = 0
    gc.collect()
    gc.freeze()
    p0, m0 = PROCESS(), THREAD()
    for q in requests:
        t0 = THREAD()
        x = m.prepare(q.prompt) if ours else vllm_request(q.rid, list(q.prompt))
        t1 = THREAD()
        if ours:
            hit = m.add_request(q.rid, x).num_cached_tokens
            pub.publish(m.take_pending_events())
        else:
            hit, taken = vllm_step(m, x, pub)
            events += taken
        t2 = THREAD()
        m.free(q.rid if ours else x)
        got["input"] += t1 - t0
        got["step"] += t2 - t1
        got["free"] += THREAD() - t2
        hits.append(hit)
        time.sleep(0.002)
    time.sleep(0.2)  # (the publisher's thread drains)
    main, every = THREAD() - m0, PROCESS() - p0
    gc.unfreeze()
    n = len(requests)
    out = {k: v / n / 1e3 for k, v in got.items()}
    out["others"], out["all"] = (every - main) / n / 1e3, every / n / 1e3
    return out, hits, events / n


def main() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    name = sys.argv[1] if len(sys.argv) > 1 else "chat"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    wl = builtin(name, 1.0)
    pubs: dict[str, Any] = {
        "vLLM": ZmqEventPublisher(0, endpoint=f"ipc://{tempfile.mkdtemp()}/vllm", topic="kv"),
        "prefixkv": EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)}
    got: dict[str, list[dict[str, float]]] = {k: [] for k in pubs}
    hits: dict[str, list[int]] = {}
    events = 0.0
    for r in range(rounds):
        for side in (list(pubs) if r % 2 == 0 else list(pubs)[::-1]):
            parts, hits[side], n = replay(side, wl.requests, wl.pool_tokens // BS, pubs[side])
            got[side].append(parts)
            events = n if side == "vLLM" else events
    print(f"{name}: {len(wl.requests)} requests, {rounds} rounds, load "
          f"{Path('/proc/loadavg').read_text().split()[0]}; hits equal: "
          f"{hits['vLLM'] == hits['prefixkv']} (mean {statistics.mean(hits['vLLM']):.1f} "
          f"tokens); vLLM's events a step: {events:.2f}")
    print("| side | " + " | ".join(PARTS) + " |\n|---|" + "---:|" * len(PARTS))
    for side, rows in got.items():
        print(f"| {side} | " + " | ".join(f"{statistics.median(x[k] for x in rows):.1f}"
                                       for k in PARTS) + " |")
    pubs["vLLM"].shutdown()
    pubs["prefixkv"].close(timeout=5)


if __name__ == "__main__":
    main()
