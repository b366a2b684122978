"""The allocator's cost with a host tier (L2): admission with host hits against device-only
admission of the same length, and decode with and without the tier.

    python benchmarks/bench_host_tier.py [--quick] [--out benchmarks/results]
    python benchmarks/bench_host_tier.py --against REV [--quick]

Admissions of a ``--tokens``-token prompt (default 2048, block size 16), each followed by
``take_kv_ops`` (timed apart: the plan's cost) and ``free``, in four steady states (each
manager warmed up by 10 admissions first, which fills the host tier):

    device hit   : no host tier, a big pool: every block but the last hits on the device
                   (and the same with a host tier: what the tier costs a device hit)
    device miss  : no host tier, a pool of one request, two prompts alternating:
                   every admission misses and evicts the other prompt's blocks
    host hit     : the same small pool with a host tier of 8x: every admission finds its
                   prompt in host slots, takes fresh blocks (evicting the other prompt's,
                   which the tier already holds) and states one load per block
    device miss, with a host tier : the same small pool and tier, a fresh prompt each
                   admission: it misses on both tiers, and each of its evictions offloads
                   the previous prompt's block into the least recently used host slot
                   (dropping that slot's content): the offload path of eviction

"Device-only admission of the same length" (issue 10, item 7) is either of the first two:
the same prompt in a manager without a tier hits (if its pool kept it) or misses (if it
did not, which is when a host tier serves it). Both ratios are given, for the admission
alone and with its plan (``take_kv_ops``, which builds nothing: it hands over the ops).

Decode: one token at a time (``append_tokens``) for 32 requests, ``take_kv_ops`` once per
step (untimed), in a full pool, where each new block evicts a cached one (and, with the
tier, offloads it), and in a pool with room (nothing evicted: the decode path itself);
the four pools decode in turn, step by step; a sample is the mean of 16 steps (one of
them grows every request by a block), so a stall of the machine spoils one sample only.
Figures are medians over rounds; the best round's median is given beside it (this 2-core
VM drifts by up to 2x between seconds).

``--against REV``: the same rows for commit REV (a temporary worktree) and this tree, each
round a fresh process per side, the sides in ABBA order; old/new ratios of the medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from array import array
from pathlib import Path

from prefixkv import KVCacheManager

BS = 16
HERE = Path(__file__).resolve().parent


def prompt(rng: random.Random, n: int) -> list[int]:
    return list(array("H", rng.randbytes(2 * n)))


class Prompts:
    """The prompts of a row's admissions, in turn: ``fixed`` in rotation, or a fresh
    random prompt each (``fixed`` empty); ``made``: every prompt handed out."""

    def __init__(self, fixed: list[list[int]], rng: random.Random, tokens: int) -> None:
        self.fixed, self.rng, self.tokens = fixed, rng, tokens
        self.made: list[list[int]] = []

    def next(self) -> list[int]:
        fixed = self.fixed
        p = fixed[len(self.made) % len(fixed)] if fixed else prompt(self.rng, self.tokens)
        self.made.append(p)
        return p


def admissions(m: KVCacheManager, prompts: Prompts, count: int) -> tuple[list[int], list[int]]:
    """ns of ``count`` add_request calls of the next ``prompts``, and ns of the
    ``take_kv_ops`` right after each; each request is freed after (untimed)."""
    adm, plan = [], []
    for i in range(count):
        p = prompts.next()
        t0 = time.perf_counter_ns()
        a = m.add_request(i, p)
        t1 = time.perf_counter_ns()
        m.take_kv_ops()
        plan.append(time.perf_counter_ns() - t1)
        adm.append(t1 - t0)
        assert a is not None
        m.free(i)
    return adm, plan


def admission_setups(tokens: int, rng: random.Random) -> dict[str, tuple[KVCacheManager, Prompts]]:
    blocks = -(-tokens // BS)
    small = blocks  # one request: each admission evicts all of the other prompt
    p, q = prompt(rng, tokens), prompt(rng, tokens)
    fresh = random.Random(rng.random())  # (its own generator: the other rows' prompts stay)
    return {
        "device hit": (KVCacheManager(4 * blocks, BS, seed=0), Prompts([p], rng, tokens)),
        "device hit, with a host tier": (KVCacheManager(4 * blocks, BS, seed=0,
                                                        host_blocks=8 * small),
                                         Prompts([p], rng, tokens)),
        "device miss": (KVCacheManager(small, BS, seed=0), Prompts([p, q], rng, tokens)),
        "host hit": (KVCacheManager(small, BS, seed=0, host_blocks=8 * small),
                     Prompts([p, q], rng, tokens)),
        "device miss, with a host tier": (KVCacheManager(small, BS, seed=0, host_blocks=8 * small),
                                          Prompts([], fresh, tokens)),
    }


DECODE = {  # row -> (host slots, full pool)
    "full pool, no host tier": (0, True), "full pool, host tier 4x": (4 * 4096, True),
    "pool with room, no host tier": (0, False), "pool with room, host tier 4x": (4 * 4096, False),
}


def decode_setup(host_blocks: int, full: bool, rng: random.Random,
                 reqs: int = 32) -> tuple[KVCacheManager, list]:
    """A pool of 4096 blocks, first filled with cached content (``full``: each new block
    then evicts) or left empty, and ``reqs`` running requests of 40 prompt tokens."""
    m = KVCacheManager(4096, BS, seed=0, host_blocks=host_blocks)
    for i in range(m.num_blocks // 64 if full else 0):  # cached 64-block prompts, computed, freed
        m.add_request(("fill", i), prompt(rng, 64 * BS))
        m.take_kv_ops()
        m.free(("fill", i))
    ids = [("r", i) for i in range(reqs)]
    for r in ids:
        m.add_request(r, prompt(rng, 40))
    m.take_kv_ops()
    return m, ids


def decode_paired(rng: random.Random, steps: int) -> dict[str, list[float]]:
    """ns per appended token, one sample per step and row (the requests take a new block
    together, every 16th step; evictions happen then): every DECODE row decodes one
    token per request (``append_tokens``) in turn, step by step (the order rotating), so a
    drift of the machine weighs on all rows alike; ``take_kv_ops`` after each, untimed."""
    states = {name: decode_setup(host, full, rng) for name, (host, full) in DECODE.items()}
    names = list(states)
    out: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        t = rng.randrange(1, 30000)
        for name in names[i % len(names):] + names[:i % len(names)]:
            m, ids = states[name]
            t0 = time.perf_counter_ns()
            for r in ids:
                m.append_tokens(r, [t])
            out[name].append((time.perf_counter_ns() - t0) / len(ids))
            m.take_kv_ops()
    return out


def one_round(tokens: int, per_round: int, steps: int, seed: int = 0) -> dict[str, list[float]]:
    """Every row once: admission and plan µs per call, decode µs per token (lists)."""
    rng = random.Random(seed)
    setups = admission_setups(tokens, rng)
    for m, ps in setups.values():  # warm up: caches filled, the host tier full (after 9)
        admissions(m, ps, 10)
    out: dict[str, list[float]] = {}
    gc.disable()
    try:
        for name, (m, ps) in setups.items():
            adm, plan = admissions(m, ps, per_round)
            out[name] = [ns / 1e3 for ns in adm]
            out[name + " + plan"] = [(a + p) / 1e3 for a, p in zip(adm, plan, strict=True)]
        for name, ns in decode_paired(rng, steps).items():
            # means of 16-step windows (one growth step each): a stall spoils one window
            out["decode " + name] = [sum(ns[i:i + 16]) / 16e3 for i in range(0, len(ns) - 15, 16)]
    finally:
        gc.enable()
    host_stats = setups["host hit"][0].stats
    assert host_stats.host_hits == host_stats.hits > 0, host_stats
    m, ps = setups["device miss, with a host tier"]
    assert m.stats.hits == 0, m.stats  # every admission missed on both tiers, and
    assert m.lookup(ps.made[-2]) == tokens - BS, ps.made[-2]  # the evicted prompt went down
    return out


def median_and_best(rounds: list[list[float]]) -> tuple[float, float]:
    every = [x for r in rounds for x in r]
    return statistics.median(every), min(statistics.median(r) for r in rounds)


def report(rows: dict[str, tuple[float, float]], tokens: int, rounds: int, per_round: int) -> str:
    def ratio(a: str, b: str) -> str:
        return (f"{rows[a][0] / rows[b][0]:.2f}x (best rounds "
                f"{rows[a][1] / rows[b][1]:.2f}x)")
    lines = [f"# Allocator cost with a host tier ({tokens}-token admissions, block size {BS})", "",
             f"{platform.platform()}, Python {platform.python_version()}; median over {rounds} "
             f"rounds x {per_round} admissions (best round's median in brackets).", "",
             "| admission | us | with its plan (take_kv_ops), us |", "|---|---:|---:|"]
    for k in ("device hit", "device miss", "host hit", "device hit, with a host tier",
              "device miss, with a host tier"):
        v, w = rows[k], rows[k + " + plan"]
        lines.append(f"| {k} | {v[0]:.1f} ({v[1]:.1f}) | {w[0]:.1f} ({w[1]:.1f}) |")
    lines += ["", "Goal (issue 10, item 7): host hit within 1.3x of device-only admission of "
              "the same length.", ""]
    for other in ("device hit", "device miss"):
        lines.append(f"- host hit / {other}: {ratio('host hit', other)}; with plans: "
                     f"{ratio('host hit + plan', other + ' + plan')}")
    lines += ["", "| decode, pool of 4096 blocks | us/token |", "|---|---:|"]
    lines += [f"| {k} | {rows['decode ' + k][0]:.3f} ({rows['decode ' + k][1]:.3f}) |" for k in DECODE]
    return "\n".join(lines) + "\n"


def run_side(src: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """One round in a fresh process importing prefixkv from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tokens", str(args.tokens),
           "--per-round", str(args.per_round), "--steps", str(args.steps)]
    return json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)


def against(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    from alloc_ab import worktree  # a shared helper module, not a benchmark
    new_src = HERE.parent / "src"
    with worktree(args.against) as (path, commit):
        sides: dict[str, list[dict[str, list[float]]]] = {"old": [], "new": []}
        for r in range(args.rounds):
            order = [("old", path / "src"), ("new", new_src)]
            for label, src in (order if r % 2 == 0 else order[::-1]):
                sides[label].append(run_side(src, args))
    names = [k for k in sides["new"][0] if k in sides["old"][0]]  # rows both versions have
    lines = [f"# Host tier allocator cost: {commit} (old) vs this tree (new), ABBA, "
             f"{args.rounds} rounds, a fresh process per side and round", "",
             "| row | old us | new us | old/new |", "|---|---:|---:|---:|"]
    for k in names:
        o = statistics.median(statistics.median(s[k]) for s in sides["old"])
        n = statistics.median(statistics.median(s[k]) for s in sides["new"])
        lines.append(f"| {k} | {o:.3f} | {n:.3f} | {o / n:.2f} |")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the admissions")
    ap.add_argument("--out", default="benchmarks/results", help="folder for host-tier-cpu.{json,md}")
    ap.add_argument("--against", metavar="REV", help="compare with commit REV, ABBA rounds")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 10, --quick 4)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--per-round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds, per_round, steps = (4, 20, 64) if args.quick else (10, 100, 512)
    rounds = args.rounds = args.rounds or rounds
    args.per_round = args.per_round or per_round
    args.steps = args.steps or steps
    if args.worker:
        print(json.dumps(one_round(args.tokens, args.per_round, args.steps)))
        return
    if args.against:
        against(args)
        return
    samples: dict[str, list[list[float]]] = {}
    for r in range(rounds):  # every row once a round, so drift hits all of them
        for k, v in one_round(args.tokens, args.per_round, args.steps, seed=r).items():
            samples.setdefault(k, []).append(v)
    rows = {k: median_and_best(v) for k, v in samples.items()}
    text = report(rows, args.tokens, rounds, args.per_round)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-tier-cpu.md").write_text(text)
    (out / "host-tier-cpu.json").write_text(json.dumps(
        {"tokens": args.tokens, "rounds": rounds, "per_round": args.per_round,
         "us": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
