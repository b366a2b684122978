"""Bytecodes a call of the paths the orphan fix touches (``ContentIndex.uncache`` and its
walk of descendants, ``store``), on this tree's ``src`` or another's, counted with
``sys.settrace`` opcode events (deterministic, whatever the load; C work such as a dict
probe is not counted, a Python loop over a dict's values is).

    PYTHONPATH=src python benchmarks/orphans_cost.py [--cached 0,1000,10000] [--events]

Cases, each on a pool with ``--cached`` other contents cached (keyed: one first block
each, so the walk's pass over the keyed contents sees them all):

- ``free``: a request of 33 tokens (8 full blocks, all new) freed normally;
- ``admit``: the same prompt admitted (8 new blocks recorded: ``store``);
- ``decode``: 16 tokens appended one by one to a live request (one block filled:
  ``store_filled``);
- ``abort``: ``free(..., num_computed_tokens=0)`` of a freshly admitted request (8 of its
  own blocks forgotten, no descendant);
- ``rewind-hit``: a request that hit block 0 of a cached 8-block prompt rewinds to 0
  (block 0 forgotten; on the fixed tree, its 7 cached descendants go too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from prefixkv import KVCacheManager

BS = 4


def count(fn: Callable[[], object]) -> int:
    """Bytecodes executed by ``fn()`` (this function's own few included)."""
    n = 0

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def manager(cached: int, events: bool) -> KVCacheManager:
    m = KVCacheManager(cached + 64, BS, seed=0, enable_events=events)
    for i in range(cached):  # one first block each: keyed contents
        m.add_request(("c", i), [10_000 + i] * BS + [1])
        m.free(("c", i))
    m.take_events()
    return m


def prompt(tag: int) -> list[int]:
    return [tag * 100 + j for j in range(8 * BS)] + [7]


def cases(cached: int, events: bool) -> dict[str, int]:
    out = {}
    m = manager(cached, events)
    m.add_request("f", prompt(1))
    out["free"] = count(lambda: m.free("f"))
    out["admit"] = count(lambda: m.add_request("g", prompt(2)))
    m.free("g")
    m.add_request("d", prompt(3))
    out["decode"] = count(lambda: [m.append_tokens("d", [5]) for _ in range(16)])
    m.free("d")
    m.add_request("x", prompt(4))
    out["abort"] = count(lambda: m.free("x", num_computed_tokens=0))
    m.add_request("p", prompt(5))
    m.free("p")
    m.add_request("h", prompt(5)[:BS] + [99])
    out["rewind-hit"] = count(lambda: m.rewind("h", 0))
    m.free("h")
    m.check_invariants()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", default="0,1000,10000")
    ap.add_argument("--events", action="store_true")
    a = ap.parse_args()
    import prefixkv
    print(f"src: {prefixkv.__file__}  events: {a.events}")
    print("| cached contents | " + " | ".join(cases(0, a.events)) + " |")
    for c in map(int, a.cached.split(",")):
        r = cases(c, a.events)
        print(f"| {c} | " + " | ".join(str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
