"""A continuous-batching replay for the A/B allocator benchmark (``alloc_worker.py``),
written against the API every compared prefixkv version has, timing allocator calls only.

One step::

    admit   : eligible waiting requests in arrival order while fewer than ``max_running``
              run; the first that does not fit waits (no overtaking) and admission is tried
              again only after some request released blocks
    room    : every running request whose last block is full needs a new block for its
              next token; while they need more than are free, the newest is preempted
              (its tokens so far become its prompt, re-queued at the head, resumed=True)
    decode  : one token per running request: one ``append_step`` call when the manager
              has it, else ``append_tokens`` per request (neither can find no room now)
    finish  : requests that appended their last output token are freed

Both sides of a comparison make the same decisions from the same numbers (free blocks,
token counts), so they replay the same admissions, preemptions and tokens as long as
they find the same hits.
"""

from __future__ import annotations

import os
import time
from collections import deque

CLOCK = time.thread_time_ns if os.environ.get("PREFIXKV_BENCH_CLOCK") == "cpu" else time.perf_counter_ns
"""The timer of allocator calls (see ``alloc_worker``'s docstring)."""


def _read_cost(clock) -> int:
    """The ns that reading ``clock`` adds to each interval it times: the median of 4001
    back-to-back readings. Subtracted from every interval (``CLOCK() - t0 - CLOCK_COST``):
    the thread CPU clock is a system call, ~0.65 µs a pair on the 2-core VM, which is
    ~10% of a small decode step and would pull every ratio toward 1."""
    pairs = []
    for _ in range(4001):
        t0 = clock()
        pairs.append(clock() - t0)
    return sorted(pairs)[2000]


CLOCK_COST = _read_cost(CLOCK)


class _Req:
    __slots__ = ("rid", "prompt", "output", "after", "resumed", "pos")

    def __init__(self, rid, prompt, output, after, resumed=False):
        self.rid, self.prompt, self.output, self.after = rid, prompt, output, after
        self.resumed = resumed
        self.pos = 0  # next output token to append


def replay(m, requests: list[dict], max_running: int) -> dict:
    """Run ``requests`` (dicts with rid, prompt, output, after: as ``BenchRequest``) through
    manager ``m`` to the end. Returns counts (prompt tokens admitted, recomputes included,
and those found cached) and the ns spent in add_request
    (``admit_ns``), in the decode calls (``decode_ns``) and in free/preempt (``free_ns``).
    Raises RuntimeError when a request cannot run even alone, or a decode call finds no
    room after the room step made it; then the requests it admitted stay admitted."""
    bs = m.block_size
    step_call = getattr(m, "append_step", None)
    waiting = deque(_Req(r["rid"], r["prompt"], r["output"], r.get("after")) for r in requests)
    running: dict[str, _Req] = {}  # admission order
    finished: set[str] = set()
    out = dict(admissions=0, preemptions=0, decoded_tokens=0, prompt_tokens=0, cached_tokens=0, steps=0,
               admit_ns=0, decode_ns=0, free_ns=0,
               decode_call="append_step" if step_call else "append_tokens")
    blocked = False
    while waiting or running:
        out["steps"] += 1
        for req in list(waiting) if not blocked else ():
            if req.after is not None and req.after not in finished:
                continue
            if len(running) >= max_running:
                break
            t0 = CLOCK()
            adm = m.add_request(req.rid, req.prompt, resumed=req.resumed)
            out["admit_ns"] += CLOCK() - t0 - CLOCK_COST
            if adm is None:
                blocked = True
                break
            waiting.remove(req)
            running[req.rid] = req
            out["admissions"] += 1
            out["prompt_tokens"] += len(req.prompt)
            out["cached_tokens"] += adm.num_cached_tokens
        if not running:
            raise RuntimeError(f"{len(waiting)} requests wait and none fits an empty pool "
                               f"of {m.num_blocks} blocks (or waits for one that never ran)")
        while sum((len(r.prompt) + r.pos) % bs == 0 for r in running.values()) > m.num_free_blocks:
            if len(running) == 1:
                raise RuntimeError(f"request {next(iter(running))!r} outgrew the pool")
            victim = running.pop(next(reversed(running)))
            t0 = CLOCK()
            m.preempt(victim.rid)
            out["free_ns"] += CLOCK() - t0 - CLOCK_COST
            waiting.appendleft(_Req(victim.rid, victim.prompt + victim.output[:victim.pos],
                                    victim.output[victim.pos:], victim.after, True))
            out["preemptions"] += 1
            blocked = False
        ids = list(running)
        if step_call:
            toks = [r.output[r.pos] for r in running.values()]
            t0 = CLOCK()
            short = step_call(ids, toks).short
            out["decode_ns"] += CLOCK() - t0 - CLOCK_COST
        else:
            toks = [r.output[r.pos:r.pos + 1] for r in running.values()]
            t0 = CLOCK()
            short = [rid for rid, t in zip(ids, toks, strict=True) if m.append_tokens(rid, t) is None]
            out["decode_ns"] += CLOCK() - t0 - CLOCK_COST
        if short:
            raise RuntimeError(f"no room to decode {list(short)!r} after making room")
        out["decoded_tokens"] += len(ids)
        for r in list(running.values()):
            r.pos += 1
            if r.pos == len(r.output):
                del running[r.rid]
                t0 = CLOCK()
                m.free(r.rid)
                out["free_ns"] += CLOCK() - t0 - CLOCK_COST
                finished.add(r.rid)
                blocked = False
    return out
