"""One side of an A/B allocator benchmark (``bench_allocator.py --against``): a long-lived
process that imports whichever prefixkv is first on its PYTHONPATH and times it.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout (an
``{"error": ...}`` reply when a command failed; the worker keeps serving). Only the
public API that every compared version has is used: ``KVCacheManager(num_blocks,
block_size, seed=, hash_mode=)``, ``add_request``, ``append_tokens``, ``free``,
``preempt``, ``num_free_blocks``, ``num_cached_blocks``, and ``append_step`` where the
version has it. Commands (``cmd``):

    hello  [warm_up_s]            -> prefixkv's file, whether it has append_step, after
                                     ``warm_up`` for ``warm_up_s`` seconds (2 by default)
    setup  pool, mode             -> a fresh manager filled to capacity with cached blocks
                                     (mode "xxhash+events": KV events on; "xxhash+both": two
                                     managers, events off and on, for ``admit``'s ``events``)
    admit  tokens, hit, count, seed[, events, forward_ms]
                                  -> median ns of ``count`` admissions, each freed after
                                     (events on: then taken, and ``with_take_ns`` the median
                                     of admission + ``take_events()``; where the version has
                                     ``take_pending_events``, every other admission's events
                                     are handed off instead, ``with_handoff_ns`` the median of
                                     admission + that call; where the version has
                                     ``prefixkv.fleet.publisher`` and pyzmq is there, every
                                     step's events are then ``publish``ed, timed, to a live
                                     ``EventPublisher`` whose thread builds, encodes and
                                     sends them, as an engine's; else built untimed);
                                     after each step, a sleep of ``forward_ms`` (untimed,
                                     the GIL released: the forward pass)
    decode requests, steps, per_step, seed -> ns per decoded token and the call used
    hold   free                   -> admit and keep requests until exactly ``free`` blocks are free
    release                       -> free what ``hold`` kept
    replay requests, max_running  -> counts and ns of a continuous-batching replay
    drop                          -> forget the manager (and the publisher: its batches
                                     sent and dropped)

Prompts of ``admit``/``decode``/``hold`` are drawn from ``random.Random(seed)``, so two
workers given the same seed see the same tokens. Times are wall-clock ns, or this
thread's CPU ns when the environment sets ``PREFIXKV_BENCH_CLOCK=cpu`` (what a busy
machine's other processes move least: their time slices are not counted); the cost of
reading the clock (``CLOCK_COST``, measured at start) is subtracted from each interval.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time
import traceback
from array import array

from alloc_replay import CLOCK, CLOCK_COST, replay

BS = 16


def prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` random 16-bit token ids as a list of ints."""
    return list(array("H", rng.randbytes(2 * n)))


def warm_up(manager: type, seconds: float = 2.0) -> None:
    """Admit and free prompts for a while before anything is measured: a fresh process
    runs up to ~1.7x slower for its first seconds here (heap pages faulted in), which a
    long-running engine never sees, and both sides must start equally warm. Admits at
    least one prompt, whatever ``seconds`` (0 where nothing is timed: the tests)."""
    rng = random.Random("warm-up")
    m = manager(4096, 16, seed=0)
    ps = [prompt(rng, 2048) for _ in range(8)]
    end = time.perf_counter() + seconds
    i = 0
    while i == 0 or time.perf_counter() < end:
        m.add_request(i, ps[i % 8])
        m.free(i)
        i += 1


class Side:
    """The manager under test and the requests ``hold`` keeps alive."""

    def __init__(self) -> None:
        self.m = None
        self.m_on = None  # "xxhash+both": the manager with events on
        self.pub = None  # the events-on manager's publisher, where the version has one
        self.held: list[tuple[str, int]] = []

    def hello(self, warm_up_s: float = 2.0) -> dict:
        import prefixkv
        from prefixkv import KVCacheManager
        warm_up(KVCacheManager, warm_up_s)
        return dict(prefixkv=prefixkv.__file__, append_step=hasattr(KVCacheManager, "append_step"),
                    clock="cpu" if CLOCK is time.thread_time_ns else "wall", clock_cost_ns=CLOCK_COST,
                    python=sys.version.split()[0])

    def setup(self, pool: int, mode: str) -> dict:
        """Build a pool and admit/free distinct prompts (32k tokens, or the pool) until every block holds
        cached content (each later miss evicts); then freeze the GC, as engines do."""
        from prefixkv import KVCacheManager
        self.drop()
        t0 = time.perf_counter()
        hash_mode, _, events = mode.partition("+")
        on = dict(enable_events=True, max_events=1 << 20)
        self.m = KVCacheManager(pool, BS, seed=0, hash_mode=hash_mode,
                                **(on if events == "events" else {}))
        if events == "both":
            self.m_on = KVCacheManager(pool, BS, seed=0, hash_mode=hash_mode, **on)
        for m in (self.m, self.m_on):
            if m is None:
                continue
            rng = random.Random(f"fill/{pool}")
            i = 0
            n = min(pool, 2048) * BS
            while m.num_cached_blocks < m.num_blocks:
                if m.add_request(("fill", i), prompt(rng, n)) is None:
                    raise RuntimeError("fill found no room")
                m.free(("fill", i))
                if m._events.active:
                    m.take_events()
                i += 1
        m = self.m
        if events and hasattr(m, "take_pending_events"):
            self.pub = publisher()
        gc.collect()
        gc.freeze()
        return dict(build_s=round(time.perf_counter() - t0, 2), cached=m.num_cached_blocks)

    def admit(self, tokens: int, hit: bool, count: int, seed: str, events: bool = False,
              forward_ms: float = 0.0) -> dict:
        """Median ns of ``count`` admissions (each freed right after): distinct prompts, or
        one prompt ``count`` times (after the first, all but its last block hit)."""
        rng = random.Random(seed)
        prompts = [prompt(rng, tokens)] * count if hit else [prompt(rng, tokens) for _ in range(count)]
        m, samples = self.m_on if events else self.m, []
        totals: dict[str, list[float]] = {"with_take_ns": [], "with_handoff_ns": []}
        take = m.take_events if m._events.active else None
        hand_off = getattr(m, "take_pending_events", None) if take is not None else None
        pub = self.pub if take is not None else None
        for i, p in enumerate(prompts):
            if forward_ms and i:
                time.sleep(forward_ms / 1e3)  # the previous step's forward pass
            t0 = CLOCK()
            adm = m.add_request(i, p)
            samples.append(CLOCK() - t0 - CLOCK_COST)
            if adm is None:
                raise RuntimeError(f"admission {i} of {tokens} tokens found no room")
            m.free(i)
            if take is None:
                continue
            # what a publishing engine does each step: take the events (odd admissions,
            # where the version can: hand them off) and publish them; without a
            # publisher, a handed-off batch is built untimed, as a publisher's thread would
            if hand_off is not None and i % 2:
                t0 = CLOCK()
                pending = hand_off()
                if pub is not None:
                    pub.publish(pending)
                totals["with_handoff_ns"].append(samples[-1] + CLOCK() - t0 - CLOCK_COST)
                if pub is None:
                    pending.build()
            else:
                t0 = CLOCK()
                built = take()
                if pub is not None:
                    pub.publish(built)
                totals["with_take_ns"].append(samples[-1] + CLOCK() - t0 - CLOCK_COST)
        out = dict(ns=statistics.median(samples[1:] if hit else samples))
        for key, values in totals.items():
            if values:  # (a hit's first admission, a miss, is index 0: a take_events one)
                out[key] = statistics.median(values[1:] if hit and key == "with_take_ns" else values)
        return out

    def decode(self, requests: int, steps: int, per_step: bool, seed: str) -> dict:
        """ns per token of ``steps`` decode steps of ``requests`` running requests (100-token
        prompts, freed after): one ``append_step`` per step when ``per_step`` and the version
        has it, else one ``append_tokens`` per request and token."""
        rng = random.Random(seed)
        m = self.m
        ids = [("d", k) for k in range(requests)]
        for rid in ids:
            if m.add_request(rid, prompt(rng, 100)) is None:
                raise RuntimeError("no room for the decode requests")
        step_call = per_step and hasattr(m, "append_step")
        tokens = [prompt(rng, requests) for _ in range(steps)]
        if step_call:
            t0 = CLOCK()
            for toks in tokens:
                if m.append_step(ids, toks).short:
                    raise RuntimeError("append_step found no room")
        else:
            one = [[[t] for t in toks] for toks in tokens]
            t0 = CLOCK()
            for toks in one:
                for rid, t in zip(ids, toks, strict=True):
                    if m.append_tokens(rid, t) is None:
                        raise RuntimeError("append_tokens found no room")
        ns = CLOCK() - t0 - CLOCK_COST
        for rid in ids:
            m.free(rid)
        return dict(ns=ns / (requests * steps), call="append_step" if step_call else "append_tokens")

    def hold(self, free: int) -> dict:
        """Admit distinct prompts (kept) until exactly ``free`` blocks are free: the pool
        keeps its size and its index, while a workload gets the room it was designed for."""
        m = self.m
        rng = random.Random(f"hold/{m.num_blocks}/{len(self.held)}")
        while m.num_free_blocks > free:
            rid = ("hold", len(self.held))
            n = min(m.num_free_blocks - free, 2048) * BS
            if m.add_request(rid, prompt(rng, n)) is None:
                raise RuntimeError("hold found no room")
            self.held.append(rid)
        if m.num_free_blocks != free:
            raise RuntimeError(f"hold: {m.num_free_blocks} blocks free, not {free}")
        return dict(held=m.num_blocks - m.num_free_blocks)

    def release(self) -> dict:
        for rid in self.held:
            self.m.free(rid)
        self.held = []
        return dict(free=self.m.num_free_blocks)

    def replay(self, requests: list[dict], max_running: int) -> dict:
        return replay(self.m, requests, max_running)

    def drop(self) -> dict:
        out = {}
        if self.pub is not None:  # (close sends what is queued first)
            self.pub.close(timeout=60)
            health = self.pub.health()
            out = {k: health[k] for k in ("published_batches", "dropped_batches", "send_errors")}
        self.m, self.m_on, self.held, self.pub = None, None, [], None
        gc.unfreeze()
        gc.collect()
        return out


def publisher():
    """A live ``EventPublisher`` (PUB socket on a free loopback port, no subscriber, no
    heartbeat), or None where this version or this Python lacks one."""
    try:
        from prefixkv.fleet.publisher import EventPublisher
        return EventPublisher(block_size=BS, heartbeat=None, max_queue=1 << 16)
    except ImportError:
        return None


COMMANDS = ("hello", "setup", "admit", "decode", "hold", "release", "replay", "drop")


def serve(lines, out) -> None:
    """Answer each command line of ``lines`` on ``out`` until ``quit`` or end of input."""
    side = Side()
    for line in lines:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "quit":
            break
        try:
            if name not in COMMANDS:
                raise ValueError(f"unknown command {name!r}; one of {', '.join(COMMANDS)}")
            reply = getattr(side, name)(**cmd)
        except Exception:  # reported to the parent, which stops the run
            reply = dict(error=traceback.format_exc())
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
