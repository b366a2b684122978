"""Cache lines a step misses after the forward pass, counted, not timed: a peer workload's
step with KV events on (prefixkv's side of ``bench_vllm_events.py --workloads``, the
prompt prepared ahead), replayed under valgrind's callgrind with its cache simulator,
the caches flushed between steps. The same whatever the load; a change of code that the
step does not run can still move the figures a little through memory layout (data
lines by ~0.5%; once document's instructions by 7%: C ``realloc`` moved a buffer or not):

    python benchmarks/cold_lines.py [--workloads pressure,chat] [--flush-mib 2]
    python benchmarks/cold_lines.py --publish [--count handoff] [--workloads ...]

Each request: ``add_request`` and ``take_pending_events()`` (the step, counted), then,
not counted, the batch built (as the publisher's thread builds it during the forward
pass), the request freed and ``--flush-mib`` MiB written (one byte a 64-byte line, past
the simulated last level). The simulated caches: 32 KiB L1 (8-way), 1 MiB last level
(16-way), 64-byte lines. Counted only inside the step (``--toggle-collect`` on
``Context.run``, which nothing else here calls); the simulation runs throughout.
Printed per workload, a step's mean over every request: instructions (Ir), instruction
lines missed at the last level (ILmr: the interpreter's and extensions' machine code),
data lines missed reading (DLmr: code objects, types, dicts, the index's and the
blocks' state) and writing (DLmw: mostly new objects and buffers). Needs ``valgrind``
(~20 s a workload). ``PREFIXKV_SRC=DIR``: another tree's prefixkv (an A/B: run both,
compare the rows).

``--late``: each prompt is prepared just before its step (after the previous step's
flush; not counted), as ``bench_vllm_events.py --workloads`` prepares it: the prompt's
bytes and chunks are warm, as there. Without it, every prompt is prepared ahead.

``--publish``: the step also hands the batch to a live ``EventPublisher`` (heartbeat
off), as ``bench_vllm_events.py --workloads`` does; its thread builds and sends it
during the flush (not counted). ``--count handoff``: only the hand-off is counted,
``take_pending_events()`` and ``publish`` (``add_request`` runs outside the count).
"""

from __future__ import annotations

import argparse
import contextvars
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src")
EVENTS = ("Ir", "ILmr", "DLmr", "DLmw")
CACHES = ("--D1=32768,8,64", "--LL=1048576,16,64")


def child(name: str, flush_mib: float, publish: bool, count: str, late: bool = False) -> None:
    """The replay callgrind runs (module doc)."""
    sys.path.insert(0, SRC)
    from prefixkv import KVCacheManager
    from prefixkv.bench.workloads import builtin
    from prefixkv.fleet.publisher import EventPublisher

    wl = builtin(name)
    m = KVCacheManager(wl.pool_tokens // 16, 16, seed=0, enable_events=True,
                       max_events=1 << 20)
    prompts = [(q.rid, q.prompt if late else m.prepare(q.prompt)) for q in wl.requests]
    junk = bytearray(int(flush_mib * (1 << 20)))
    fills = [bytes([v]) * (len(junk) // 64) for v in (1, 2)]  # (each flush writes)
    taken: list[object] = []
    pub = EventPublisher(block_size=16, heartbeat=None, max_queue=1 << 16) if publish else None

    def handoff() -> None:
        if pub is None:
            taken.append(m.take_pending_events())
        else:
            pub.publish(m.take_pending_events())

    def step(rid: str, prompt: object) -> None:
        m.add_request(rid, prompt)
        handoff()

    ctx = contextvars.copy_context()
    gc.collect()
    gc.freeze()  # (as bench_vllm_events.py)
    for i, (rid, prompt) in enumerate(prompts):
        if late:  # (as the bench: prepared just before its step, not counted)
            prompt = m.prepare(prompt)
        if count == "handoff":
            m.add_request(rid, prompt)
            ctx.run(handoff)
        else:
            ctx.run(step, rid, prompt)
        if pub is None:
            batch = taken.pop()
            if batch is not None:
                batch.build()  # type: ignore[attr-defined]
        if pub is not None:
            time.sleep(0.002)  # (its thread builds and sends the batch: before the flush)
        m.free(rid)
        junk[::64] = fills[i & 1]
    if pub is not None:
        pub.close(timeout=30)
        assert pub.health()["published_batches"] == len(prompts), pub.health()
    print(len(prompts))


def measure(name: str, flush_mib: float, publish: bool, count: str,
            late: bool = False) -> dict[str, float]:
    """A step's mean of each of ``EVENTS`` in workload ``name``."""
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/callgrind.out"
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHES,
             "--collect-atstart=no", "--toggle-collect=context_run",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--child", name,
             "--flush-mib", str(flush_mib), *(["--publish"] if publish else []),
             "--count", count, *(["--late"] if late else [])], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"})  # (the same dicts each run)
        steps = int(run.stdout.split()[-1])
        lines = Path(out).read_text().splitlines()
    names = next(x for x in lines if x.startswith("events:")).split()[1:]
    totals = [int(v) for v in next(x for x in lines if x.startswith("totals:")).split()[1:]]
    got = dict(zip(names, totals, strict=False))
    return {e: got.get(e, 0) / steps for e in EVENTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="pressure")
    ap.add_argument("--flush-mib", type=float, default=2.0)
    ap.add_argument("--publish", action="store_true", help="publish each step (module doc)")
    ap.add_argument("--count", choices=("step", "handoff"), default="step")
    ap.add_argument("--late", action="store_true", help="prepare each prompt just before "
                    "its step (module doc)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.count == "handoff" and not a.publish:
        ap.error("--count handoff needs --publish")
    if a.child:
        child(a.child, a.flush_mib, a.publish, a.count, a.late)
        return
    print(f"prefixkv from {SRC}; a step's mean (module doc); publish: {a.publish}, "
          f"counted: {a.count}, prepared: {'late' if a.late else 'ahead'}\n")
    print("| workload | " + " | ".join(EVENTS) + " |")
    print("|---|" + "---:|" * len(EVENTS))
    for name in a.workloads.split(","):
        r = measure(name, a.flush_mib, a.publish, a.count, a.late)
        print(f"| {name} | " + " | ".join(f"{r[e]:,.1f}" for e in EVENTS) + " |", flush=True)


if __name__ == "__main__":
    main()
