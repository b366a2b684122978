"""Where a step's time goes with KV events on, prefixkv beside vLLM 0.33, per part of
what the scheduler's thread runs for one request of a peer workload.

    python benchmarks/events_account.py [--workloads chat,system-prompt] [--rounds 3]
                                        [--forward-ms 2] [--sides vLLM,prefixkv] [--out DIR]

Each workload is replayed as ``bench_vllm_events.py --workloads`` replays it (each
request admitted, the step's events taken and published to a live publisher, the
request freed, a sleep for the forward pass), prefixkv with prompts prepared
(``KVCacheManager.prepare``, untimed). Two accounts per side:

- *bytecodes* a step, per part (``sys.settrace`` with opcode events, every request after
  the first three; deterministic, whatever the load). prefixkv's parts are its functions
  grouped: the claim of the hits (found, verified, referenced: ``ContentIndex.claim``),
  the new blocks taken (and evictions: ``BlockPool.take``, ``ContentIndex.drop``), their
  recording (``store`` and its helpers), the events recorded for the publisher's thread
  (the deferred run: ``StoredRun``, ``EventLog.defer``), the rest of ``add_request``,
  ``take_pending_events`` and the publisher's ``publish``. vLLM's: ``get_computed_blocks``,
  ``allocate_slots``, ``take_events`` and ``KVEventBatch(...)`` + its publisher's
  ``publish``. (C code, such as a dict probe or a bytes comparison, is not counted;
  each part's count holds the few bytecodes of this script's own call of it.)
- *µs* a step, per part (this thread's CPU time; a clock read between parts, so each
  read after the first is counted in the part after it; median of the rounds' means).
  "clock read after the sleep" is two reads back to back after the same sleep (as many
  times, after the replay): about what each part's figure holds besides its own work
  (a thread's CPU clock is a system call).

Needs vllm 0.33.0 importable (``vllm_side.py``) and this tree's ``src`` (first on the path;
``PREFIXKV_SRC=DIR``: another tree's). Writes ``events-account.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from events_steps import SIDES, SKIP  # noqa: E402
from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402
from vllm_side import BS, vllm_manager  # noqa: E402

CLOCK = time.thread_time_ns
CLAIM, TAKE, STORE = "claim (hits found, verified, referenced)", "new blocks taken (+ evictions)", \
    "new blocks recorded (store)"
EVENTS, REST = "events recorded (the deferred run)", "the rest of add_request"
PARTS = {"ContentIndex.claim": CLAIM, "BlockPool.take": TAKE, "BlockPool.take_one": TAKE,
         "BlockPool._evict": TAKE, "DroppingIndex.drop": TAKE, "DroppingIndex.drop_one": TAKE,
         "ContentRecorder.store": STORE, "ContentChains._held": STORE,
         "ContentChains._chain": STORE, "ContentChains._enter": STORE,
         "ContentChains._key": STORE, "ContentChains._may_chain": STORE,
         "ContentChains._add_twin": STORE, "ContentRecorder._record_run": STORE,
         "ContentRecorder._store_run": STORE,
         "ContentChains._key_first": STORE, "Run.__init__": STORE, "Kids.note": STORE,
         "key_chunk": STORE, "record_pending": STORE, "Run.write_last": STORE,
         "Keyless.__init__": TAKE, "Keyless.add": TAKE, "Keyless.outside": TAKE,
         "Run.evicted": TAKE, "Run.truncate": TAKE, "Announcer._defer": EVENTS,
         "StoredRun.__init__": EVENTS, "RemovedRun.__init__": EVENTS, "Deferred.__init__": EVENTS,
         "_num_runs": EVENTS, "EventLog.defer": EVENTS,
         "take_pending_events": "take_pending_events",
         "EventLog.take_pending": "take_pending_events", "PendingEvents.__init__": "take_pending_events",
         "EventPublisher.publish": "publish", "PendingEvents.empty": "publish"}
"""prefixkv's functions -> the part of the step they belong to (others: ``REST``)."""


def replay(side: str, name: str, pub: Any, forward_s: float, count: bool) -> dict[str, float]:
    """One replay of workload ``name`` into a fresh manager of ``side``: per part, µs a
    step (``count``: bytecodes a step), over every request after ``SKIP``."""
    wl = builtin(name, 1.0)
    pool = wl.pool_tokens // BS
    m = (vllm_manager(True, pool) if side == "vLLM" else
         KVCacheManager(pool, BS, seed=0, enable_events=True, max_events=1 << 20))
    make, labels = SIDES[side]
    totals: collections.Counter[str] = collections.Counter()
    where = [""]

    def tracer(frame: Any, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            totals[where[0] or PARTS.get(frame.f_code.co_qualname, REST)] += 1
        return tracer

    gc.collect()
    gc.freeze()  # (the pool's objects, as engines freeze theirs after start-up)
    for i, q in enumerate(wl.requests):
        *parts, free = make(m, pub, q)
        on = i >= SKIP
        if count:
            for label, part in zip(labels, parts, strict=True):
                where[0] = label if side == "vLLM" or label != "add_request" else ""
                sys.settrace(tracer if on else None)
                part()
                sys.settrace(None)
        else:
            t = [CLOCK()]
            for part in parts:
                part()
                t.append(CLOCK())
            if on:
                for label, a, b in zip(labels, t, t[1:], strict=False):
                    totals[label] += b - a
        free()
        if forward_s:
            time.sleep(forward_s)
    gc.unfreeze()
    n = len(wl.requests) - SKIP
    if not count and forward_s:
        for _ in range(n):
            time.sleep(forward_s)
            t0 = CLOCK()
            totals["clock read after the sleep"] += CLOCK() - t0
    return {k: v / n / (1 if count else 1e3) for k, v in totals.items()}


def account(names: list[str], rounds: int, forward_ms: float, folder: str,
            sides: list[str]) -> str:
    from vllm.distributed.kv_events import ZmqEventPublisher

    pubs = {"vLLM": ZmqEventPublisher(0, endpoint=f"ipc://{folder}/vllm", topic="kv"),
            "prefixkv": EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)}
    out = []
    for name in names:
        out += [f"### {name}", "", "| side | part | bytecodes a step | µs a step (rounds) |",
                "|---|---|---:|---:|"]
        for side in sides:
            ops = replay(side, name, pubs[side], 0, True)
            timed: list[dict[str, float]] = []
            for _ in range(rounds):
                timed.append(replay(side, name, pubs[side], forward_ms / 1e3, False))
            med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
            for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
                us = f"{med[k]:.1f}" if k in med else ""
                out.append(f"| {side} | {k} | {v:,.0f} | {us} |")
            if side == "prefixkv":  # (its parts are timed as one call)
                inner = sum(v for k, v in ops.items() if k not in med)
                out.append(f"| {side} | add_request (the parts above not timed apart) | "
                           f"{inner:,.0f} | {med['add_request']:.1f} |")
            out.append(f"| {side} | **step** | **{sum(ops.values()):,.0f}** | "
                       f"**{sum(v for k, v in med.items() if k in SIDES[side][1]):.1f}** |")
            out.append(f"| {side} | (clock read after the sleep) | | "
                       f"{med['clock read after the sleep']:.1f} |")
            print("\n".join(out[-3:]), flush=True)
        out.append("")
    pubs["vLLM"].shutdown()
    pubs["prefixkv"].close(timeout=30)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="chat,system-prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forward-ms", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sides", default="vLLM,prefixkv", help="prefixkv alone: an A/B of two "
                    "trees run in turn (PREFIXKV_SRC)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        md = account(args.workloads.split(","), args.rounds, args.forward_ms, folder,
                     args.sides.split(","))
    command = "python " + " ".join(["benchmarks/events_account.py", *sys.argv[1:]])
    md = (f"# Events on: a step's parts, prefixkv (prepared prompts) and vLLM\n\nCommand: "
          f"`{command}`; module doc for what each part holds.\n\n" + md)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "events-account.md").write_text(md)


if __name__ == "__main__":
    main()
