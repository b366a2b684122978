"""A block whose load failed, once the request recomputed and saved it again, is offered
again (vLLM 0.33's own Scheduler, a real Redis).

vLLM's ``kv_load_failure_policy="recompute"``: a load that fails at a block leaves the
request to compute from that block (``_update_requests_with_invalid_blocks``); it asks
the connector again only when it has no computed token (the first block failed, or a
preemption). The connector stops a request's later lookups before the failed block,
else a failed first block would be offered, fail and be recomputed from, for good.
Before, that stop lasted as long as the request: after it had computed the block and
saved it over the failed value, a preemption (here vLLM's
``reset_prefix_cache(reset_running_requests=True)``, which also empties the local
cache) still recomputed every block from there, though the store held its own
checked copy."""

from __future__ import annotations

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica
from .test_async_loads import drain, free_blocks, kv_is
from .test_connector import prompt, saved_by_a
from .test_store_faults import keys_of

skip_module_without_vllm()


def _flip(client, key: bytes) -> None:
    bad = bytearray(client.get(key))
    bad[len(bad) // 2] ^= 0x40
    client.set(key, bytes(bad))


def test_a_failed_block_saved_again_is_offered_after_a_preemption(model, redis):
    tokens = prompt(6 * BLOCK + 1, salt=71)
    a = saved_by_a(model, redis, tokens)
    _flip(a.worker.worker._link.backend.client, keys_of(a, tokens, 6)[2])
    b = Replica(model, redis.url)
    idle = free_blocks(b)
    x = b.add("x", tokens, max_tokens=8)
    while x.num_computed_tokens < len(tokens):  # loads 0-1, fails at 2, computes 2-5
        b.step()
    w = b.worker.worker.stats
    assert (w.loaded, w.failed, w.store_rejected) == (2, 4, 1)
    assert min(b.computed["x"]) == 2 * BLOCK
    b.worker.worker.flush()  # (its blocks 2-5 are in the store again: its own KV)
    assert b.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert x.num_preemptions == 1 and x.num_computed_tokens == 0
    b.computed.clear()
    drain(b)
    assert (w.loaded, w.failed) == (2 + 6, 4)  # all six offered and loaded
    assert min(b.computed["x"]) == 6 * BLOCK
    assert kv_is(b, "x", list(x.all_token_ids), 6)
    b.worker.worker.flush()
    assert free_blocks(b) == idle


def test_a_failed_first_block_is_not_offered_again_before_it_is_saved(model, redis):
    """(The stop's reason: vLLM asks again at once when the first block failed.)"""
    tokens = prompt(3 * BLOCK + 1, salt=73)
    a = saved_by_a(model, redis, tokens)
    _flip(a.worker.worker._link.backend.client, keys_of(a, tokens, 3)[0])
    b = Replica(model, redis.url)
    b.add("x", tokens)
    drain(b)
    w = b.worker.worker.stats
    assert (w.loaded, w.failed, w.store_rejected) == (0, 3, 1)
    assert min(b.computed["x"]) == 0 and kv_is(b, "x", tokens, 3)
