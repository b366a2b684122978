"""Other weights under one served model name never share pages (SGLang 0.5.23's own
storage interface, loader, launch flags and page keys; a real Redis).

SGLang hands a storage backend its served model name only. Before, the layout named
that and the host pool: deployments serving other weights (another model path or
revision, a quantization, RoPE overrides, another KV scales file, fp8 KV under another
model dtype) under one name, or fp8 KV caches of the two fp8 formats (SGLang's fp8
pools store bytes: both host pools are uint8), read each other's pages as their own,
content check passed. Now the layout names what SGLang published of the weights in the
process, and where it published nothing the backend refuses to start unless
``extra_config['model']`` names them."""

from __future__ import annotations

import pytest
import torch

from prefixkv.errors import ConfigError

from .engine import HostPool
from .launched import launched
from .test_storage import PAGE, config, fill, indices, page_hashes, redis, replica, sgl, tokens  # noqa: F401

SERVED = "llama"  # --served-model-name, the same on every deployment here
BASE = dict(model_path="org/llama-8b")


def _pool(dtype: torch.dtype = torch.bfloat16) -> HostPool:
    return HostPool(64, PAGE, dtype=dtype)


def _written(sgl, url: str, flags: dict, seed: int, dtype: torch.dtype = torch.bfloat16):  # noqa: F811
    """Two pages written by a deployment launched with ``flags``: their keys."""
    with launched(**flags):
        writer, pool = replica(sgl, url, pool=_pool(dtype), model=SERVED, named=False)
    fill(pool, seed)
    keys = page_hashes(sgl, tokens(2 * PAGE, 100 * seed), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 2)) == [True, True]
    return keys


def _found(sgl, url: str, flags: dict, keys: list[str], dtype: torch.dtype = torch.bfloat16):  # noqa: F811
    """How many of ``keys`` a deployment launched with ``flags`` holds and reads."""
    with launched(**flags):
        reader, _ = replica(sgl, url, pool=_pool(dtype), model=SERVED, named=False)
    return reader.batch_exists(keys), sum(reader.batch_get_v1(keys, indices(8, 2)))


OTHER = {
    "other weights": dict(model_path="org/llama-8b-instruct"),
    "other revision": dict(revision="v2"),
    "quantized": dict(quantization="fp8"),
    "rope overridden": dict(json_model_override_args='{"rope_scaling": {"factor": 4.0}}'),
    "dummy weights": dict(load_format="dummy"),
}


@pytest.mark.parametrize("change", list(OTHER.values()), ids=list(OTHER))
def test_other_weights_under_one_served_name_never_share_pages(sgl, redis, change):  # noqa: F811
    keys = _written(sgl, redis.url, BASE, 41)
    assert _found(sgl, redis.url, {**BASE, **change}, keys) == (0, 0)
    assert _found(sgl, redis.url, dict(BASE), keys) == (2, 2)  # the same flags share


FP8 = dict(BASE, kv_cache_dtype="fp8_e4m3", dtype="bfloat16")


@pytest.mark.parametrize("change", [dict(kv_cache_dtype="fp8_e5m2"), dict(dtype="float16")],
                         ids=["the other fp8 format", "another model dtype"])
def test_fp8_kv_pages_name_their_format_and_the_models_dtype(sgl, redis, change):  # noqa: F811
    # SGLang stores fp8 KV as bytes: both host pools are uint8, same page size.
    keys = _written(sgl, redis.url, FP8, 43, torch.uint8)
    assert _found(sgl, redis.url, {**FP8, **change}, keys, torch.uint8) == (0, 0)
    assert _found(sgl, redis.url, FP8, keys, torch.uint8) == (2, 2)


def test_a_kv_scales_file_is_named_by_its_contents(sgl, redis, tmp_path):  # noqa: F811
    # --quantization-param-path: the per-layer k/v scales SGLang loads for fp8_e4m3 KV.
    # Two deployments with other scales quantize the same KV to other bytes.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    b.write_text('{"kv_cache": {"scaling_factor": {"0": {"0": 0.25}}}}')
    flags = dict(FP8, quantization_param_path=str(a))
    keys = _written(sgl, redis.url, flags, 47, torch.uint8)
    assert _found(sgl, redis.url, {**flags, "quantization_param_path": str(b)}, keys,
                  torch.uint8) == (0, 0)
    assert _found(sgl, redis.url, flags, keys, torch.uint8) == (2, 2)
    a.write_text(b.read_text())  # edited in place: other scales under the same path
    assert _found(sgl, redis.url, flags, keys, torch.uint8) == (0, 0)


def test_a_draft_models_layers_in_the_page_name_its_weights(sgl, redis):  # noqa: F811
    # SGLang packs an EAGLE draft's KV layers into the target's host pages
    # (target_layer_num < layer_num): another draft model is other bytes in the page.
    class Packed(HostPool):
        target_layer_num = 1

    flags = dict(BASE, speculative_algorithm="EAGLE", speculative_draft_model_path="org/draft-a")
    other = dict(flags, speculative_draft_model_path="org/draft-b")
    layouts = []
    for f in (flags, other):
        with launched(**f):
            layouts.append(replica(sgl, redis.url, pool=Packed(64, PAGE), model=SERVED,
                                   named=False)[0].pages.layout)
            plain = replica(sgl, redis.url, model=SERVED, named=False)[0].pages.layout
        assert "draft" not in plain.model  # (no draft layers in the page: not named)
    assert layouts[0].digest() != layouts[1].digest()


def test_a_deployment_run_as_it_comes_keeps_its_keys(sgl, redis):  # noqa: F811
    # Served under its model path, default dtypes, nothing quantized or overridden:
    # nothing is added to the layout, so the pages it stored before stay reachable.
    with launched(**BASE):
        published = replica(sgl, redis.url, model=BASE["model_path"], named=False)[0]
    named = replica(sgl, redis.url, model=BASE["model_path"])[0]
    assert published.pages.layout == named.pages.layout


def test_without_published_flags_the_weights_must_be_named(sgl):  # noqa: F811
    from prefixkv.integrations.sglang.storage import PrefixKVStorage

    with pytest.raises(ConfigError, match=r"extra_config\['model'\]"):
        PrefixKVStorage(config(sgl, "redis://127.0.0.1:1/0", named=False), {})
    PrefixKVStorage(config(sgl, "redis://127.0.0.1:1/0"), {}).close()  # (named: made)


def test_a_named_model_stands_for_the_weights_path(sgl, redis):  # noqa: F811
    # Replicas may load one checkpoint from other local paths: with extra_config['model']
    # naming the weights, the path is not named, and they share; the other flags still
    # are (a named model quantized otherwise is other KV).
    with launched("/mnt/a/llama-8b"):
        writer, pool = replica(sgl, redis.url, model="llama-8b@v1")
    fill(pool, 53)
    keys = page_hashes(sgl, tokens(2 * PAGE, 5300), PAGE)
    assert writer.batch_set_v1(keys, indices(0, 2)) == [True, True]
    with launched("/models/llama-8b"):
        assert replica(sgl, redis.url, model="llama-8b@v1")[0].batch_exists(keys) == 2
    with launched("/models/llama-8b", quantization="fp8"):
        assert replica(sgl, redis.url, model="llama-8b@v1")[0].batch_exists(keys) == 0
