"""Bytecodes of the vLLM plug-in's step on a peer workload, by part and by function: as
deployed with vLLM's ``ZmqEventPublisher`` (prefixkv's ``Scheduler``: each ``Request``
built with the manager's preparing hasher, so admission takes the prepared ``Prompt``;
events handed off, built on the publisher's thread), the step of
``plugin_events_pair.py --deployed``: ``get_computed_blocks``, ``allocate_slots``,
``take_events()``. Every request after the first three, ``sys.settrace``; deterministic,
whatever the load (the timed figure is ``plugin_events_pair.py``'s):

    python benchmarks/plugin_step_opcodes.py [chat,system-prompt,document,pressure] [--top 12]

Prints per workload the bytecodes a step of each part, then the functions by their own
bytecodes a step (part, function, file, bytecodes, calls). ``PREFIXKV_SRC=DIR``: another
tree's prefixkv (an A/B: run both).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, os.environ.get("PREFIXKV_SRC") or str(Path(__file__).resolve().parents[1] / "src"))

from vllm.v1.request import Request  # noqa: E402

from prefixkv.bench.workloads import builtin  # noqa: E402
from prefixkv.integrations.vllm.manager import KVCacheManager  # noqa: E402
from vllm_side import BS, HASHER, SAMPLING, vllm_manager  # noqa: E402

SKIP = 3
Key = tuple[str, str, str]


def replay(name: str) -> tuple[int, collections.Counter[Key], collections.Counter[Key]]:
    """Steps counted, and each (part, function, file)'s own bytecodes and calls."""
    wl = builtin(name, 1.0)
    m = vllm_manager(True, wl.pool_tokens // BS, KVCacheManager)
    m.hands_off_events = True  # (what ``hand_off`` sets with vLLM's publisher)
    hasher = m.prepared_prompts.hasher(HASHER)
    ops: collections.Counter[Key] = collections.Counter()
    calls: collections.Counter[Key] = collections.Counter()
    part = ""

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        key = (part, frame.f_code.co_name, frame.f_code.co_filename.rsplit("/", 1)[-1])
        calls[key] += 1
        frame.f_trace_opcodes = True

        def opcodes(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                ops[key] += 1
            return opcodes
        return opcodes

    steps = 0
    for j, q in enumerate(wl.requests):
        req = Request(q.rid, list(q.prompt), SAMPLING, None, block_hasher=hasher)
        on = j >= SKIP
        steps += on
        if on:
            part = "get"
            sys.settrace(tracer)
        blocks, hit, *_ = m.get_computed_blocks(req)
        part = "alloc"
        m.allocate_slots(req, len(q.prompt) - hit, num_new_computed_tokens=hit,
                         new_computed_blocks=blocks)
        part = "take"
        m.take_events()
        sys.settrace(None)
        m.free(req)
    assert m.prepared_prompts.taken == 2 * len(wl.requests), "each step took its Prompt"
    return steps, ops, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="?", default="chat,system-prompt,document,pressure")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for name in args.workloads.split(","):
        steps, ops, calls = replay(name)
        parts: collections.Counter[str] = collections.Counter()
        for (p, _, _), c in ops.items():
            parts[p] += c
        print(f"### {name}: {sum(parts.values()) / steps:,.1f} bytecodes a step ("
              + ", ".join(f"{p} {parts[p] / steps:,.1f}" for p in ("get", "alloc", "take"))
              + f"; {steps} steps)")
        for (p, f, file), c in ops.most_common(args.top):
            print(f"  {p:5s} {f:28s} {file:22s} {c / steps:9.1f} {calls[(p, f, file)] / steps:5.2f}")


if __name__ == "__main__":
    main()
