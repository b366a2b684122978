"""What a step's cold cost after the forward pass is made of: the peer workloads' step
with KV events on (``events_steps.py``: admission, take, publish), prefixkv against vLLM
0.33, timed after each of several things run between steps, untimed:

    python benchmarks/cold_parts.py [--workloads system-prompt,chat,pressure] [--rounds 2]
                                    [--modes warm,sleep,flush,flush+same,flush+copy,flush+other]
                                    [--flush-mib 4] [--account]

- ``warm``: nothing (the steps back to back);
- ``sleep``: a 2 ms sleep (``bench_vllm_events.py --workloads``' forward pass);
- ``flush``: ``--flush-mib`` MiB written (one byte a 64-byte line: the core's L2 and more);
- ``flush+same``: the flush, then the same step on a second manager of the same code
  (the code objects, types, module dicts, the interpreter's C paths and the publisher
  warm; this manager's own data cold);
- ``flush+copy``: the flush, then the step on a manager of a second import of the same
  side (new module, code and type objects: the interpreter's C paths warm, this step's
  own code objects and data cold; prefixkv: the package imported again, its publisher
  too; vLLM: its ``vllm.v1.core`` modules imported again, its ``Request`` and
  publisher code shared with the first);
- ``flush+other``: the flush, then the other side's step (the C paths both use warm).
- ``tlb``: one byte written in each of 8,192 pages (512 KiB of lines: the TLB's
  entries, and the few cache sets a 4 KiB stride maps to; not the whole L2).

Each step is built after the pause and the warm-up (prefixkv's ``prepare``, vLLM's
``Request()``: untimed, as in ``bench_vllm_events.py``), then timed (admission, take,
publish; the free untimed after).
µs a step (this thread's CPU time, the requests after the third, mean), the median of
``--rounds`` rounds, fresh managers each round, the sides' order alternating. Load and
the machine's state move the figures: compare the modes within one run. ``--account``
(deterministic): distinct opcodes (as an untraced replay first specialized them),
distinct C callables (by name) and distinct code objects a step (``sys.settrace``
opcode events, ``sys.setprofile`` C calls), per side. ``PREFIXKV_SRC=DIR``: another
tree's prefixkv.
"""

from __future__ import annotations

import argparse
import dis
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from events_steps import SIDES, SKIP  # noqa: E402
from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402
from vllm_side import BS, vllm_manager  # noqa: E402

CLOCK = time.thread_time_ns
MODES = ("warm", "sleep", "flush", "flush+same", "flush+copy", "flush+other", "tlb")
"""What runs between two steps, untimed (module doc)."""


def reimport(prefixes: tuple[str, ...], *names: str) -> list[Any]:
    """Modules ``names`` from one second import of the modules under ``prefixes`` (new
    module, code and type objects); the first import stays in ``sys.modules``."""
    def ours(k: str) -> bool:
        return any(k == p or k.startswith(p + ".") for p in prefixes)
    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    try:
        for name in names:
            __import__(name)
        return [sys.modules[name] for name in names]
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


class Side:
    """A side's manager class and publisher (of the first import, or of a second)."""

    def __init__(self, side: str, copy: bool, folder: str) -> None:
        self.side = side
        if side == "prefixkv":
            cls, publisher = KVCacheManager, EventPublisher
            if copy:
                pkg, fleet = reimport(("prefixkv",), "prefixkv", "prefixkv.fleet.publisher")
                cls, publisher = pkg.KVCacheManager, fleet.EventPublisher
            self.cls: Any = cls
            self.pub: Any = publisher(block_size=BS, heartbeat=None, max_queue=1 << 16)
        else:
            from vllm.distributed.kv_events import ZmqEventPublisher

            self.cls = None
            if copy:
                (mod,) = reimport(("vllm.v1.core",), "vllm.v1.core.kv_cache_manager")
                self.cls = mod.KVCacheManager
            tag = "copy" if copy else "first"
            self.pub = ZmqEventPublisher(0, endpoint=f"ipc://{folder}/{tag}", topic="kv")

    def manager(self, pool: int) -> Any:
        if self.side == "prefixkv":
            return self.cls(pool, BS, seed=0, enable_events=True, max_events=1 << 20)
        return vllm_manager(True, pool, self.cls)

    def step(self, m: Any, q: Any) -> list[Callable[[], object]]:
        return SIDES[self.side][0](m, self.pub, q)

    def close(self) -> None:
        if self.side == "prefixkv":
            self.pub.close(timeout=30)
        else:
            self.pub.shutdown()


JUNK = bytearray(32 << 20)
for _i in range(0, len(JUNK), 4096):
    JUNK[_i] = 1  # (its pages mapped now)


def between(mode: str, mib: int) -> None:
    """What ``mode`` runs between two steps (module doc)."""
    if mode == "sleep":
        time.sleep(0.002)
    elif mode == "tlb":
        JUNK[::4096] = bytes(len(JUNK) // 4096)
    elif mode.startswith("flush"):
        JUNK[:mib << 20:64] = bytes((mib << 20) // 64)


def replay(sides: dict[str, Side], kind: str, mode: str, name: str, mib: int) -> float:
    """µs a step of side ``kind`` (the mean over the requests after ``SKIP``)."""
    wl = builtin(name, 1.0)
    pool = wl.pool_tokens // BS
    me = sides[kind]
    other = {"flush+same": me, "flush+copy": sides.get(kind + " copy"),
             "flush+other": sides["vLLM" if kind == "prefixkv" else "prefixkv"]}.get(mode)
    m, m2 = me.manager(pool), (other.manager(pool) if other is not None else None)
    gc.collect()
    gc.freeze()
    total = 0
    for i, q in enumerate(wl.requests):
        between(mode, mib)
        if other is not None:
            for part in other.step(m2, q):
                part()
        *parts, free = me.step(m, q)  # (untimed, after the pause, as the bench's: the
        t0 = CLOCK()  # prompt prepared, vLLM's Request built)
        for part in parts:
            part()
        if i >= SKIP:
            total += CLOCK() - t0
        free()
    gc.unfreeze()
    return total / (len(wl.requests) - SKIP) / 1e3


def account(side: Side, name: str) -> tuple[float, float, float]:
    """Distinct specialized opcodes, C callables and code objects a step, averaged."""
    wl = builtin(name, 1.0)
    m = side.manager(wl.pool_tokens // BS)
    for q in wl.requests:  # (untraced first: 3.11 specializes no instruction under a tracer)
        *parts, free = side.step(m, q)
        for part in (*parts, free):
            part()
    m = side.manager(wl.pool_tokens // BS)
    ops: set[str] = set()
    cfuncs: set[Any] = set()
    codes: set[Any] = set()
    sums = [0, 0, 0]

    def tracer(frame: Any, event: str, arg: object) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            codes.add(frame.f_code)
        elif event == "opcode":
            ops.add(dis._all_opname[frame.f_code._co_code_adaptive[frame.f_lasti]])  # type: ignore[attr-defined]
        return tracer

    def profiler(frame: Any, event: str, arg: object) -> None:
        if event == "c_call":
            cfuncs.add(getattr(arg, "__qualname__", None) or repr(arg))  # (not the bound object)

    for i, q in enumerate(wl.requests):
        *parts, free = side.step(m, q)
        for part in parts:
            if i >= SKIP:
                sys.settrace(tracer)
                sys.setprofile(profiler)
            part()
            sys.setprofile(None)
            sys.settrace(None)
        for j, s in enumerate((ops, cfuncs, codes)):
            sums[j] += len(s)
            s.clear()
        free()
    n = len(wl.requests) - SKIP
    return sums[0] / n, sums[1] / n, sums[2] / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="system-prompt,chat,pressure")
    ap.add_argument("--modes", default="warm,sleep,flush,flush+same,flush+copy,flush+other")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flush-mib", type=int, default=4)
    ap.add_argument("--account", action="store_true")
    a = ap.parse_args()
    if not 1 <= a.flush_mib <= len(JUNK) >> 20:
        ap.error(f"--flush-mib: {a.flush_mib} is not within 1..{len(JUNK) >> 20}")
    modes = a.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            ap.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as folder:
        sides = {"prefixkv": Side("prefixkv", False, folder), "vLLM": Side("vLLM", False, folder)}
        if "flush+copy" in modes:
            sides["prefixkv copy"] = Side("prefixkv", True, folder)
            sides["vLLM copy"] = Side("vLLM", True, folder)
        try:
            if a.account:
                print("| workload | side | distinct opcodes | distinct C callables | "
                      "distinct code objects |\n|---|---|---:|---:|---:|")
                for name in a.workloads.split(","):
                    for kind in ("prefixkv", "vLLM"):
                        o, c, f = account(sides[kind], name)
                        print(f"| {name} | {kind} | {o:.1f} | {c:.1f} | {f:.1f} |", flush=True)
                return
            print("| workload | mode | vLLM µs | prefixkv µs | ratio | load |\n"
                  "|---|---|---:|---:|---:|---:|")
            for name in a.workloads.split(","):
                for mode in modes:
                    got: dict[str, list[float]] = {"vLLM": [], "prefixkv": []}
                    for r in range(a.rounds):
                        for kind in (("vLLM", "prefixkv") if r % 2 == 0 else ("prefixkv", "vLLM")):
                            got[kind].append(replay(sides, kind, mode, name, a.flush_mib))
                    v, p = statistics.median(got["vLLM"]), statistics.median(got["prefixkv"])
                    print(f"| {name} | {mode} | {v:.1f} | {p:.1f} | {v / p:.1f}x | "
                          f"{os.getloadavg()[0]:.1f} |", flush=True)
        finally:
            for s in sides.values():
                s.close()


if __name__ == "__main__":
    main()
