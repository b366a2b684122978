"""The connector's store layout names everything that changes the KV of one model name
and revision: a value written by a replica whose weights are quantized another way, whose
Hugging Face config was overridden (RoPE), or whose model computes in another dtype
(with an fp8 KV cache, the cache's dtype alone does not tell) is other KV, and must be
a miss, never loaded. Before, all three named the same keys and passed the check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .. import skip_module_without_vllm
from .replica import BLOCK, LAYERS, kv_cache_config, vllm_config

skip_module_without_vllm()


def _layout(model: str, kv_dtype: torch.dtype = torch.float16, **change: object):
    from vllm.config import ModelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from prefixkv.integrations.vllm.connector_config import store_layout

    cfg = vllm_config(model, "redis://127.0.0.1:6379/0")
    cfg.model_config = ModelConfig(model=model, skip_tokenizer_init=True, seed=42,
                                   **{"dtype": "float16", **change})
    kv = kv_cache_config(8)
    if kv_dtype != torch.float16:
        spec = kv.kv_cache_groups[0].kv_cache_spec
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=spec.num_kv_heads,
                                 head_size=spec.head_size, dtype=kv_dtype)
        kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=kv.kv_cache_tensors,
                           kv_cache_groups=[KVCacheGroupSpec(kv.kv_cache_groups[0].layer_names,
                                                             spec)])
    layout = store_layout(cfg, kv, None, 0)
    assert layout.block_bytes == LAYERS * kv.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    return layout


@pytest.fixture(scope="module")
def base(model):
    return _layout(model)


@pytest.mark.parametrize("change", [dict(quantization="fp8"),
                                    dict(hf_overrides={"rope_theta": 123456.0})],
                         ids=["weights quantized", "config overridden"])
def test_a_change_to_the_models_kv_changes_the_layout(model, base, change):
    assert base.digest() != _layout(model, **change).digest()


def test_the_models_dtype_is_named_under_an_fp8_cache(model):
    fp8 = torch.float8_e4m3fn
    assert _layout(model, fp8).digest() != _layout(model, fp8, dtype="bfloat16").digest()


def test_an_unchanged_model_keeps_its_layout(model, base):
    """Nothing added for a model run as it comes (stored blocks stay reachable)."""
    assert base.model.endswith("|0")  # (the text as it was: no new fields)
    assert _layout(model, hf_overrides={}).digest() == base.digest()


@pytest.fixture
def custom_kv_dtypes():
    """Two ``--kv-cache-dtype`` values a platform registers (vLLM's
    ``register_kv_cache_dtype``): both uint8, both ``KVQuantMode.CUSTOM``, each its own
    byte format. Unregistered after the test."""
    from vllm.config import cache
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import KVQuantMode

    names = ["prefixkv_test_fmt_a", "prefixkv_test_fmt_b"]
    for name in names:
        cache.register_kv_cache_dtype(name)(type(name, (), {
            "name": name, "torch_dtype": lambda self: torch.uint8,
            "quant_mode": lambda self: KVQuantMode.CUSTOM}))
    yield names
    for name in names:
        cache.KV_CACHE_DTYPES.remove(name)
        del STR_DTYPE_TO_TORCH_DTYPE[name], cache._KV_CACHE_DTYPE_HANDLERS[name]


def test_a_platforms_kv_cache_dtype_is_named(model, custom_kv_dtypes):
    # KVQuantMode.CUSTOM is an alias of OCTAVE_K3V4 (both 12), and the spec holds no
    # dtype name: two registered formats of one torch dtype and page size were one
    # layout, and each replica read the other's bytes as its own format.
    from vllm.v1.kv_cache_interface import KVQuantMode

    from prefixkv.integrations.vllm.connector_config import store_layout

    from .replica import kv_cache_config, vllm_config

    digests = []
    for name in custom_kv_dtypes:
        cfg = vllm_config(model, "redis://127.0.0.1:6379/0")
        cfg.cache_config.cache_dtype = name
        kv = kv_cache_config(8)
        group = kv.kv_cache_groups[0]
        object.__setattr__(group, "kv_cache_spec", dataclasses.replace(
            group.kv_cache_spec, dtype=torch.uint8, kv_quant_mode=KVQuantMode.CUSTOM))
        digests.append(store_layout(cfg, kv, None, 0).digest())
    assert digests[0] != digests[1]


def test_a_draft_models_weights_are_named(model):
    # vLLM puts an EAGLE draft's KV layers in the target's group when their specs match
    # (the connector takes one group): the blocks hold the draft's KV too.
    import shutil

    from vllm.config import SpeculativeConfig

    from prefixkv.integrations.vllm.connector_config import store_layout

    from .replica import kv_cache_config, model_dir, vllm_config

    drafts = [model_dir(), model_dir()]
    try:
        digests = []
        for draft in [None, *drafts, model]:
            cfg = vllm_config(model, "redis://127.0.0.1:6379/0")
            if draft is not None:
                cfg.speculative_config = SpeculativeConfig(
                    method="eagle" if draft != model else "ngram", model=draft,
                    num_speculative_tokens=2, prompt_lookup_max=3,
                    target_model_config=cfg.model_config,
                    target_parallel_config=cfg.parallel_config)
            digests.append(store_layout(cfg, kv_cache_config(8), None, 0).digest())
    finally:
        for path in drafts:
            shutil.rmtree(path, ignore_errors=True)
    assert len(set(digests[:3])) == 3  # no draft, draft a, draft b
    assert digests[3] == digests[0]  # (n-gram: no draft weights, the keys stay)
