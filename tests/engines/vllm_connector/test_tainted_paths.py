"""A tainted request's KV (groups/taint.py: recomputed over what a sliding window released,
or past a Mamba state it no longer holds) must never leave it: not through prefixkv's vLLM
connector (a save to the store), not through a host tier or the store of a manager.

Taint exists only in ``HybridKVCacheManager`` (it follows ``reads_lost``), which has no
host tier and no store; prefixkv's vLLM plug-in builds no host tier either
(``layout.build_core``); and the connector saves only for models whose KV cache is one
full-attention group, which the plug-in runs on ``prefixkv.KVCacheManager``, where no
recompute reads released KV. These tests pin each of those facts: one that stops holding
opens a path for tainted KV, and must come with its own check."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from prefixkv import KVCacheManager
from prefixkv.errors import ConfigError
from prefixkv.groups import HybridKVCacheManager
from prefixkv.integrations.vllm.connector_config import store_layout
from prefixkv.integrations.vllm.layout import build_core, read_layout

BS = 16
HEADS = {"num_kv_heads": 2, "head_size": 8, "dtype": torch.float16}


def _config(*specs):
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config():
    return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                           model_config=SimpleNamespace(model="m", revision=None))


WINDOW = SlidingWindowSpec(BS, sliding_window=32, **HEADS)
CHUNKED = ChunkedLocalAttentionSpec(BS, attention_chunk_size=32, **HEADS)
FULL = FullAttentionSpec(BS, **HEADS)
LAYOUTS = {
    "window": (WINDOW,),
    "chunked local": (CHUNKED,),
    "full + window": (FULL, WINDOW),
    "full + chunked local": (FULL, CHUNKED),
    "two windows": (WINDOW, SlidingWindowSpec(BS, sliding_window=8, **HEADS)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_connector_refuses_every_layout_that_runs_on_the_hybrid_manager(name):
    config = _config(*LAYOUTS[name])
    layout = read_layout(config, scheduler_block_size=BS, hash_block_size=BS)
    assert layout.hybrid  # (the plug-in runs it on HybridKVCacheManager, where taint lives)
    with pytest.raises(ConfigError):
        store_layout(_vllm_config(), config, None, 0)


def test_what_the_connector_serves_runs_on_the_one_group_manager():
    config = _config(FULL)
    store_layout(_vllm_config(), config, None, 0)  # (accepted)
    layout = read_layout(config, scheduler_block_size=BS, hash_block_size=BS)
    core, _ = build_core(layout, enable_caching=True, enable_events=False)
    assert not layout.hybrid and type(core) is KVCacheManager


def test_no_manager_that_can_taint_takes_a_host_tier_or_a_store():
    params = inspect.signature(HybridKVCacheManager).parameters
    assert not {"host_blocks", "store"} & set(params), (
        "the hybrid manager took a host tier or a store: its tainted requests' blocks "
        "(groups/taint.py) must then be kept out of both, with a test")
