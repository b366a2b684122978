"""How many pages of one SGLang storage batch a read gets by its deadline, on an idle
local Redis: SGLang 0.5.23 reads up to 128 pages a call (``STORAGE_BATCH_SIZE``), and
Llama-3.1-8B's 64-token pages are 8 MiB (1 GiB a batch).

Two deadlines, in alternating rounds on one server: ``timeout`` alone (the backend's
deadline before ``read_rate``: emulated with a read rate so high that the bytes add
nothing) and ``timeout`` plus the batch's bytes at 5e8 B/s (``read_rate``'s default before).
Reports pages read per call and the call's seconds, per round.

``--sglang``: instead, SGLang's zero-copy read (``PrefixKVStorage.batch_get_v1``, the
backend made by SGLang's own factory as examples/sglang_storage.py makes it) of the same
128 pages into a host pool shaped as Llama-3.1-8B's (32 layers, 8 KV heads of 128,
bf16, 64-token pages: 8 MiB), with a 10 s timeout: the seconds a batch takes on SGLang's
prefetch I/O thread, read, checked and written into host memory; first, the same pages
written by ``batch_set_v1`` at the default ``timeout`` (0.25 s), as SGLang's backup
thread writes a batch.

``--rates``: instead, the store's read alone (``RedisStore.read_into`` of the batch into
a head and a payload buffer a page, as ``PageStore.get`` reads, with a 60 s deadline),
timed per round, beside ``--busy`` processes that spin (a loaded machine): the bytes a
second a read achieved, against what a deadline of ``timeout`` (0.25 s) plus the bytes at
5e8 B/s (the default ``read_rate`` before) and at 1e8 B/s (the default now) allows.

    python benchmarks/sglang_read_deadline.py [--pages 128] [--mib 8] [--rounds 3]
        [--sglang | --rates [--busy N]]
"""

from __future__ import annotations

import argparse
import os
import time

from prefixkv.integrations.sglang.pages import PageStore
from prefixkv.store import RedisStore, StoreLayout, encode_value
from prefixkv.store.server import LocalRedis


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--pages", type=int, default=128)
    args.add_argument("--mib", type=int, default=8)
    args.add_argument("--rounds", type=int, default=3)
    args.add_argument("--sglang", action="store_true")
    args.add_argument("--rates", action="store_true")
    args.add_argument("--busy", type=int, default=0)
    a = args.parse_args()
    if a.sglang:
        return sglang_reads(a.pages, a.rounds)
    if a.rates:
        return read_rates(a.pages, a.mib << 20, a.rounds, a.busy)
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


class _TimedReads:
    """A RedisStore whose ``read_into`` calls are timed (``seconds``, ``nbytes``)."""

    def __init__(self, store: RedisStore) -> None:
        self.store, self.seconds, self.nbytes = store, 0.0, 0
        self.held, self.put = store.held, store.put

    def read_into(self, keys, buffers, deadline):  # type: ignore[no-untyped-def]
        start = time.monotonic()
        try:
            return self.store.read_into(keys, buffers, deadline)
        finally:
            self.seconds = time.monotonic() - start
            self.nbytes = sum(len(v) for views in buffers for v in views)


def read_rates(pages: int, size: int, rounds: int, busy: int) -> None:
    """``PageStore.get`` of ``pages`` values of ``size`` bytes with a 60 s timeout,
    ``rounds`` times beside ``busy`` spinning processes, its store read timed (see
    above)."""
    import subprocess
    import sys

    layout = StoreLayout("sglang-read-rate", "bfloat16", size)
    keys = [f"p{i}" for i in range(pages)]
    with LocalRedis() as server:
        timed = _TimedReads(RedisStore(server.url, timeout=60.0))
        store = PageStore(timed, layout, 64, timeout=60.0)
        payload = os.urandom(size)
        for i in range(0, pages, 8):
            assert store.put([(k, payload) for k in keys[i:i + 8]])
        total = sum(len(store.head(k)) + len(encode_value(b"", b"")) + size for k in keys)
        rates = (5e8, 1e8)  # (the read's deadline: timeout 0.25 s + its bytes at a rate)
        allowed = [0.25 + total / rate for rate in rates]
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)
            print(f"load average before: {os.getloadavg()}; {busy} busy processes; "
                  f"{pages} pages of {size >> 20} MiB; deadlines "
                  + ", ".join(f"{a:.2f} s at {r:.0e} B/s" for a, r in zip(allowed, rates, strict=True)))
            print("| round | read seconds | MB/s | " + " | ".join(f"share of the deadline at {r:.0e}"
                                                         for r in rates) + " |")
            print("|---|---|---|" + "---|" * len(rates))
            for r in range(rounds):
                got = store.get(keys)
                assert all(g is not None for g in got) and timed.nbytes == total
                print(f"| {r} | {timed.seconds:.2f} | {total / timed.seconds / 1e6:.0f} | "
                      + " | ".join(f"{timed.seconds / a:.0%}" for a in allowed) + " |")
            print(f"load average after: {os.getloadavg()}")
        finally:
            for p in spinners:
                p.kill()
                p.wait()


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
