"""fleet-r18's figures: ``decode_batch`` before and after (a git revision's decoder
against this tree's, in one process, calls alternated): honest batches' throughput, and
the peak of crafted payloads under 64 KiB. Results: benchmarks/results/fleet-r18.md.

    PYTHONPATH=src python benchmarks/decode_small_cost.py [--before main] [--rounds 15]

The revision's ``router/decode.py``, ``decode_large.py``, ``show.py`` (and ``whole.py``
when it has one) and ``errors.py`` are written to a temporary package and imported from
there. Honest batches: vLLM 0.33-shaped ``BlockStored`` map events (random 64-bit hashes
and parent, token ids below 128,000, the fields vLLM sends), ``events x blocks`` of 16
tokens. Times: min over ``--rounds`` of a loop of calls (about 20 KB decoded a loop);
peaks: tracemalloc's, the payload allocated before.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import random
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack

from prefixkv.router import decode as after

FILES = ("router/decode.py", "router/decode_large.py", "router/show.py", "router/whole.py",
         "errors.py")


def load_before(rev: str, into: pathlib.Path) -> Any:
    """The decode module of ``rev``, as package ``pkv_before``."""
    root = into / "pkv_before"
    (root / "router").mkdir(parents=True)
    for pkg in (root, root / "router"):
        (pkg / "__init__.py").write_text("")
    for name in FILES:
        out = subprocess.run(["git", "show", f"{rev}:src/prefixkv/{name}"], capture_output=True,
                             text=True)
        if out.returncode == 0:
            (root / name).write_text(out.stdout)
    sys.path.insert(0, str(into))
    return importlib.import_module("pkv_before.router.decode")


def honest(events: int, blocks: int, rng: random.Random) -> bytes:
    return msgpack.packb([time.time(), [
        {"type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
         "parent_block_hash": rng.getrandbits(64),
         "token_ids": [rng.randrange(128_000) for _ in range(16 * blocks)], "block_size": 16,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * blocks,
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"} for _ in range(events)], 0])


def crafted() -> dict[str, bytes]:
    n = 60_000
    head = b"\x93\xcb" + struct.pack(">d", 1.0) + (b"\xdd" + struct.pack(">I", n)) * 1000
    return {
        "60,000 B: 1,000 nested array32 headers, items missing": (head + b"\0" * n)[:n],
        "~60 KiB: empty maps as events": msgpack.packb([1.0, [{}] * 61_000, 0]),
        "~60 KiB: empty arrays as events": msgpack.packb([1.0, [[]] * 61_000, 0]),
        "~7.9 KiB: empty maps as events": msgpack.packb([1.0, [{}] * 8_000, 0]),
    }


def peak(decode: Callable[[bytes], Any], payload: bytes) -> int:
    tracemalloc.start()
    try:
        try:
            decode(payload)
        except Exception:  # noqa: BLE001 - DecodeError of either module
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(args.before, pathlib.Path(tmp))
        reads = {"before": before.decode_batch, "after": after.decode_batch}
        print(f"before: {args.before}; after: this tree (STREAM_FROM {after.STREAM_FROM:,})\n")
        print("| honest batch (events x blocks) | bytes | before, MB/s | after, MB/s | after/before |")
        print("|---|---:|---:|---:|---:|")
        for events, blocks in ((1, 1), (1, 4), (4, 4), (1, 16), (2, 16), (4, 16), (6, 16),
                               (8, 16), (4, 32), (16, 32), (32, 64)):
            payload = honest(events, blocks, rng)
            assert repr(before.decode_batch(payload)[1]) == repr(after.decode_batch(payload)[1])
            loops = max(1, 20_000 // len(payload))
            best = dict.fromkeys(reads, float("inf"))
            for _ in range(args.rounds):
                for name, read in reads.items():
                    t = time.perf_counter()
                    for _ in range(loops):
                        read(payload)
                    best[name] = min(best[name], (time.perf_counter() - t) / loops)
            mbs = {name: len(payload) / t / 1e6 for name, t in best.items()}
            print(f"| {events} x {blocks} | {len(payload):,} | {mbs['before']:.1f} | "
                  f"{mbs['after']:.1f} | {mbs['after'] / mbs['before']:.2f} |")
        print("\n| crafted payload | bytes | before: peak (x bytes) | after: peak (x bytes) |")
        print("|---|---:|---:|---:|")
        for name, payload in crafted().items():
            got = {read: peak(fn, payload) for read, fn in reads.items()}
            print(f"| {name} | {len(payload):,} | " + " | ".join(
                f"{got[r]:,} ({got[r] / len(payload):.1f}x)" for r in reads) + " |")
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
