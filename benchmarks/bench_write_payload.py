"""``write_payload`` (a fetched block's payload into its host slot) against the copy it
made before (the payload through a ``bytearray`` into ``torch.frombuffer``), alternated
in one process, thread CPU time, the minimum of ``--rounds`` rounds each.

    python benchmarks/bench_write_payload.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import time

import numpy
import torch

from prefixkv.store.record import payload_bytes
from prefixkv.store.torch_io import write_payload


def through_a_copy(k_host: torch.Tensor, v_host: torch.Tensor, slot: int, payload: bytes) -> None:
    """The former body: the payload copied into a bytearray, then into the slot."""
    k, v = k_host[slot], v_host[slot]
    nk = k.numel() * k.element_size()
    raw = torch.frombuffer(bytearray(payload_bytes(payload)), dtype=torch.uint8)
    k.copy_(raw[:nk].view(k.dtype).view(k.shape))
    v.copy_(raw[nk:].view(v.dtype).view(v.shape))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print("| payload | before (bytearray) | now (in place) | ratio |")
    print("|---|---|---|---|")
    for half in (16 << 10, 256 << 10, 2 << 20):  # K bytes (and V bytes) of one slot
        k_host = torch.zeros(8, half // 2, dtype=torch.bfloat16)
        v_host = torch.zeros_like(k_host)
        payload = numpy.random.default_rng(0).integers(0, 256, 2 * half, dtype=numpy.uint8).tobytes()
        reps = max(20, (20 << 20) // (2 * half))
        best = {through_a_copy: float("inf"), write_payload: float("inf")}
        for r in range(args.rounds):
            order = [through_a_copy, write_payload] if r % 2 == 0 else [write_payload, through_a_copy]
            for fn in order:
                t = time.thread_time()
                for _ in range(reps):
                    fn(k_host, v_host, 3, payload)
                best[fn] = min(best[fn], (time.thread_time() - t) / reps * 1e6)
        before, now = best[through_a_copy], best[write_payload]
        print(f"| {2 * half >> 10} KiB | {before:.1f} µs | {now:.1f} µs | {before / now:.1f}x |")


if __name__ == "__main__":
    main()
