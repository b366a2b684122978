"""How many pages of one SGLang storage batch a read gets by its deadline, on an idle
local Redis: SGLang 0.5.23 reads up to 128 pages a call (``STORAGE_BATCH_SIZE``), and
Llama-3.1-8B's 64-token pages are 8 MiB (1 GiB a batch).

Two deadlines, in alternating rounds on one server: ``timeout`` alone (the backend's
deadline before ``read_rate``: emulated with a read rate so high that the bytes add
nothing) and ``timeout`` plus the batch's bytes at the default ``read_rate`` (5e8 B/s).
Reports pages read per call and the call's seconds, per round.

``--sglang``: instead, SGLang's zero-copy read (``PrefixKVStorage.batch_get_v1``, the
backend made by SGLang's own factory as examples/sglang_storage.py makes it) of the same
128 pages into a host pool shaped as Llama-3.1-8B's (32 layers, 8 KV heads of 128,
bf16, 64-token pages: 8 MiB), with a 10 s timeout: the seconds a batch takes on SGLang's
prefetch I/O thread, read, checked and written into host memory; first, the same pages
written by ``batch_set_v1`` at the default ``timeout`` (0.25 s), as SGLang's backup
thread writes a batch.

    python benchmarks/sglang_read_deadline.py [--pages 128] [--mib 8] [--rounds 3] [--sglang]
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
    args.add_argument("--sglang", action="store_true")
    a = args.parse_args()
    if a.sglang:
        return sglang_reads(a.pages, a.rounds)
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


def sglang_reads(pages: int, rounds: int) -> None:
    """``batch_get_v1`` of ``pages`` Llama-3.1-8B pages, ``rounds`` times (see above)."""
    import pathlib
    import runpy

    import torch

    example = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "examples"
                                 / "sglang_storage.py"))
    sgl, page = example["load"](), 64
    keys = example["page_hashes"](sgl, [(i * 7) % 30000 + 1 for i in range(pages * page)], page)
    print(f"load average before: {os.getloadavg()}")
    with LocalRedis() as server:
        pools = [example["HostPool"](pages * page, page, layers=32, heads=8, head_dim=128)
                 for _ in range(2)]
        (writer, wpool), (reader, rpool) = [
            (example["backend"](sgl, server.url, pool, "bench/llama-8b", timeout=10.0), pool)
            for pool in pools]
        wpool.kv_buffer.copy_(torch.randn(wpool.kv_buffer.shape))
        everything = torch.arange(pages * page)
        default = example["backend"](sgl, server.url, wpool, "bench/llama-8b")  # timeout 0.25
        for r in range(rounds):
            start = time.monotonic()
            stored = default.batch_set_v1(keys, everything)
            print(f"write {r}: batch_set_v1 of {pages} pages at the default timeout: "
                  f"{sum(stored)} stored in {time.monotonic() - start:.2f} s")
        print("| round | pages loaded | seconds |")
        print("|---|---|---|")
        for r in range(rounds):
            start = time.monotonic()
            got = reader.batch_get_v1(keys, everything)
            took = time.monotonic() - start
            print(f"| {r} | {sum(got)} of {pages} | {took:.2f} |")
        assert torch.equal(rpool.kv_buffer, wpool.kv_buffer)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
