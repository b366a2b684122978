"""Two trees of prefixkv against each other and vLLM 0.33, paired in one process: the
step of ``bench_vllm_events.py --workloads`` (a prepared prompt's ``add_request``,
``take_pending_events()`` and ``publish`` to the tree's own live ``EventPublisher``;
vLLM's ``get_computed_blocks``, ``allocate_slots``, ``take_events()`` and its
``ZmqEventPublisher``), a 2 ms sleep after each step, the free untimed:

    python benchmarks/events_pair.py chat,system-prompt 12 A=/tmp/main/src B=src

Each ``NAME=DIR`` imports prefixkv from ``DIR`` (each tree its own modules, side by
side). Each round replays the workload on fresh managers of every side in turn, the
order rotating. Printed per workload: vLLM's µs a step, each tree's µs and ratio (the
median over rounds; the ratio the median of each round's own), and each later tree's µs
over the first's (the median of the rounds' own). On a shared machine whose runs swing
from one to the next, the trees meet the same machine state within a round, which runs
of the bench one after the other do not.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tree_import import import_tree  # noqa: E402
from vllm_side import BS, vllm_manager, vllm_request, vllm_step  # noqa: E402

CLOCK = time.thread_time_ns
OURS = "prefixkv"


def load(src: str) -> tuple[Any, Any, Any]:
    """The manager, publisher and ``builtin`` of a second import of prefixkv from
    ``src``; the modules imported before stay as they were."""
    top, pub, wl = import_tree(src, OURS, OURS + ".fleet.publisher", OURS + ".bench.workloads")
    return top.KVCacheManager, pub.EventPublisher, wl.builtin


def replay(side: Any, pub: Any, requests: Any, pool: int) -> float:
    """µs a step of ``requests`` on a fresh manager (``side``: a tree's, or None: vLLM)."""
    m = vllm_manager(True, pool) if side is None else side[0](
        pool, BS, seed=0, enable_events=True, max_events=1 << 20)
    gc.collect()
    gc.freeze()
    total = 0
    for q in requests:
        if side is None:
            req = vllm_request(q.rid, list(q.prompt))  # (its input thread's, untimed)
            t0 = CLOCK()
            vllm_step(m, req, pub)
            total += CLOCK() - t0
            m.free(req)
        else:
            p = m.prepare(q.prompt)  # (its input thread's, untimed)
            t0 = CLOCK()
            m.add_request(q.rid, p)
            pub.publish(m.take_pending_events())
            total += CLOCK() - t0
            m.free(q.rid)
        time.sleep(0.002)
    gc.unfreeze()
    return total / len(requests) / 1e3


def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of ``a``'s figure over ``b``'s."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def main() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    names, rounds = sys.argv[1].split(","), int(sys.argv[2])
    sides = {k: load(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}
    folder = tempfile.mkdtemp()
    pubs: dict[str, Any] = {"vLLM": ZmqEventPublisher(0, endpoint=f"ipc://{folder}/vllm",
                                                      topic="kv")}
    pubs.update({k: s[1](block_size=BS, heartbeat=None, max_queue=1 << 16)
                 for k, s in sides.items()})
    kinds, trees = ["vLLM", *sides], list(sides)
    for name in names:
        wl = sides[trees[0]][2](name, 1.0)
        got: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                got[k].append(replay(sides.get(k), pubs[k], wl.requests, wl.pool_tokens // BS))
        v, first = got["vLLM"], got[trees[0]]
        cells = [f"{k} {statistics.median(got[k]):6.1f} us, {paired(v, got[k]):4.1f}x"
                 for k in trees]
        cells += [f"{k}/{trees[0]} {paired(got[k], first):.3f}" for k in trees[1:]]
        print(f"{name:14s} vLLM {statistics.median(v):7.1f} | " + " | ".join(cells),
              time.strftime("%T"), "load", Path("/proc/loadavg").read_text().split()[0],
              flush=True)
    pubs.pop("vLLM").shutdown()
    for p in pubs.values():
        p.close(timeout=5)


if __name__ == "__main__":
    main()
