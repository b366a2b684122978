"""uncache-r16's figures: ``uncache_blocks`` among many live pending runs, on two trees in
one process (``--against``: another tree's ``src``, e.g. a ``git archive`` of main), the
trees alternated call by call. Results: benchmarks/results/uncache-r16.md.

    PYTHONPATH=src python benchmarks/uncache_cost.py --against /tmp/main/src \\
        [--uncache 1000,128] [--rounds 3]

``--uncache LIVE,BLOCKS``: a ``KVCacheManager`` (block size 4) with LIVE live requests of
BLOCKS full blocks each and a token, every prompt its own (each request's run pending,
``index/pending.py``); ``uncache_blocks`` names block 5 of the latest request (``latest``)
or of the first one (``first``): 6 of its blocks on (the named one and those its request
computed on it) lose their content. Per tree: Python bytecodes of the call (``sys.settrace``
opcode events: the same whatever the load) and its wall time, the min over ``--rounds``
fresh builds, the trees in turn (AB, then BA, ...); and the pending runs left.

Each tree's ``prefixkv`` is imported once under its own modules (``sys.modules`` swapped
in before each of its calls: a lazy import inside it finds its own tree's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

from prefixkv.bench.opcodes import count_opcodes

BS = 4


class Tree:
    """One tree's ``prefixkv``, imported from ``src`` under modules of its own."""

    def __init__(self, label: str, src: str) -> None:
        self.label = label
        self.src = os.path.abspath(src)
        saved = {k: v for k, v in sys.modules.items() if k == "prefixkv" or k.startswith("prefixkv.")}
        for k in saved:
            del sys.modules[k]
        sys.path.insert(0, self.src)
        try:
            import prefixkv
            import prefixkv.groups  # noqa: F401 (imported under this tree)
            assert os.path.dirname(os.path.dirname(prefixkv.__file__ or "")) == self.src, (
                prefixkv.__file__, self.src)
        finally:
            sys.path.remove(self.src)
        self.modules = {k: v for k, v in sys.modules.items()
                        if k == "prefixkv" or k.startswith("prefixkv.")}
        for k in self.modules:
            del sys.modules[k]
        sys.modules.update(saved)

    def mod(self, name: str) -> ModuleType:
        return self.modules[name]

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with this tree's modules in ``sys.modules``."""
        saved = {k: v for k, v in sys.modules.items() if k == "prefixkv" or k.startswith("prefixkv.")}
        for k in saved:
            del sys.modules[k]
        sys.modules.update(self.modules)
        try:
            return fn(*args)
        finally:
            for k in self.modules:
                sys.modules.pop(k, None)
            sys.modules.update(saved)


def uncache_scene(tree: Tree, live: int, blocks: int, which: str) -> tuple[Any, list[int]]:
    """The ``--uncache`` scene on ``tree``: the manager and the block id to name."""
    m = tree.mod("prefixkv").KVCacheManager(live * (blocks + 1) + 64, BS, seed=0)
    for i in range(live):
        base = 1_000_000 + i * 10_000
        m.add_request(i, list(range(base, base + blocks * BS + 1)))
    rid = live - 1 if which == "latest" else 0
    return m, [m.get_block_ids(rid)[5]]


def uncache_rows(trees: list[Tree], live: int, blocks: int, rounds: int) -> None:
    print(f"uncache_blocks: {live} live requests x {blocks} blocks, block 5 named")
    print("| request named | tree | bytecodes | min ms | ms per round | pending runs "
          "before -> after |")
    print("|---|---|---:|---:|---|---|")
    for which in ("latest", "first"):
        ops: dict[str, int] = {}
        runs: dict[str, str] = {}
        times: dict[str, list[float]] = {t.label: [] for t in trees}
        for t in trees:
            m, named = t.run(uncache_scene, t, live, blocks, which)
            before = len(m._index.run_counts.pending)
            ops[t.label] = t.run(count_opcodes, partial(m.uncache_blocks, named))
            runs[t.label] = f"{before} -> {len(m._index.run_counts.pending)}"
            m.check_invariants()
        for r in range(rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for t in order:
                m, named = t.run(uncache_scene, t, live, blocks, which)
                start = time.perf_counter()
                t.run(m.uncache_blocks, named)
                times[t.label].append((time.perf_counter() - start) * 1e3)
                del m
        for t in trees:
            ts = times[t.label]
            print(f"| {which} | {t.label} | {ops[t.label]:,} | {min(ts):.2f} | "
                  f"{' / '.join(f'{x:.2f}' for x in ts)} | {runs[t.label]} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="another tree's src (e.g. main's)")
    ap.add_argument("--uncache", default="1000,128")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    trees = [Tree("main", a.against), Tree("branch", here)]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if a.uncache:
        live, blocks = map(int, a.uncache.split(","))
        uncache_rows(trees, live, blocks, a.rounds)
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
