"""vLLM's ``reset_prefix_cache(reset_connector=True)`` (what ``pause_generation(
clear_cache=True)`` runs around an in-place weight update) reaches the connector as
``reset_cache()``. On 22793bd ``PrefixKVConnector`` had none: vLLM's default answered
None, which vLLM takes as done, and the store went on offering (and the workers loading)
every block saved with the old weights. Now the scheduler side's keys carry the reset's
tag (``store.link.reset_tag``, as ``KVCacheManager``'s: tests/store/test_store_reset_kinds.py):
nothing saved before is found, and the requests known at the reset never save."""

from __future__ import annotations

from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes
from prefixkv.store.link import reset_root, reset_tag

from .. import skip_module_without_vllm
from .test_scheduler_side import BS, ids, output, request, sched  # noqa: F401 (a fixture)

skip_module_without_vllm()


def _store_blocks(sched, tokens: list[int], n: int) -> None:  # noqa: F811
    """Put ``tokens``' first ``n`` full blocks in the store under the names saves give them."""
    fn, root = make_hash_fn("sha256", None)
    hashes, _ = chain(fn, root, token_bytes(encode_tokens(tokens[:n * BS])), [b""] * n)
    prefix = sched._link.prefix(None)
    sched._backend.put([(prefix + h.hex().encode(), b"v") for h in hashes])


def test_a_reset_leaves_every_block_saved_before_it_unfound(sched):  # noqa: F811
    tokens = list(range(1, 3 * BS + 2))
    _store_blocks(sched, tokens, 3)
    assert sched.num_new_matched_tokens(request("a", tokens), 0) == (3 * BS, True)
    assert sched.reset() is True
    assert sched.num_new_matched_tokens(request("b", tokens), 0) == (0, False)
    assert sched.num_new_matched_tokens(request("a", tokens), 0) == (0, False)


def test_requests_known_at_a_reset_never_save_and_later_ones_save_under_the_new_names(sched):  # noqa: F811
    tokens = list(range(1, 3 * BS + 2))
    old = request("old", tokens)
    sched.num_new_matched_tokens(old, 0)
    sched.after_alloc(old, [], 0)
    sched.reset()
    assert sched.build_meta(output(old=3 * BS + 1), ids(1, 2, 3, 4)).saves == []
    old.num_computed_tokens = 3 * BS + 1
    assert sched.finished(old, [1, 2, 3, 4]) is False  # (no final save either)
    new = request("new", tokens)
    sched.num_new_matched_tokens(new, 0)
    sched.after_alloc(new, [], 0)
    (run,) = sched.build_meta(output(new=3 * BS + 1), ids(5, 6, 7, 8)).saves
    fn, root = make_hash_fn("sha256", None)
    hashes, _ = chain(fn, root, token_bytes(encode_tokens(tokens[:3 * BS])), [b""] * 3)
    assert run.block_ids == (5, 6, 7) and run.parent == root and run.hashes == tuple(hashes)
    assert run.tag == reset_tag(reset_root(fn, root, 1))  # (the chain stays; the keys move)


def test_two_schedulers_reset_alike_name_blocks_alike(sched):  # noqa: F811
    from prefixkv.integrations.vllm.connector_scheduler import ConnectorScheduler

    fn, root = make_hash_fn("sha256", None)
    twin = ConnectorScheduler(sched._link, sched._backend, BS, fn, root, retry_after=0)
    tokens = list(range(1, 2 * BS + 2))
    for s in (sched, twin):
        s.reset()
        s.reset()
        s.num_new_matched_tokens(request("r", tokens), 0)
        s.after_alloc(request("r", tokens), [], 0)
    runs = [s.build_meta(output(r=2 * BS + 1), ids(1, 2, 3)).saves for s in (sched, twin)]
    assert runs[0] == runs[1] != []


def test_the_connector_answers_reset_cache_itself():
    """vLLM's base class answers None ("not implemented"), which vLLM counts as reset."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from prefixkv.integrations.vllm.connector import PrefixKVConnector

    assert PrefixKVConnector.reset_cache is not KVConnectorBase_V1.reset_cache


def test_vllms_own_reset_with_the_connector_loads_nothing_saved_before(model, redis):
    """Through vLLM 0.33's Scheduler: ``reset_prefix_cache(reset_connector=True)``, then
    the prompt replica a saved before is computed whole on b; once a, reset alike, saves
    it again, a third replica reset once loads it all."""
    from .replica import BLOCK, Replica

    tokens = [(i * 5 + 2) % 991 + 1 for i in range(4 * BLOCK + 1)]
    a = Replica(model, redis.url)
    a.add("r1", tokens)
    a.run()
    a.worker.worker.flush()
    b = Replica(model, redis.url)
    assert b.scheduler.reset_prefix_cache(reset_connector=True) is True
    b.add("r2", tokens)
    b.run()
    assert b.scheduler.connector.scheduler.stats.held_blocks == 0
    assert min(b.computed["r2"]) == 0
    assert a.scheduler.reset_prefix_cache(reset_connector=True) is True
    a.add("r3", tokens)
    a.run()
    a.worker.worker.flush()
    c = Replica(model, redis.url)
    c.scheduler.reset_prefix_cache(reset_connector=True)
    c.add("r4", tokens)
    c.run()
    assert c.worker.worker.stats.loaded == 4 and min(c.computed["r4"]) == 4 * BLOCK


def test_a_load_stated_before_a_reset_keeps_the_keys_it_was_stated_with(sched):  # noqa: F811
    """A run carries the tag of its keys (``BlockRun.tag``): the workers' link never
    resets, so one stated before the reset is fetched as it was looked up, one after
    under the reset's keys."""
    tokens = list(range(1, 3 * BS + 2))
    _store_blocks(sched, tokens, 3)
    before = request("before", tokens)
    assert sched.num_new_matched_tokens(before, 0) == (3 * BS, True)
    sched.after_alloc(before, [1, 2, 3, 4], 3 * BS)
    sched.reset()
    after = request("after", tokens)
    sched.num_new_matched_tokens(after, 0)
    sched.after_alloc(after, [5, 6, 7, 8], 3 * BS)  # (say vLLM was offered them)
    fn, root = make_hash_fn("sha256", None)
    runs = sched.build_meta(output(), ids()).loads
    assert [(r.req_id, r.tag) for r in runs] == [("before", b""),
                                                  ("after", reset_tag(reset_root(fn, root, 1)))]
