"""uncache-r16's figures: ``uncache_blocks`` among many live pending runs, on two trees in
one process (``--against``: another tree's ``src``, e.g. a ``git archive`` of main), the
trees alternated call by call. Results: benchmarks/results/uncache-r16.md.

    PYTHONPATH=src python benchmarks/uncache_cost.py --against /tmp/main/src \\
        [--uncache 1000,128] [--free 8192] [--step 8192] [--rounds 3]

``--uncache LIVE,BLOCKS``: a ``KVCacheManager`` (block size 4) with LIVE live requests of
BLOCKS full blocks each and a token, every prompt its own (each request's run pending,
``index/pending.py``); ``uncache_blocks`` names block 5 of the latest request (``latest``)
or of the first one (``first``): 6 of its blocks on (the named one and those its request
computed on it) lose their content; ``spare``: the latest prompt re-sent without its last
token (its last block computed again: a spare of the latest's). Per tree: Python
bytecodes of the call (``sys.settrace`` opcode events: the same whatever the load) and
its wall time (the garbage collector run before, and off during the call), the min over
``--rounds`` fresh builds, the trees in turn (AB, then BA, ...); the pending runs left.

``--free K``: ``HybridKVCacheManager.free`` of a finished request of K blocks a group
(full attention beside a window of 4096 tokens, block size 16: ``bench_free_order.py``'s
``free`` case, prefilled in chunks of 8192 tokens), and vLLM's plain order (group by
group, each tail first) patched in for it on the branch's tree; ``--free 0``: not run.
Bytecodes, and the min over ``--rounds`` fresh builds (trees in turn).

``--step K``: a step's release (``bench_free_order.py``'s steps): gemma3-like groups (full
attention, five windows of 1024 tokens), a request of K blocks decoding, after a step of
64 tokens; ``append_tokens`` of one token, which releases four blocks of each window
(``release_order``), on each tree, and with vLLM's order (``GroupRequest.release``)
patched in on the branch's. Bytecodes, and the min over ``--rounds`` fresh builds.

Each tree's ``prefixkv`` is imported once under its own modules (``sys.modules`` swapped
in before each of its calls: a lazy import inside it finds its own tree's).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

from prefixkv.bench import hybrid_scenes
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


def timed(tree: Tree, fn: Callable[..., Any], *args: Any) -> float:
    """Milliseconds of one ``fn(*args)`` on ``tree``, the garbage collector run before
    and kept off during it (the scenes' builds leave it work to do at any call)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        tree.run(fn, *args)
        return (time.perf_counter() - start) * 1e3
    finally:
        gc.enable()


def uncache_scene(tree: Tree, live: int, blocks: int, which: str) -> tuple[Any, Callable[[], Any]]:
    """The ``--uncache`` scene on ``tree``: the manager and the call to measure."""
    m = tree.mod("prefixkv").KVCacheManager(live * (blocks + 1) + 64, BS, seed=0)
    for i in range(live):
        base = 1_000_000 + i * 10_000
        m.add_request(i, list(range(base, base + blocks * BS + 1)))
    if which == "spare":  # the latest prompt re-sent block-aligned: its last block, computed
        base = 1_000_000 + (live - 1) * 10_000  # again, is a spare of the latest's
        return m, partial(m.add_request, "s", list(range(base, base + blocks * BS)))
    rid = live - 1 if which == "latest" else 0
    return m, partial(m.uncache_blocks, [m.get_block_ids(rid)[5]])


def uncache_rows(trees: list[Tree], live: int, blocks: int, rounds: int) -> None:
    print(f"uncache_blocks (block 5 named), or a spare: {live} live requests x {blocks} blocks")
    print("| call | tree | bytecodes | min ms | ms per round | pending runs "
          "before -> after |")
    print("|---|---|---:|---:|---|---|")
    for which in ("latest", "first", "spare"):
        ops: dict[str, int] = {}
        runs: dict[str, str] = {}
        times: dict[str, list[float]] = {t.label: [] for t in trees}
        for t in trees:
            m, call = t.run(uncache_scene, t, live, blocks, which)
            before = len(m._index.run_counts.pending)
            ops[t.label] = t.run(count_opcodes, call)
            runs[t.label] = f"{before} -> {len(m._index.run_counts.pending)}"
            m.check_invariants()
        for r in range(rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for t in order:
                m, call = t.run(uncache_scene, t, live, blocks, which)
                times[t.label].append(timed(t, call))
                del m
        for t in trees:
            ts = times[t.label]
            print(f"| {which} | {t.label} | {ops[t.label]:,} | {min(ts):.2f} | "
                  f"{' / '.join(f'{x:.2f}' for x in ts)} | {runs[t.label]} |")


FREE_BS = 16


def free_scene(tree: Tree, k: int) -> Any:
    """The ``--free`` scene on ``tree``: the manager, its request "r" finished."""
    return hybrid_scenes.finished(tree.mod("prefixkv.groups"), k, FREE_BS)


def _plain(specs: Any, bs: int, req: Any, found: Any, longer: bool) -> list[Any]:
    return [b for t in req.tables for b in reversed(t) if b is not None]


def variant_rows(title: str, trees: list[Tree], rounds: int, scene: Callable[[Tree], Any],
                 call: Callable[[Any], Callable[[], Any]], where: str, name: str,
                 plain: Callable[..., list[Any]]) -> None:
    """Rows of ``call(m)()`` on a fresh ``scene(tree)`` per tree, and on the branch's tree
    with ``plain`` patched in for ``where``'s ``name`` (vLLM's order): bytecodes, the
    prefix nodes the groups' indexes were asked about (C-speed work that bytecodes do not
    count), and wall times, the variants in turn (AB.., then ..BA)."""
    print(title)
    print("| variant | bytecodes | prefix nodes asked | min ms | ms per round |")
    print("|---|---:|---:|---:|---|")
    branch = trees[-1]
    variants = [(t.label, t, False) for t in trees] + [("vLLM plain order", branch, True)]
    module = branch.mod(where)
    real = getattr(module, name)
    asked: dict[str, int] = {}

    def one(label: str, t: Tree, patched: bool, count: bool) -> float:
        m = t.run(scene, t)
        if patched:
            setattr(module, name, plain)
        try:
            if not count:
                return timed(t, call(m))
            finds, n = m._index.finds, [0]

            def counted(g: int, nodes: Any) -> Any:
                n[0] += len(nodes)
                return finds(g, nodes)
            m._index.finds = counted
            ops = float(t.run(count_opcodes, call(m)))
            asked[label] = n[0]
            return ops
        finally:
            setattr(module, name, real)
    ops = {label: int(one(label, t, p, True)) for label, t, p in variants}
    times: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for r in range(rounds):
        for label, t, p in (variants if r % 2 == 0 else variants[::-1]):
            times[label].append(one(label, t, p, False))
    for label, _, _ in variants:
        ts = times[label]
        print(f"| {label} | {ops[label]:,} | {asked[label]:,} | {min(ts):.2f} | "
              f"{' / '.join(f'{x:.2f}' for x in ts)} |")


def step_scene(tree: Tree, k: int) -> Any:
    """The ``--step`` scene on ``tree``: the manager, its request "r" 64 tokens past a
    block boundary's decode (the next token's step releases four blocks a window)."""
    return hybrid_scenes.decoding(tree.mod("prefixkv.groups"), k, FREE_BS, after=64)


def _plain_release(specs: Any, bs: int, req: Any, going: Any, finds: Any) -> list[Any]:
    return req.release(going)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="another tree's src (e.g. main's)")
    ap.add_argument("--uncache", default="1000,128")
    ap.add_argument("--free", type=int, default=8192)
    ap.add_argument("--step", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    trees = [Tree("main", a.against), Tree("branch", here)]
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if a.uncache:
        live, blocks = map(int, a.uncache.split(","))
        uncache_rows(trees, live, blocks, a.rounds)
    if a.free:
        variant_rows(f"HybridKVCacheManager.free: {a.free} blocks a group, full attention + "
                     "window 4096", trees, a.rounds, partial(free_scene, k=a.free),
                     lambda m: partial(m.free, "r"), "prefixkv.groups.manager", "free_order",
                     _plain)
    if a.step:
        variant_rows(f"a step's release: {a.step} blocks, gemma3-like, 4 blocks a window "
                     "released", trees, a.rounds, partial(step_scene, k=a.step),
                     lambda m: partial(m.append_tokens, "r", [7]), "prefixkv.groups.growth",
                     "release_order", _plain_release)
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
