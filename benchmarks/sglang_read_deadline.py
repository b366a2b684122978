"""How many pages of one SGLang storage batch a read gets by its deadline, on an idle
local Redis: SGLang 0.5.23 reads up to 128 pages a call (``STORAGE_BATCH_SIZE``), and
Llama-3.1-8B's 64-token pages are 8 MiB (1 GiB a batch).

Two deadlines, in alternating rounds on one server: ``timeout`` alone (the backend's
deadline before ``read_rate``: emulated with a read rate so high that the bytes add
nothing) and ``timeout`` plus the batch's bytes at the default ``read_rate`` (5e8 B/s).
Reports pages read per call and the call's seconds, per round.

    python benchmarks/sglang_read_deadline.py [--pages 128] [--mib 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

from prefixkv.integrations.sglang.pages import PageStore
from prefixkv.store import RedisStore, StoreLayout
from prefixkv.store.server import LocalRedis


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--pages", type=int, default=128)
    args.add_argument("--mib", type=int, default=8)
    args.add_argument("--rounds", type=int, default=3)
    a = args.parse_args()
    size = a.mib << 20
    layout = StoreLayout("sglang-read-deadline", "bfloat16", size)
    keys = [f"p{i}" for i in range(a.pages)]
    print(f"load average before: {os.getloadavg()}")
    with LocalRedis() as server:
        writer = PageStore(RedisStore(server.url, timeout=60.0), layout, 64, timeout=60.0)
        payload = os.urandom(size)
        for i in range(0, a.pages, 8):
            assert writer.put([(k, payload) for k in keys[i:i + 8]])
        sides = {"timeout 0.25 s only": 1e18, "timeout 0.25 s + bytes at 5e8 B/s": 5e8}
        stores = {name: PageStore(RedisStore(server.url, timeout=0.25), layout, 64,
                                  timeout=0.25, retry_after=0, read_rate=rate)
                  for name, rate in sides.items()}
        writer.get(keys)  # (warm: the server's pages and this process's allocator)
        print("| round | deadline | pages read | seconds |")
        print("|---|---|---|---|")
        for r in range(a.rounds):
            for name, store in (stores.items() if r % 2 == 0 else reversed(stores.items())):
                start = time.monotonic()
                got = store.get(keys)
                took = time.monotonic() - start
                print(f"| {r} | {name} | {sum(g is not None for g in got)} of {a.pages} "
                      f"| {took:.2f} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
