"""The order a finished hybrid request's blocks join the free queue (groups/free_order.py),
and a step's released blocks (groups/release_order.py): their cost against vLLM's plain
order and against hybrid-r12's cascade (the reference copy, tests/free_order_reference.py),
alternated in one process. Results: benchmarks/results/free-order-cpu.md.

    python benchmarks/bench_free_order.py [--reps 7] [--blocks 8192]

Three settings; the first two a full-attention group beside a sliding window of 4096
tokens, block size 16 (so 8192 blocks a group is a 131,072-token request):

- order: the ordering function alone, on a request's tables as a finished prefill leaves
  them (the window's blocks below its cut released, every block cached and held once),
  the finds a list slice (new) or a list index (hybrid-r12's per-block ``cached``);
  three cases: every released block still cached, all evicted, and ``longer``.
- free: ``HybridKVCacheManager.free`` of such a request (prefilled in chunks of 8192),
  with the new order, hybrid-r12's (``find`` per block, as its manager asked), and vLLM's
  plain order (group by group, tail first, no block moved).
- steps: gemma3-like groups (full attention and five windows of 1024), a request of
  ``--blocks`` blocks decoding up to a block boundary; ``append_tokens`` of one token,
  which releases one block of each window (release_order.py keeps vLLM's order), and the
  same after a step of 64 tokens, which releases four of each, with release_order.py, its
  version before deps-r15 (each window's whole table in its view: the reference copy) or
  vLLM's order.

Each variant's time is the min over ``--reps`` rounds, the variants alternating within a
round; Python bytecodes executed (sys.settrace, opcode events) are counted in a separate
run, as they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prefixkv.groups as groups_module
import prefixkv.groups.growth as growth_module  # (calls release_order)
import prefixkv.groups.manager as manager_module
from prefixkv.bench import hybrid_scenes
from prefixkv.bench.opcodes import count_opcodes
from prefixkv.core.block import Block
from prefixkv.core.request import RequestKeys
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.groups.free_order import free_order
from prefixkv.groups.release_order import release_order
from prefixkv.groups.request import GroupRequest

BS = 16
SPECS = [full_attention(), sliding_window(4096)]


def _reference() -> Any:
    path = Path(__file__).resolve().parents[1] / "tests" / "free_order_reference.py"
    spec = importlib.util.spec_from_file_location("free_order_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(tables: list[list[Block | None]]) -> list[Block]:
    return [b for t in tables for b in reversed(t) if b is not None]


def _request(k: int) -> GroupRequest:
    ids = iter(range(1, 10**7))
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), len(SPECS))
    for g, s in enumerate(SPECS):
        cut = s.num_unread(k * BS, BS) if s.releases else 0
        row: list[Block | None] = [None] * cut
        for j in range(cut, k + 1):  # (and the block of the next token)
            b = Block(next(ids), refs=1)
            b.key = ("content", g, j) if j < k else None
            row.append(b)
        req.tables[g], req.cut[g] = row, cut
    req.nodes = [object()] * k  # type: ignore[list-item]
    return req


def order_cases(k: int, ref: Any) -> dict[str, dict[str, Callable[[], object]]]:
    req = _request(k)
    cut = req.cut[1]
    cases = {}
    for case, found, longer in (("released cached", [True] * k, False),
                                ("released evicted", [False] * cut + [True] * (k - cut), False),
                                ("released cached, longer", [True] * k, True)):
        flags = [[True] * k, found]
        cases[case] = {
            "new": lambda f=flags, lg=longer: free_order(SPECS, BS, req, lambda g, lo, hi: f[g][lo:hi], lg),
            "hybrid-r12": lambda f=flags, lg=longer: ref.free_order(SPECS, BS, req, lambda g, j: f[g][j], lg),
            "vLLM plain": lambda: _plain(req.tables),
        }
        a, b = cases[case]["new"](), cases[case]["hybrid-r12"]()
        assert [x.block_id for x in a] == [x.block_id for x in b], case  # type: ignore[attr-defined]
    return cases


def _finished(k: int) -> tuple[HybridKVCacheManager, str]:
    return hybrid_scenes.finished(groups_module, k, BS), "r"


def free_variants(ref: Any) -> dict[str, Callable[..., list[Block]]]:
    def old(specs: Any, bs: int, req: GroupRequest, found: Any, longer: bool) -> list[Block]:
        # hybrid-r12's manager asked ``find(g, nodes[j]) is not None`` per block
        # (no flag: the group is known to find it, ``free_runs.finder``)
        return ref.free_order(specs, bs, req, lambda g, j: next(iter(found(g, j, j + 1)), True),
                              longer)

    def plain(specs: Any, bs: int, req: GroupRequest, found: Any, longer: bool) -> list[Block]:
        return _plain(req.tables)

    return {"new": free_order, "hybrid-r12": old, "vLLM plain": plain}


def _decoding(k: int) -> HybridKVCacheManager:
    """gemma3-like groups, a k-block prompt prefilled, decoded up to a block's last slot."""
    return hybrid_scenes.decoding(groups_module, k, BS)  # type: ignore[no-any-return]


def _plain_release(specs: Any, bs: int, req: GroupRequest, going: Any, finds: Any) -> list[Block]:
    return req.release(going)


def step_variants(ref: Any) -> dict[str, Callable[..., list[Block]]]:
    return {"new": release_order, "whole tables (before deps-r15)": ref.release_order_whole,
            "vLLM plain": _plain_release}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=8192, help="blocks a group (k)")
    args = parser.parse_args()
    ref, k = _reference(), args.blocks
    print(f"load average {os.getloadavg()[0]:.2f}; k = {k} blocks a group, block size {BS}")
    cases = order_cases(k, ref)
    best: dict[tuple[str, str], float] = {}
    for _ in range(args.reps):
        for case, fns in cases.items():
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                best[case, name] = min(best.get((case, name), dt), dt)
    variants = free_variants(ref)
    for _ in range(args.reps):
        for name, fn in variants.items():
            m, rid = _finished(k)
            manager_module.free_order = fn  # type: ignore[assignment]
            t0 = time.perf_counter()
            m.free(rid)
            dt = time.perf_counter() - t0
            manager_module.free_order = free_order
            best["free", name] = min(best.get(("free", name), dt), dt)
    # (a step releases what no query from its start on reads: after a 64-token step, the
    # next step releases four blocks of each window)
    steps = {"decode step, gemma3-like": 0, "step after 64 tokens, gemma3-like": 64}
    ops: dict[tuple[str, str], int] = {}
    for _ in range(args.reps + 1):  # (the last round counts bytecodes)
        for case, tokens in steps.items():  # (one block of each window released; four)
            for name, fn in step_variants(ref).items():
                m = _decoding(k)
                if tokens:
                    assert m.append_tokens("r", [7] * tokens) is not None
                growth_module.release_order = fn  # type: ignore[assignment]
                if _ == args.reps:
                    ops[case, name] = count_opcodes(lambda m=m: m.append_tokens("r", [7]))
                else:
                    t0 = time.perf_counter()
                    m.append_tokens("r", [7])
                    dt = time.perf_counter() - t0
                    best[case, name] = min(best.get((case, name), dt), dt)
                growth_module.release_order = release_order
    ops.update({(case, name): count_opcodes(fn) for case, fns in cases.items() for name, fn in fns.items()})
    for name, fn in variants.items():
        m, rid = _finished(k)
        manager_module.free_order = fn  # type: ignore[assignment]
        ops["free", name] = count_opcodes(lambda m=m, rid=rid: m.free(rid))
        manager_module.free_order = free_order
    print(f"load average {os.getloadavg()[0]:.2f} after")
    print("| case | variant | ms (min) | x vLLM plain | bytecodes |")
    print("|---|---|---:|---:|---:|")
    for (case, name), dt in best.items():
        base = best[case, "vLLM plain"]
        print(f"| {case} | {name} | {dt * 1e3:.2f} | {dt / base:.2f} | {ops[case, name]:,} |")


if __name__ == "__main__":
    main()
