"""Admission cost side by side in one process: prefixkv's ``add_request`` + ``free`` and
SGLang 0.5.23's own ``RadixCache`` doing what its scheduler asks of it for one request
(match, lock, insert at the prefill's end, re-match and re-lock, unlock at finish,
evicting leaves to stay within the pool). Rounds alternate ABBA; medians and best rounds
of this thread's CPU time (``time.thread_time_ns``: what other processes on a loaded
machine take is not counted, their cache pollution is). Both sides see the same prompts
and must find the same hits.

SGLang's figure is the radix tree's work and a torch free list of pages standing in for
its paged allocator (``TorchPages``: slices and ``torch.cat``, as its allocator's ``alloc``
and ``free`` do); its ``alloc_extend`` kernel and ``req_to_token`` writes are not run, so
it is a lower bound of SGLang's admission. Its modules load with the stand-ins listed in
``tests/engines/sglang_radix.py``.

    PYTHONPATH=src python benchmarks/radix_timing.py [--rounds 10] [--count 20] [--prepared]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from array import array
from pathlib import Path
from time import thread_time_ns
from typing import Any

TREE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TREE))

from prefixkv import KVCacheManager  # noqa: E402

BS = 16
POOL = 10_000


class PrefixKV:
    def __init__(self) -> None:
        self.m = KVCacheManager(POOL, BS)
        self.n = 0

    def ready(self, prompt: list[int]) -> Any:
        """What the engine's input thread makes of a prompt (``prepare``), untimed."""
        return self.m.prepare(prompt)

    def admit(self, prompt: Any) -> int:
        """Admit and finish one request; the hit in tokens."""
        self.n += 1
        adm = self.m.add_request(self.n, prompt)
        assert adm is not None
        self.m.free(self.n)
        return adm.num_cached_tokens  # type: ignore[union-attr]


class TorchPages:
    """SGLang's paged allocator's ``alloc``/``free`` on a torch free list of pages."""

    device = "cpu"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.free_pages = torch.arange(POOL, dtype=torch.int64)
        self.offsets = torch.arange(BS, dtype=torch.int64)

    def alloc(self, n: int) -> Any:
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (pages[:, None] * BS + self.offsets).reshape(-1)

    def free_segment(self, slots: Any, start_pos: int = 0) -> None:
        self.free_pages = self.torch.cat((self.free_pages, slots[::BS] // BS))


class Radix:
    def __init__(self) -> None:
        from tests.engines.sglang_radix import load

        self.sgl = load()
        self.slots = TorchPages()
        self.tree = self.sgl.RadixCache.create_simulated(mock_allocator=self.slots, page_size=BS)
        self.torch = self.slots.torch

    def ready(self, prompt: list[int]) -> Any:
        """What SGLang's ``Req`` holds from its creation on (its token array), untimed."""
        return array("q", prompt)

    def admit(self, prompt: Any) -> int:
        sgl, tree = self.sgl, self.tree
        tokens = prompt if isinstance(prompt, array) else array("q", prompt)
        key = sgl.RadixKey(tokens)
        m = tree.match_prefix(sgl.Match(key=sgl.RadixKey(tokens, limit=len(prompt) - 1)))
        node, hit = m.last_device_node, m.device_prefix_len
        tree.inc_lock_ref(node)
        prefix = tree.path_device_indices(node)
        pages = -(-len(prompt) // BS) - hit // BS
        short = pages - len(self.slots.free_pages)
        if short > 0:
            tree.evict(sgl.Evict(num_tokens=short * BS))
        row = self.torch.cat((prefix, self.slots.alloc(pages)))
        full = key.page_aligned(BS)  # the prefill's end: checkpoint
        res = tree.insert(sgl.Insert(key=full, value=row[:len(full)]))
        if res.prefix_len > hit:
            self.slots.free_segment(row[hit:res.prefix_len])
        m2 = tree.match_prefix(sgl.Match(key=full))
        tree.dec_lock_ref(node)
        tree.inc_lock_ref(m2.last_device_node)
        tree.dec_lock_ref(m2.last_device_node)  # finish: the tail page back
        if len(row) > len(full):
            self.slots.free_segment(row[len(full):])
        return hit


def measure(side: Any, prompts: list[list[int]]) -> tuple[int, list[int]]:
    """Nanoseconds for admitting ``prompts`` one after the other, and their hits."""
    t0 = thread_time_ns()
    hits = [side.admit(p) for p in prompts]
    return thread_time_ns() - t0, hits


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--prepared", action="store_true",
                   help="each side gets its prompts as its scheduler does: prefixkv a Prompt "
                        "from prepare(), SGLang the Req's token array (made untimed)")
    args = p.parse_args(argv)
    rng = random.Random(0)
    print(f"load average {os.getloadavg()[0]:.2f}; pool {POOL} blocks of {BS}; "
          f"{args.rounds} rounds x {args.count} admissions; µs per admission; prompts "
          + ("prepared (prefixkv: Prompt; SGLang: token array)" if args.prepared else "as lists of ids"))
    print("| row | prefixkv median (best) | SGLang radix median (best) | SGLang / prefixkv |")
    print("|---|---|---|---|")
    for tokens in (2048, 32768):
        for hit in (False, True):
            sides = {"prefixkv": PrefixKV(), "sglang": Radix()}
            base = [rng.randrange(32000) for _ in range(tokens)]
            got: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(args.rounds):
                prompts = [base if hit else [rng.randrange(32000) for _ in range(tokens)]
                           for _ in range(args.count)]
                hits = {}
                for name in (list(sides) if r % 4 in (0, 3) else list(sides)[::-1]):
                    sides[name].admit(base)  # (cached before the timed ones when hit)
                    given = [sides[name].ready(q) for q in prompts] if args.prepared else prompts
                    ns, hits[name] = measure(sides[name], given)
                    got[name].append(ns / args.count / 1e3)
                assert hits["prefixkv"] == hits["sglang"], hits  # the same work on both sides
            med = {k: statistics.median(v) for k, v in got.items()}
            best = {k: min(v) for k, v in got.items()}
            print(f"| {tokens // 1024}k, {100 if hit else 0}% hit | {med['prefixkv']:.1f} "
                  f"({best['prefixkv']:.1f}) | {med['sglang']:.1f} ({best['sglang']:.1f}) | "
                  f"{med['sglang'] / med['prefixkv']:.2f} |")


if __name__ == "__main__":
    main()
