"""An engine step with a live ``EventPublisher``: what KV events cost the scheduler's thread
when it takes them with ``take_events()`` (hashes built on its thread) or hands them off
with ``take_pending_events()`` (built on the publisher's), with the forward pass simulated
by a sleep that releases the GIL, as waiting for a GPU or for workers does.

    python benchmarks/bench_event_handoff.py [--forward-ms 2 0] [--rounds 8] [--out benchmarks/results]

Per step: admit a new prompt (a miss: the pool is full, so it evicts), free it, take the
events and publish them; then sleep ``forward_ms`` (the forward pass). Timed: the step
without the sleep, in wall-clock time (so that waiting for the GIL while the publisher's
thread holds it counts), median per round; modes: events off, ``take_events()``,
``take_pending_events()``. Rounds alternate the order of the modes; ratios are paired per
round. ``--forward-ms 0`` shows the other end: a scheduler thread that never releases the
GIL, which then waits for the publisher's thread's builds. Needs ``prefixkv[events]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from array import array
from pathlib import Path

from prefixkv import KVCacheManager
from prefixkv.fleet.publisher import EventPublisher

BS = 16
POOL = 10_000
MODES = ("events off", "take_events", "take_pending_events")


def prompt(rng: random.Random, n: int) -> list[int]:
    return list(array("H", rng.randbytes(2 * n)))


def filled(events: bool) -> KVCacheManager:
    """A pool whose every block holds cached content (each later miss evicts)."""
    m = KVCacheManager(POOL, BS, seed=0, enable_events=events, max_events=1 << 20)
    rng = random.Random("fill")
    i = 0
    while m.num_cached_blocks < m.num_blocks:
        m.add_request(("fill", i), prompt(rng, 2048 * BS))
        m.free(("fill", i))
        m.take_events()
        i += 1
    return m


def steps(m: KVCacheManager, pub: EventPublisher | None, mode: str, prompts: list[list[int]],
          forward_s: float) -> tuple[float, float]:
    """Median and mean wall µs of one step's scheduling part over ``prompts`` (the mean
    counts the rare step that waits for the GIL). ``forward_s`` 0: no sleep at all, the
    GIL is only taken away by the interpreter's switch interval."""
    out = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        m.add_request(i, p)
        m.free(i)
        if pub is not None:
            pub.publish(m.take_events() if mode == "take_events" else m.take_pending_events())
        out.append(time.perf_counter() - t0)
        if forward_s:
            time.sleep(forward_s)
    return statistics.median(out) * 1e6, statistics.fmean(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forward-ms", type=float, nargs="+", default=[2.0, 0.0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    managers = {mode: filled(mode != "events off") for mode in MODES}
    pubs = {mode: None if mode == "events off" else EventPublisher(block_size=BS, heartbeat=None)
            for mode in MODES}
    rows = []
    t_start = time.perf_counter()
    load = [os.getloadavg()[0]]
    for forward_ms in args.forward_ms:
        for tokens, count in ((2048, 40), (32768, 6)):
            got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    rng = random.Random(f"{tokens}/{forward_ms}/{r}/{mode}")
                    prompts = [prompt(rng, tokens) for _ in range(count)]
                    got[mode].append(steps(managers[mode], pubs[mode], mode, prompts,
                                           forward_ms / 1e3))
            off = got["events off"]
            for mode in MODES:
                med = [m for m, _ in got[mode]]
                mean = [a for _, a in got[mode]]
                ratio = statistics.median(on[0] / o[0] for on, o in zip(got[mode], off, strict=True))
                ratio_mean = statistics.median(on[1] / o[1] for on, o in zip(got[mode], off, strict=True))
                rows.append((forward_ms, f"{tokens // 1024}k miss", mode, statistics.median(med),
                             min(med), ratio, statistics.median(mean), ratio_mean))
                print(f"forward {forward_ms} ms, {tokens // 1024}k miss, {mode:20} "
                      f"{rows[-1][3]:9.1f} µs ({rows[-1][4]:.1f})  {ratio:.2f}x of off; mean "
                      f"{rows[-1][6]:.1f} µs, {ratio_mean:.2f}x", flush=True)
            load.append(os.getloadavg()[0])
    for pub in pubs.values():  # (close sends what is queued first)
        if pub is not None:
            pub.close(timeout=30)
    health = {mode: pub.health() for mode, pub in pubs.items() if pub is not None}
    lines = [f"# KV events with a live publisher: the scheduler's thread ({platform.machine()}, "
             f"{len(os.sched_getaffinity(0))} cores, Python {platform.python_version()})", "",
             f"Command: `python benchmarks/bench_event_handoff.py --forward-ms "
             f"{' '.join(map(str, args.forward_ms))} --rounds {args.rounds}` "
             f"({time.perf_counter() - t_start:.0f} s; 1-minute load average "
             f"{min(load):.1f} to {max(load):.1f})", "",
             "A step: admit a new prompt (a miss that evicts, 10k-block pool full), free it, "
             "take the events and `publish` them; then sleep the forward pass (which releases "
             "the GIL; 0 ms: no sleep, the scheduler's thread gives the GIL up only when the "
             "interpreter's switch interval takes it). µs: wall-clock time of the step without "
             "the sleep, median of the round medians (best round in brackets); mean µs: the "
             "median of the round means, which count the few steps that wait for the GIL while "
             "the publisher's thread builds or encodes; x of off: the median of each round's "
             "own ratio to events off.", "",
             "| forward pass | workload | events | µs | x of off | mean µs | x of off |",
             "|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {f} ms | {w} | {mode} | {us:.1f} ({best:.1f}) | {ratio:.2f} | {mean:.1f} | "
              f"{ratio_mean:.2f} |" for f, w, mode, us, best, ratio, mean, ratio_mean in rows]
    lines += ["", f"Publishers after close(), of {len(args.forward_ms) * args.rounds * 46} steps "
              "each: " + "; ".join(
        f"{mode}: {h['published_batches']} batches sent, {h['dropped_batches']} dropped"
        for mode, h in health.items())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "event-handoff.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
