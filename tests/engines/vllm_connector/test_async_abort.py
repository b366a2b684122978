"""vLLM 0.33's own ``AsyncScheduler`` (steps pipelined: the next one scheduled before
the previous one's output is processed; frees deferred while a step may still write):
a request aborted while its load is under way on a stopped server, another request
running meanwhile. The late load must land in blocks nobody else holds, the aborted
request must save nothing (its blocks hold no KV of it: before they are loaded they are
garbage, and a save would put that garbage in the store under the prompt's true keys),
and every block comes back."""

from __future__ import annotations

import os
import signal
import time

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica
from .test_async_held_blocks import _work
from .test_async_loads import drain, free_blocks, kv_is
from .test_connector import prompt, saved_by_a

skip_module_without_vllm()


def _async(model: str, redis_url: str, **extra: object) -> Replica:
    """A replica on vLLM's AsyncScheduler (``test_async_held_blocks._async``, with
    connector settings)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    a = Replica(model, redis_url, num_blocks=24, **extra)
    a.config.scheduler_config.async_scheduling = True
    a.scheduler = AsyncScheduler(vllm_config=a.config, kv_cache_config=a.kv_config,
                                 structured_output_manager=StructuredOutputManager(a.config),
                                 block_size=BLOCK, log_stats=True)
    return a


def _pipelined(a: Replica, steps: int, until=lambda: False, each=lambda out: None) -> None:
    """Up to ``steps`` pipelined steps (schedule N+1, then process N's output)."""
    sched, pending = a.scheduler, None
    for _ in range(steps):
        out = sched.schedule()
        each(out)
        ran = _work(a, out) if out.total_num_scheduled_tokens or out.kv_connector_metadata else None
        if pending is not None:
            sched.update_from_output(*pending)
        pending = (out, ran) if ran is not None else None
        if until():
            break
        time.sleep(0.005)
    if pending is not None:
        sched.update_from_output(*pending)


def test_an_abort_during_an_async_load_under_async_scheduling_saves_nothing(model, redis):
    from vllm.v1.request import RequestStatus

    tokens, other = prompt(5 * BLOCK + 3, salt=73), prompt(3 * BLOCK + 2, salt=79)
    saved_by_a(model, redis, tokens)
    # (r3's lookup meets the stopped server: it gives up at once and computes)
    b = _async(model, redis.url, lookup_timeout=0.05)
    sched = b.scheduler
    assert sched.defer_block_free  # (async scheduling with a consumer: frees deferred)
    idle = free_blocks(b)
    b.add("r2", tokens)
    pid, stopped = redis._proc.pid, []

    def stop_once_the_load_is_stated(out) -> None:
        meta = out.kv_connector_metadata
        if meta is not None and meta.loads and not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(True)

    try:
        _pipelined(b, 400, until=lambda: bool(stopped), each=stop_once_the_load_is_stated)
        assert stopped and sched.requests["r2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        held = set(b.block_ids("r2"))
        sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
        b.add("r3", other)
        _pipelined(b, 400, until=lambda: len(b.computed.get("r3", ())) >= len(other))
        assert len(b.computed["r3"]) >= len(other)  # r3 ran while r2's load waited
        assert not set(b.tables["r3"]) & held
        assert not b.worker.worker._link.done  # (the load still under way)
    finally:
        os.kill(pid, signal.SIGCONT)
    _pipelined(b, 400, until=lambda: not sched.has_requests())
    assert not sched.has_requests()
    w = b.worker.worker
    w.flush()
    assert (w.stats.loaded, w.stats.failed) == (5, 0)  # (landed after the abort)
    assert w.stats.saved == 3  # r3's full blocks only
    assert free_blocks(b) == idle
    c = Replica(model, redis.url)  # the store still holds A's KV of the prompt
    c.add("r4", tokens)
    drain(c)
    assert c.worker.worker.stats.loaded == 5 and kv_is(c, "r4", tokens, 5)


def test_an_abort_before_a_deferred_load_started_saves_nothing(model, redis):
    """vLLM defers the start of an async load (``update_state_after_alloc`` called from
    a later step's output: ``Scheduler.defer_async_loads``, which vLLM 0.33 sets with
    HiSparse under async scheduling) while a step that may write the blocks is in
    flight. A request aborted then is WAITING_FOR_REMOTE_KVS with the tokens to load
    counted as computed, but vLLM sets its finished status before it calls
    ``request_finished``: the connector's check of that status never saw
    WAITING_FOR_REMOTE_KVS, and the aborted request's never-loaded blocks were queued as
    a final save (garbage under the prompt's true keys, with a checksum of the garbage)."""
    from vllm.v1.request import RequestStatus

    tokens = prompt(5 * BLOCK + 3, salt=83)
    saved_by_a(model, redis, tokens)
    b = _async(model, redis.url)
    sched = b.scheduler
    sched.defer_async_loads = True  # (vLLM's HiSparse setting; frees are deferred too)
    idle = free_blocks(b)
    r0 = b.add("r0", prompt(2 * BLOCK, salt=89), max_tokens=3 * BLOCK)  # steps in flight
    aborted: list[bool] = []  # whether vLLM freed r2 at once (no final save held it)

    def abort_while_deferred(out) -> None:
        if "r2" not in sched.requests and b.computed.get("r0") and not aborted:
            b.add("r2", tokens)
        if "r2" in sched.deferred_loads and not aborted:
            assert sched.requests["r2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert sched.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
            aborted.append("r2" not in sched.requests)

    _pipelined(b, 400, until=lambda: bool(aborted), each=abort_while_deferred)
    _pipelined(b, 400, until=lambda: not sched.has_requests())
    assert not sched.has_requests()
    w = b.worker.worker
    w.flush()
    c = Replica(model, redis.url)  # the store still holds A's KV of the prompt
    c.add("r4", tokens)
    drain(c)
    assert c.worker.worker.stats.loaded == 5 and kv_is(c, "r4", tokens, 5)
    computed = (len(r0.all_token_ids) - 1) // BLOCK  # (the last token is never fed)
    assert (w.stats.loaded, w.stats.saved) == (0, computed)  # r0's blocks, none of r2's
    assert free_blocks(b) == idle
    assert aborted == [True]  # (no load reports a deferred one: vLLM frees at once)
