"""What vLLM 0.33's shutdown leaves behind: ``Scheduler.shutdown`` and
``ensure_kv_transfer_shutdown`` call the connector's ``shutdown`` on each side. After it
no thread of the connector may run and no connection to the store may stay open (a
process that builds and drops engines, as an RL loop or a test suite does, would pile
up three threads and a handful of sockets per worker otherwise)."""

from __future__ import annotations

import threading

import redis as redis_py

from waiting import wait_until

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica
from .test_connector import prompt

skip_module_without_vllm()


def _ours(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t not in before and t.is_alive() and t.name.startswith("prefixkv"))


def test_shutdown_ends_every_thread_and_connection_of_both_sides(model, redis):
    before = set(threading.enumerate())
    tokens = prompt(4 * BLOCK + 3, salt=41)
    a = Replica(model, redis.url)
    a.add("r1", tokens)
    a.run()
    a.worker.worker.flush()
    b = Replica(model, redis.url)
    b.add("r2", tokens)
    b.run()
    assert b.worker.worker.stats.loaded == 4  # lookups, fetches and saves all ran
    assert _ours(before)
    for replica in (a, b):
        replica.scheduler.shutdown()  # (vLLM's: the scheduler's connector)
        replica.worker.shutdown()     # (ensure_kv_transfer_shutdown's: the worker's)
    assert _ours(before) == []
    b.worker.shutdown()  # (a second call does nothing)
    probe = redis_py.Redis(unix_socket_path=redis.socket)
    try:  # the server drops a closed client at once; give it a moment on a busy machine
        wait_until(lambda: len(probe.client_list()) == 1, "the connectors' clients closed")
    finally:
        probe.close()


def test_shutdown_with_a_load_stuck_on_a_stopped_server_ends_at_its_deadline(model, redis):
    """The server stops (SIGSTOP) under a load: the worker's shutdown waits for the
    fetch's deadline, not for the server, and then nothing of the connector runs."""
    import os
    import signal

    from .replica import looked_up
    from .test_connector import saved_by_a

    tokens = prompt(4 * BLOCK + 3, salt=43)
    saved_by_a(model, redis, tokens)
    before = set(threading.enumerate())
    b = Replica(model, redis.url, timeout=0.5)
    b.add("r2", tokens)
    looked_up(b)
    pid = redis._proc.pid
    try:
        b.step(after_schedule=lambda: os.kill(pid, signal.SIGSTOP))  # the load starts
        assert not b.worker.worker._link.done  # (under way)
        b.scheduler.shutdown()
        b.worker.shutdown()
        w = b.worker.worker.stats  # (the fetch landed by the shutdown: failed, counted)
        assert (w.loaded, w.failed, w.store_errors) == (0, 4, 1)
        assert _ours(before) == []  # (the server still stopped: nothing waited on it)
    finally:
        os.kill(pid, signal.SIGCONT)
