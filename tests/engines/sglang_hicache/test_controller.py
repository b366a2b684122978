"""PrefixKVStorage under SGLang 0.5.23's own HiCacheController (its storage threads, its
batching, its page keys), device pools, allocator and host pools on a CPU, on a real
Redis; the stand-ins are listed in controller.py. Every page SGLang takes as loaded
equals the page another rank wrote under the same keys; what must not be shared
(other models, TP ranks of an MHA model, tenants) never is; a failing store costs
misses, never an exception in SGLang's threads."""

from __future__ import annotations

import pytest
import torch

from prefixkv.store.server import LocalRedis

from .controller import Engine, closing, load  # noqa: F401

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.fixture(scope="module")
def s():
    return load()


@pytest.fixture(scope="module")
def redis():
    with LocalRedis() as server:
        yield server


def tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def same(written: list[torch.Tensor], loaded: list[torch.Tensor]) -> bool:
    """Loaded pages equal the first ``len(loaded)`` written ones, bit for bit."""
    return len(loaded) <= len(written) and all(
        torch.equal(w.view(torch.uint8), g.view(torch.uint8))
        for w, g in zip(written, loaded, strict=False))


def no_errors_in_sglang_threads(caplog) -> None:
    """SGLang's storage threads log what a backend raised ('HiCache backup failed',
    'HiCache prefetch transfer failed', 'HiCache storage query failed')."""
    raised = [r.getMessage() for r in caplog.records
              if r.name.startswith("sglang") and r.exc_info is not None]
    assert not raised, raised[:3]


@pytest.mark.parametrize("hybrid", [True, False], ids=["HybridCacheController", "HiCacheController"])
@pytest.mark.parametrize("interface_v1", [1, 0])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_second_rank_prefetches_what_the_first_backed_up(s, redis, layout, interface_v1,
                                                           hybrid, caplog):
    a = Engine(s, redis.url, layout=layout, interface_v1=interface_v1, hybrid=hybrid)
    b = Engine(s, redis.url, layout=layout, interface_v1=interface_v1, hybrid=hybrid)
    assert type(a.cc).__name__ == ("HybridCacheController" if hybrid else "HiCacheController")
    assert a.cc.page_get_func.__name__ == ("_page_get_zero_copy" if interface_v1
                                           else "_generic_page_get")
    toks = tokens(32, 1000 + 100 * LAYOUTS.index(layout) + 50 * interface_v1 + 1000 * hybrid)
    done, written = a.backup(toks, seed=1)
    assert done == 32 and a.backend.pages.written == 8
    got, loaded = b.prefetch(toks)
    assert got == 32 and same(written, loaded) and len(loaded) == 8
    assert b.backend.pages.hits == 8 and b.backend.pages.rejected == 0
    no_errors_in_sglang_threads(caplog)
    a.close()
    b.close()


def test_mla_pages_are_one_copy_for_all_tp_ranks_mha_pages_one_per_rank(s, redis):
    toks = tokens(16, 2000)
    mla0 = Engine(s, redis.url, mla=True, tp_rank=0, tp_size=2)
    mla1 = Engine(s, redis.url, mla=True, tp_rank=1, tp_size=2)
    assert mla0.cc.storage_config.is_mla_model and mla1.cc.backup_skip and not mla0.cc.backup_skip
    done, written = mla0.backup(toks, seed=2)
    got, loaded = mla1.prefetch(toks)
    assert done == got == 16 and same(written, loaded)
    mha0 = Engine(s, redis.url, tp_rank=0, tp_size=2)
    mha1 = Engine(s, redis.url, tp_rank=1, tp_size=2)
    assert mha0.backup(toks, seed=3)[0] == 16
    assert mha1.prefetch(toks)[0] == 0                    # rank 1 holds other heads
    assert Engine(s, redis.url, tp_rank=0, tp_size=2).prefetch(toks)[0] == 16
    for other in (Engine(s, redis.url, tp_rank=0, tp_size=2, model="test/other"),
                  Engine(s, redis.url, tp_rank=0, tp_size=4),
                  Engine(s, redis.url, mla=True, model="test/other")):
        assert other.prefetch(toks)[0] == 0


def test_tenants_salted_by_sglang_never_share_pages(s, redis):
    a, b = Engine(s, redis.url), Engine(s, redis.url)
    toks = tokens(16, 3000)
    done, written = a.backup(toks, seed=4, salt="tenant-a")
    assert done == 16
    assert b.prefetch(toks, salt="tenant-b")[0] == 0
    assert b.prefetch(toks)[0] == 0
    got, loaded = b.prefetch(toks, salt="tenant-a")
    assert got == 16 and same(written, loaded)


@pytest.mark.parametrize("page,pages", [(1, 300), (16, 12)])
def test_page_sizes_and_prefixes_longer_than_one_storage_batch(s, redis, page, pages):
    """SGLang queries, reads and writes 128 pages a call (STORAGE_BATCH_SIZE)."""
    size = 2 * pages * page
    a = Engine(s, redis.url, page=page, tokens=size)
    b = Engine(s, redis.url, page=page, tokens=size)
    toks = tokens(pages * page, 4000 + page)
    done, written = a.backup(toks, seed=5)
    got, loaded = b.prefetch(toks)
    assert done == got == pages * page and same(written, loaded)


def test_a_wrong_page_mid_prefix_stops_sglang_there(s, redis, caplog):
    a, b = Engine(s, redis.url), Engine(s, redis.url)
    toks = tokens(8 * 4, 5000)
    done, written = a.backup(toks, seed=6)
    keys, client, pages = a.hashes(toks), a.backend.backend.client, a.backend.pages
    client.set(pages.key(keys[3]), client.get(pages.key(keys[5])))  # page 5 under page 3's key
    got, loaded = b.prefetch(toks)
    assert got == 3 * 4 and same(written, loaded)
    assert b.backend.pages.rejected == 1
    no_errors_in_sglang_threads(caplog)


def test_a_store_that_goes_down_costs_misses_not_errors_in_sglangs_threads(s, caplog):
    server = LocalRedis()
    try:
        a, b = Engine(s, server.url), Engine(s, server.url)
        toks = tokens(16, 6000)
        assert a.backup(toks, seed=7)[0] == 16
        server.stop()
        assert a.backup(tokens(16, 6100), seed=8)[0] == 0
        assert b.prefetch(toks) == (0, [])
        server.start()                                    # empty again
        done, written = a.backup(toks, seed=9)
        got, loaded = b.prefetch(toks)
        assert done == got == 16 and same(written, loaded)
        no_errors_in_sglang_threads(caplog)
    finally:
        server.close()


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "wait_complete"])
def test_sglangs_own_fault_injector_and_prefetch_policies_never_load_wrong_kv(
        s, redis, policy, monkeypatch):
    """SGLang's HiCacheStorageFailureInjector (its test switch, wrapped around the
    backend by its factory) delays and fails calls at random; the scheduler stops each
    prefetch by ``policy`` (timeout: after 20 ms). Whatever SGLang takes as loaded is
    what was written."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    a = Engine(s, redis.url, page=1, tokens=600)
    b = Engine(s, redis.url, page=1, tokens=600)
    assert type(b.backend).__name__ == "HiCacheStorageFailureInjector"
    loaded_any = 0
    for round_ in range(24):  # (6 rounds; wait_complete until one loads: with 20% of calls
        # failing, 6 rounds all loading nothing happened in ~1% of runs)
        toks = tokens(260, 7000 + 1000 * round_ + 100 * ["best_effort", "timeout",
                                                        "wait_complete"].index(policy))
        done, written = a.backup(toks, seed=10 + round_)
        got, loaded = b.prefetch(toks, policy=policy, timeout=0.02)
        assert got <= done and same(written, loaded)
        loaded_any += got
        if round_ >= 5 and (policy != "wait_complete" or loaded_any):
            break
    if policy == "wait_complete":
        assert loaded_any > 0


@pytest.mark.parametrize("mla", [False, True])
def test_a_host_layout_without_flat_pages_is_refused_when_sglang_attaches_the_backend(
        s, redis, mla):
    # Before: the backend attached to a page_unified host pool (its dummy page has a
    # size), then every backup raised ValueError('Unsupported layout') from
    # get_data_page inside SGLang's backup thread ('HiCache backup failed'), and a
    # prefetch would have read and counted pages before set_from_flat_data_page raised.
    from prefixkv.errors import ConfigError

    with pytest.raises(ValueError, match="flat pages") as refused:
        Engine(s, redis.url, layout="page_unified", mla=mla)
    error = refused.value  # (HiCacheController wraps it in a ValueError; the hybrid one not)
    assert isinstance(error, ConfigError) or isinstance(error.__cause__, ConfigError)


def test_a_side_pool_of_a_hybrid_model_is_refused_when_sglang_registers_it(s, redis):
    # Before: SGLang's HybridCacheController registered every host pool of the group
    # (Mamba, SWA, DSA indexer, draft SWA) and the backend took them; then each hit
    # query with side pools (batch_exists_v2) and each side-pool read or backup
    # (batch_get_v2, batch_set_v2) raised NotImplementedError in SGLang's threads:
    # no page ever loaded, an error logged per request.
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from prefixkv.errors import ConfigError

    engine = Engine(s, redis.url)
    backend = engine.backend
    assert set(backend.registered_pools) == {PoolName.KV}  # (the group's KV anchor)
    for name in (PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER, PoolName.DRAFT_SWA):
        with pytest.raises(ConfigError, match=str(name)):
            backend.register_mem_host_pool_v2(engine.host, name)
    assert set(backend.registered_pools) == {PoolName.KV}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16, torch.float32])
def test_kv_of_other_dtypes_round_trips_bit_for_bit(s, redis, dtype):
    a, b = Engine(s, redis.url, dtype=dtype), Engine(s, redis.url, dtype=dtype)
    toks = tokens(16, 21000 + 100 * [torch.float8_e4m3fn, torch.float16, torch.float32].index(dtype))
    done, written = a.backup(toks, seed=60)
    got, loaded = b.prefetch(toks)
    assert done == got == 16 and same(written, loaded)
    assert Engine(s, redis.url).prefetch(toks)[0] == 0      # (bfloat16 KV: other pages)
