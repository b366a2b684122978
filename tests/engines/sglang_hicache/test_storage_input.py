"""Bad input from SGLang's side of PrefixKVStorage (SGLang 0.5.23's own storage
interface and loader, a real Redis): refused with ConfigError before anything is read,
stored or written to host memory."""

from __future__ import annotations

import pytest
import torch

from prefixkv.errors import ConfigError

from .test_storage import PAGE, fill, indices, page_hashes, redis, replica, sgl, tokens  # noqa: F401


def test_flat_pages_of_another_dtype_are_refused_before_any_read_or_write(sgl, redis):  # noqa: F811
    # Before: only the byte count was checked. batch_set stored a float16 page (or a
    # float32 page of half the elements) for a bfloat16 pool: read back as bfloat16 it is
    # other KV, and it passes the content check (the bytes are what was written). A
    # batch_get target of another dtype took the page's bytes, and SGLang's generic
    # path then converts its values into the pool (set_from_flat_data_page): other KV.
    # A value that is not a tensor raised AttributeError.
    writer, wpool = replica(sgl, redis.url, interface_v1=0)
    reader, rpool = replica(sgl, redis.url, interface_v1=0)
    fill(wpool, 31)
    keys = page_hashes(sgl, tokens(2 * PAGE, 2300), PAGE)
    page = wpool.get_data_page(0)
    for bad in (page.view(torch.float16), page.view(torch.float32), page.tolist(),
                bytes(page.view(torch.uint8).numpy())):
        with pytest.raises(ConfigError, match="value 1"):
            writer.batch_set(keys, [page, bad])
        with pytest.raises(ConfigError, match="value 0"):
            writer.set(keys[0], bad)
    assert reader.batch_exists(keys) == 0 and writer.pages.written == 0
    assert writer.batch_set(keys, [page, wpool.get_data_page(PAGE)])
    good = rpool.get_dummy_flat_data_page()
    for bad in (torch.zeros_like(good, dtype=torch.float16),
                torch.zeros(good.numel() // 2, dtype=torch.float32)):
        with pytest.raises(ConfigError, match="target location 1"):
            reader.batch_get(keys, [good, bad])
        assert torch.count_nonzero(good) == 0 and reader.pages.hits == 0
    assert torch.equal(reader.batch_get(keys, [good, None])[0], page)


def test_two_pages_read_into_one_host_page_are_refused_before_any_read_or_write(sgl, redis):  # noqa: F811
    # Before: batch_get_v1 read both pages into host page 8 (the second overwrote the
    # first) and answered [True, True]: SGLang would take page 0's tokens as held there,
    # with page 1's KV. batch_set_v1 stored one host page under two keys.
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 32)
    keys = page_hashes(sgl, tokens(2 * PAGE, 2500), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 2)) == [True, True]
    twice = torch.cat([indices(8, 1), indices(8, 1)])
    with pytest.raises(ConfigError, match="twice"):
        reader.batch_get_v1(keys, twice)
    assert torch.count_nonzero(rpool.kv_buffer) == 0 and reader.pages.hits == 0
    others = page_hashes(sgl, tokens(2 * PAGE, 2600), PAGE)
    with pytest.raises(ConfigError, match="twice"):
        writer.batch_set_v1(others, twice)
    assert reader.batch_exists(others) == 0


def test_host_indices_that_are_not_integers_are_refused_before_any_read_or_write(sgl, redis):  # noqa: F811
    # Before: each page's start went through int(): fractional rows (8.5 .. 11.5) read
    # the page into rows 8..11, and a list of strings ("8", ...) was read as rows; a
    # list with a non-number, None or a 0-d tensor raised TypeError or ValueError.
    writer, wpool = replica(sgl, redis.url)
    reader, rpool = replica(sgl, redis.url)
    fill(wpool, 33)
    keys = page_hashes(sgl, tokens(PAGE, 2700), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 1)) == [True]
    for bad in (indices(8, 1).double() + 0.5, indices(8, 1).float(),
                [str(i) for i in range(8, 8 + PAGE)], [8, 9, None, 11], None,
                torch.tensor(8)):
        with pytest.raises(ConfigError, match="host indices"):
            reader.batch_get_v1(keys, bad)
        assert torch.count_nonzero(rpool.kv_buffer) == 0 and reader.pages.hits == 0
        with pytest.raises(ConfigError, match="host indices"):
            writer.batch_set_v1(page_hashes(sgl, tokens(PAGE, 2800), PAGE), bad)
    assert reader.batch_get_v1(keys, list(range(8, 8 + PAGE))) == [True]


def test_unknown_extra_config_keys_are_refused_before_connecting(sgl):  # noqa: F811
    # Before: a misspelt key ("tll", "time_out", "retry-after", "Model") was ignored, so
    # pages lived a day instead of the hour asked, or a new weights revision named in a
    # misspelt "model" key shared the old revision's pages (other KV).
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    from .test_storage import config

    for typo in ("tll", "time_out", "retry-after", "Model", "redis_uri"):
        cfg = config(sgl, "redis://127.0.0.1:1/0", **{typo: 1})
        with pytest.raises(ConfigError, match=typo):
            PrefixKVStorage(cfg, {})
    # (file_storage_path: SGLang adds it when launched with --file-storage-path)
    PrefixKVStorage(config(sgl, "redis://127.0.0.1:1/0", ttl=60, model="m@2",
                           file_storage_path="/tmp/x"), {})


def test_a_host_pools_page_format_tag_keeps_its_pages_apart_under_a_model_revision(sgl, redis):  # noqa: F811
    # SGLang tags the model name it hands a backend with the host pool's
    # storage_format_tag (a page byte format of its own: "pages persisted in another
    # format miss instead of loading"). Before: extra_config['model'] replaced that
    # name, tag and all, and the layout did not name the tag: a tagged pool read an
    # untagged pool's pages of the same dtype and size (other KV).
    from .engine import HostPool

    class Tagged(HostPool):
        storage_format_tag = "unified-token-major"

    writer, wpool = replica(sgl, redis.url, model="test/model@2")
    fill(wpool, 34)
    keys = page_hashes(sgl, tokens(2 * PAGE, 2900), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 2)) == [True, True]
    tagged, _ = replica(sgl, redis.url, pool=Tagged(64, PAGE), model="test/model@2")
    assert tagged.batch_exists(keys) == 0
    assert tagged.batch_get_v1(keys, indices(8, 2)) == [False, False]
    assert replica(sgl, redis.url, model="test/model@2")[0].batch_exists(keys) == 2


def test_clear_leaves_the_pages_stored_before_unfound(sgl, redis):  # noqa: F811
    # SGLang's POST /hicache/storage-backend/clear (after an in-place weight update:
    # SGLang's flush_cache leaves L3 alone) and a PD role switch call clear() and report
    # it done whatever it does. Before reset-r23 it only logged a warning: every page
    # stored with the old weights was still found by exists and read by get. Now its
    # keys move to a new namespace (of the first and the count of clears).
    backend, pool = replica(sgl, redis.url)
    fill(pool, 35)
    keys = page_hashes(sgl, tokens(2 * PAGE, 3100), PAGE)
    assert backend.batch_set_v1(keys, indices(0, 2)) == [True, True]
    other, opool = replica(sgl, redis.url)               # a replica that did not clear
    backend.clear()
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    before = pool.kv_buffer[:, :, 16:24].clone()
    assert backend.batch_get_v1(keys, indices(16, 2)) == [False, False]
    assert torch.equal(pool.kv_buffer[:, :, 16:24], before)
    assert backend.get(keys[0]) is None
    assert other.batch_exists(keys) == 2                 # its own namespace: the old one
    fill(pool, 36)
    assert backend.batch_set_v1(keys, indices(0, 2)) == [True, True]
    assert backend.batch_exists(keys) == 2
    assert other.batch_get_v1(keys, indices(16, 2)) == [True, True]
    assert not torch.equal(opool.kv_buffer[:, :, 16:24], pool.kv_buffer[:, :, 0:8])
    other.clear()                                        # cleared as often: shares again
    assert other.batch_get_v1(keys, indices(16, 2)) == [True, True]
    assert torch.equal(opool.kv_buffer[:, :, 16:24], pool.kv_buffer[:, :, 0:8])


def test_clear_before_the_host_pool_is_registered_is_refused(sgl, redis):  # noqa: F811
    from .test_storage import config

    backend = sgl.factory.create_backend("dynamic", config(sgl, redis.url), None)
    with pytest.raises(ConfigError, match="register_mem_pool_host"):
        backend.clear()


def test_a_malformed_redis_url_is_refused_before_connecting(sgl):  # noqa: F811
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    from .test_storage import config

    for url in ("redis://127.0.0.1:99999/0", "redis://127.0.0.1/abc", "redis://127.0.0.1/1/2",
                "redis://127.0.0.1/-1"):
        try:
            PrefixKVStorage(config(sgl, url), {})
        except ConfigError:
            continue
        raise AssertionError(f"{url} was taken")


def test_decode_context_parallel_ranks_are_refused_before_connecting(sgl):  # noqa: F811
    # With DCP each rank of an MLA model holds its own slice of a page (SGLang's file
    # backend names dcp_rank in its keys). Before: the layout named neither dcp_rank nor
    # dcp_size, so DCP ranks 0 and 1 wrote different bytes under one key and each read
    # the other's as its own (other KV); the host indices are logical there, the pool's
    # size physical. SGLang 0.5.23's controller refuses L3 with DCP for backends other
    # than file and Mooncake before making one; this holds for any other caller.
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    for rank in (0, 1):
        cfg = sgl.storage.HiCacheStorageConfig(
            tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="test/mla", dcp_size=2, dcp_rank=rank, logical_page_size=2 * PAGE,
            extra_config={"redis_url": "redis://127.0.0.1:1/0"})
        with pytest.raises(ConfigError, match="dcp"):
            PrefixKVStorage(cfg, {})


def test_a_host_pool_without_any_flat_page_is_refused_with_config_error(sgl, redis):  # noqa: F811
    # SGLang's MXFP8 host pool raises NotImplementedError from all three flat-page calls
    # (its scales live outside kv_buffer). Before: get_dummy_flat_data_page was called
    # outside the check, so attaching raised that NotImplementedError, not ConfigError.
    from .engine import HostPool

    class NoFlatPages(HostPool):
        def get_dummy_flat_data_page(self):
            raise NotImplementedError("MXFP8 KV host pool does not expose flat storage pages")

        get_data_page = set_from_flat_data_page = get_dummy_flat_data_page

    with pytest.raises(ConfigError, match="flat"):
        replica(sgl, redis.url, pool=NoFlatPages(64, PAGE))


def test_an_unknown_keyword_names_the_backend(sgl):  # noqa: F811
    # (the sweep of tests/test_constructor_signatures.py, for the class SGLang loads)
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    with pytest.raises(TypeError, match=r"^PrefixKVStorage\.__init__\(\) got an unexpected keyword "
                                        r"argument 'no_such_keyword'$"):
        PrefixKVStorage(None, {}, no_such_keyword=1)  # type: ignore[arg-type, call-arg]
