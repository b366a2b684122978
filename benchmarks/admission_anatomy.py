"""Why one admission costs what it costs: instructions (machine-independent) and what cold
caches add, for the allocator bench's 2k-hit row and the peer workloads' requests.

    python benchmarks/admission_anatomy.py instructions [--steps 100] [--only LABEL-PART]
    python benchmarks/admission_anatomy.py cold [--rounds 3] [--workload system-prompt]

``instructions``: runs each case under valgrind (cachegrind, no cache simulation) twice,
with 0 and with ``--steps`` steps after the same set-up, and prints the difference per
step: the instructions of one step (``add_request``, the events taken and left unbuilt
(events on) or nothing (off), ``free``), whatever the machine's load. Cases: the 2k-hit
row of ``bench_allocator.py`` (the same 2048 random 16-bit ids re-admitted in a
10k-block pool filled to capacity); a peer workload's requests as
``bench_vllm_events.py --workloads`` replays them; and that workload's first prompt
re-admitted. Pieces of a system-prompt step: ``encode`` (``encode_tokens``), ``chunks``
(and ``block_chunks``), ``claim`` (and the index's claim of the hits, undone). Needs
``valgrind``.

``cold``: the median admission of the system-prompt replay (this thread's CPU time) back
to back, after a 2 ms sleep, after 2 ms of spinning, and after writing 16 MiB (every
cache evicted); and the prompt's encoding alone, warm and cold, given the workload's
token ids (shared int objects) and fresh ones. Modes alternate within each round.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import subprocess
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's prefixkv

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.hashing import block_chunks, encode_tokens, token_buffer, token_bytes  # noqa: E402

BS = 16
CASES = (("2k hit (bench_allocator)", "alloc2khit", "off"), ("2k hit (bench_allocator)", "alloc2khit", "on"),
         ("system-prompt", "system-prompt", "off"), ("system-prompt", "system-prompt", "on"),
         ("system-prompt, first prompt again", "system-prompt/same", "off"),
         ("chat", "chat", "off"), ("chat", "chat", "on"),
         ("pressure", "pressure", "off"), ("pressure", "pressure", "on"),
         ("system-prompt: encode", "piece/encode", "on"), ("system-prompt: + chunks", "piece/chunks", "on"),
         ("system-prompt: + claim", "piece/claim", "on"),
         ("2k hit (bench_allocator), prepared", "alloc2khit+prepared", "off"),
         ("2k hit (bench_allocator), prepared", "alloc2khit+prepared", "on"),
         ("system-prompt, prepared", "system-prompt+prepared", "off"),
         ("system-prompt, prepared", "system-prompt+prepared", "on"),
         ("chat, prepared", "chat+prepared", "on"), ("pressure, prepared", "pressure+prepared", "on"),
         ("document, prepared", "document+prepared", "on"),
         ("2k miss (bench_allocator)", "alloc2kmiss", "off"),
         ("2k miss (bench_allocator)", "alloc2kmiss", "on"),
         ("chat, prepared", "chat+prepared", "off"), ("document, prepared", "document+prepared", "off"),
         ("pressure, prepared", "pressure+prepared", "off"),
         ("nothing (the flush alone)", "piece/noop", "off"))
"""``+prepared``: each step admits a ``Prompt`` (``KVCacheManager.prepare``) made in the
set-up, the same number whatever the steps (so not counted), as an engine's input
thread prepares it."""
FLUSH = 8 << 20  # ``--cold``: bytes written before each step (4x the simulated last level)
CACHES = ("--I1=32768,8,64", "--D1=32768,8,64", "--LL=2097152,16,64")
"""``--cold``'s simulated caches: a core's L1 and its share of a last level that other
work fills meanwhile (a 2 MiB slice)."""
MAX_STEPS = {"document": 99, "alloc2kmiss": 200}  # (the requests there are after the first)
MISSES = 201  # the 2k-miss case's prompts, made whatever the steps (so at most 200 steps)


def steps(case: str, events: bool, k: int, cold: bool = False) -> None:
    """Set up ``case`` and run ``k`` of its steps (what valgrind counts); ``cold``: each
    step after writing ``FLUSH`` bytes (the simulated caches lose what they held)."""
    rng = random.Random(0)
    case, _, prepared = case.partition("+")
    if case.startswith("alloc2k"):
        m = KVCacheManager(10_000, BS, seed=0, enable_events=events, max_events=1 << 20)
        i = 0
        while m.num_cached_blocks < m.num_blocks:  # as bench_allocator's fill_to_capacity
            m.add_request(("fill", i), list(array("H", rng.randbytes(2 * 32768))))
            m.free(("fill", i))
            m.take_events()
            i += 1
        if case == "alloc2khit":
            p = list(array("H", rng.randbytes(2 * 2048)))
            given = m.prepare(p) if prepared else p  # (one Prompt, as the ids are one list)
            reqs = [(i, given) for i in range(k + 1)]
        else:  # a fresh prompt each step (each a miss that evicts): as many made whatever ``k``
            made = [list(array("H", rng.randbytes(2 * 2048))) for _ in range(MISSES)]
            assert k + 1 <= MISSES, f"at most {MISSES - 1} miss steps"
            reqs = [(i, m.prepare(p) if prepared else p) for i, p in enumerate(made)][:k + 1]
    else:
        name = case.split("/")[0] if not case.startswith("piece/") else "system-prompt"
        wl = builtin(name, 1.0)
        m = KVCacheManager(wl.pool_tokens // BS, BS, seed=0, enable_events=events, max_events=1 << 20)
        # every request's list made whatever ``k`` (made per step, it would be counted)
        reqs = [(q.rid, m.prepare(q.prompt) if prepared else list(q.prompt))
                for q in wl.requests][:k + 1]  # (all prepared, whatever ``k``)
        assert len(reqs) == k + 1, f"{name} has {len(wl.requests)} requests, fewer than {k + 1}"
        if case.endswith("/same"):
            reqs = [(f"again{i}", reqs[0][1]) for i in range(k + 1)]
    gc.collect()
    gc.freeze()
    rid, p = reqs[0]
    m.add_request(rid, p)
    m.free(rid)
    m.take_events()
    kept = []  # the batches, left unbuilt (a publisher's thread builds them)
    piece = case[len("piece/"):] if case.startswith("piece/") else None  # (no free)
    flush = bytearray(FLUSH) if cold else None
    for rid, p in reqs[1:]:
        if flush is not None:  # the forward pass: the machine's other work takes the caches
            flush[::64] = bytes(len(flush) // 64)
        if piece is None:
            m.add_request(rid, p)
            kept.append(m.take_pending_events())
            m.free(rid)
        elif piece != "noop":
            a = encode_tokens(p)
            if piece != "encode":
                chunks = block_chunks(token_buffer(a), 4 * BS, len(a) // BS)
                if piece == "claim":
                    hits, unlinked = m._index.claim(chunks[:(len(a) - 1) // BS], b"", None, token_bytes(a))  # type: ignore[union-attr]
                    m._pool.claimed(unlinked)
                    m._pool.unclaim(hits, unlinked)
    # what the steps made stays out of the collection at exit (it would be counted as theirs:
    # a run's list of blocks, say, is traversed there, not in a step)
    gc.freeze()


def count(case: str, events: str, k: int, cold: bool = False) -> tuple[int, ...]:
    """Instructions of the run; ``cold``: also its D1 and last-level data misses
    (cachegrind's simulated caches: ``CACHES``)."""
    sim = ["--cache-sim=yes", *CACHES] if cold else ["--cache-sim=no"]
    out = subprocess.run(["valgrind", "--tool=cachegrind", *sim, "--cachegrind-out-file=/dev/null",
                          sys.executable, __file__, "--run", case, events, str(k),
                          *(["cold"] if cold else [])], capture_output=True, text=True, check=True)
    got = []
    for label in ("I refs", "D1  misses", "LLd misses")[:3 if cold else 1]:
        line = next(x for x in out.stderr.splitlines() if label in x.replace("I   refs", "I refs"))
        got.append(int(line.split(":")[1].split()[0].replace(",", "")))
    return tuple(got)


def instructions(k: int, only: str | None, cold: bool) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    if cold:
        print(f"| case | events | instructions a step ({k} steps, cold) | D1 misses | LL misses |"
              "\n|---|---|---:|---:|---:|")
    else:
        print(f"| case | events | instructions a step ({k} steps) |\n|---|---|---:|")
    for label, case, events in CASES:
        if only is not None and only not in label:
            continue
        n = min(k, MAX_STEPS.get(case.split("+")[0], k))
        per = [(a - b) // n for a, b in zip(count(case, events, n, cold),
                                             count(case, events, 0, cold), strict=True)]
        steps_note = f" ({n} steps)" if n != k else ""
        print(f"| {label}{steps_note} | {events} | {' | '.join(f'{x:,}' for x in per)} |", flush=True)


def cold(rounds: int, name: str) -> None:
    clock = time.thread_time_ns
    wl = builtin(name, 1.0)
    buf = bytearray(16 << 20)

    def spin() -> None:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass

    def evict() -> None:
        for i in range(0, len(buf), 64):
            buf[i] = 1

    afters = {"back to back": None, "2 ms sleep": lambda: time.sleep(0.002), "2 ms spin": spin,
              "16 MiB written": evict}
    got: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, after in afters.items():
            m = KVCacheManager(wl.pool_tokens // BS, BS, seed=0, enable_events=True, max_events=1 << 20)
            gc.collect()
            gc.freeze()
            s = []
            for q in wl.requests:
                p = list(q.prompt)
                t0 = clock()
                m.add_request(q.rid, p)
                s.append(clock() - t0)
                m.take_pending_events().build()
                m.free(q.rid)
                if after is not None:
                    after()
            gc.unfreeze()
            got.setdefault(f"admission, {label}", []).append(statistics.median(s) / 1e3)
        for ints in ("the workload's", "fresh"):
            for label, after in (("warm", None), ("16 MiB written", evict)):
                s = []
                for q in wl.requests:
                    p = list(q.prompt) if ints != "fresh" else array("I", q.prompt).tolist()
                    if after is not None:
                        after()
                    t0 = clock()
                    encode_tokens(p)
                    s.append(clock() - t0)
                got.setdefault(f"encode_tokens, {ints} ints, {label}", []).append(
                    statistics.median(s) / 1e3)
    print(f"| {name}: median µs (rounds) | median of rounds |\n|---|---:|")
    for label, xs in got.items():
        print(f"| {label} ({', '.join(f'{x:.0f}' for x in xs)}) | {statistics.median(xs):.1f} |")


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        case, events, k = sys.argv[2:5]
        steps(case, events == "on", int(k), sys.argv[5:6] == ["cold"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("instructions", "cold"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="system-prompt")
    ap.add_argument("--only", default=None, help="instructions: the cases whose label has this")
    ap.add_argument("--cold", action="store_true", help="instructions: each step after the "
                    "simulated caches were flushed, with their data misses a step (module doc)")
    args = ap.parse_args()
    if args.what == "instructions":
        instructions(args.steps, args.only, args.cold)
    else:
        cold(args.rounds, args.workload)


if __name__ == "__main__":
    main()
