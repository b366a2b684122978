"""risks-r17's figures: what ``decode_batch`` costs for payloads of 64 KiB or more, read
whole by ``msgpack.unpackb`` or field by field (``router/decode_large.py``), in one
process (the threshold ``decode.STREAM_FROM`` set for each). Results:
benchmarks/results/decode_large.md.

    PYTHONPATH=src python benchmarks/decode_large_cost.py [--rounds 15]

Per payload and read: the peak of Python allocations while decoding (tracemalloc; the
payload itself was allocated before) and the answer; for a vLLM-like batch (32
``BlockStored`` map events of 64 hashes and 1,024 token ids), the min wall time over
``--rounds`` calls, the two reads alternated call by call, and the Python bytecodes of
one call (``count_opcodes``).
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc

import msgpack

from prefixkv.bench.opcodes import count_opcodes
from prefixkv.router import DecodeError
from prefixkv.router import decode as decoding

READS = {"unpackb": 1 << 62, "field by field": 0}


def peak(payload: bytes) -> tuple[int, str]:
    tracemalloc.start()
    try:
        try:
            decoding.decode_batch(payload)
            answer = "events"
        except DecodeError:
            answer = "DecodeError"
        return tracemalloc.get_traced_memory()[1], answer
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    vllm_like = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": list(range(1000 + 64 * i, 1064 + 64 * i)),
         "parent_block_hash": None, "token_ids": [300 + t for t in range(1024)],
         "block_size": 16, "medium": "GPU"} for i in range(32)], 0])
    cases = {"vLLM-like: 32 events x (64 hashes, 1,024 token ids)": vllm_like}
    for name, filler in (("empty arrays", []), ("empty maps", {}), ("[0]", [0]), ('"ab"', "ab")):
        cases[f"2**18 x {name} as events"] = msgpack.packb([1.0, [filler] * (1 << 18), 0])
    cases["one event, 2**18 empty arrays as hashes"] = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [[]] * (1 << 18)}], 0])
    print("| payload | bytes | " + " | ".join(f"{r}: peak (x bytes), answer" for r in READS) + " |")
    print("|---|---|" + "---|" * len(READS))
    for name, payload in cases.items():
        row = []
        for threshold in READS.values():
            decoding.STREAM_FROM = threshold
            got, answer = peak(payload)
            row.append(f"{got:,} ({got / len(payload):.1f}x), {answer}")
        print(f"| {name} | {len(payload):,} | " + " | ".join(row) + " |")
    times: dict[str, list[float]] = {r: [] for r in READS}
    for _ in range(args.rounds):
        for read, threshold in READS.items():
            decoding.STREAM_FROM = threshold
            t = time.perf_counter()
            decoding.decode_batch(vllm_like)
            times[read].append(time.perf_counter() - t)
    print()
    for read, threshold in READS.items():
        decoding.STREAM_FROM = threshold
        ops = count_opcodes(lambda: decoding.decode_batch(vllm_like))
        print(f"vLLM-like batch, {read}: min {min(times[read]) * 1e3:.2f} ms over "
              f"{args.rounds}, {ops:,} bytecodes")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
