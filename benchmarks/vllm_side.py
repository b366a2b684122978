"""vLLM 0.33's side of the peer benchmarks with events (``bench_vllm_events.py``,
``events_account.py``): its ``KVCacheManager`` as its scheduler builds it for one
full-attention group, and its ``Request`` with the block hasher. A helper module, not a
benchmark: importing it imports vLLM (and torch: vLLM's KV spec names a dtype), so the
scripts that import it put the prefixkv they measure on the path first.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import xxhash
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BS = 16
init_none_hash(xxhash)
HASHER = get_request_block_hasher(BS, xxhash)
SAMPLING = SamplingParams(max_tokens=16)


def vllm_manager(events: bool, pool: int, cls: type[VllmManager] | None = None) -> VllmManager:
    """vLLM's manager of ``pool`` blocks of ``BS`` tokens, prefix caching on, KV events
    on or off (``cls``: the class, from another import of its module)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=pool, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    return (cls or VllmManager)(cfg, max_model_len=40_000, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True, enable_kv_cache_events=events)


def vllm_request(rid: str, tokens: list[int]) -> Request:
    """The ``Request`` vLLM's input thread builds (its blocks hashed here, xxhash, as
    ``--prefix-caching-hash-algo xxhash``)."""
    return Request(rid, tokens, SAMPLING, None, block_hasher=HASHER)


def vllm_step(m: VllmManager, req: Request, pub: Any) -> tuple[int, int]:
    """What vLLM's scheduler does for a new request with KV events on:
    ``get_computed_blocks``, ``allocate_slots`` for the rest of the prompt, and the
    step's ``take_events()`` published as one ``KVEventBatch`` to ``pub`` (its
    ``ZmqEventPublisher``; nothing when no event). Returns the hit in tokens and the
    events taken."""
    blocks, hit, *_ = m.get_computed_blocks(req)
    m.allocate_slots(req, req.num_tokens - hit, num_new_computed_tokens=hit,
                     new_computed_blocks=blocks)
    events = m.take_events()
    if events:
        pub.publish(KVEventBatch(ts=time.time(), events=events))
    return hit, len(events)
