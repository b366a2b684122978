"""Our payloads against msgspec structs declared as docs/events.md describes vLLM 0.33's
(msgspec is what vLLM and its example subscriber decode with): they decode, and msgspec
encoding the same values gives the same bytes (field order, nil versus omitted, widths)."""

from typing import Any

import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput
from prefixkv.fleet.wire import encode_batch

msgspec = pytest.importorskip("msgspec")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_vllm_structs_decode_and_reencode_byte_for_byte(hash_format):
    mgr = KVCacheManager(8, 4, hash_mode="sha256", enable_events=True)
    extra = ExtraKeys(lora="ad", mm=(MultiModalInput("img", 1, 3),))
    mgr.add_request("a", list(range(1, 11)), extra=extra)
    mgr.free("a")
    mgr.add_request("b", list(range(20, 49)))           # evicts a's blocks
    mgr.free("b")
    assert mgr.reset_prefix_cache()
    events = mgr.take_events()
    payload = encode_batch(events, block_size=4, hash_format=hash_format, ts=3.25, dp_rank=1)

    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    kinds = [type(e).__name__ for e in batch.events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    first = batch.events[0]
    assert first.lora_name == "ad" and first.lora_id is None and first.medium == "GPU"
    assert first.extra_keys == [("ad", ["img", 1]), ("ad",)] and first.group_idx == 0
    assert batch.data_parallel_rank == 1 and batch.ts == 3.25
    assert msgspec.msgpack.encode(batch) == payload


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_vllm_structs_read_a_hybrid_managers_groups_byte_for_byte(hash_format):
    from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, sliding_window

    mgr = HybridKVCacheManager([full_attention(), sliding_window(6), chunked_local(8)], 16, 4,
                               hash_mode="sha256", enable_events=True)
    mgr.add_request("a", list(range(1, 11)))
    mgr.free("a")
    mgr.add_request("b", list(range(20, 33)))  # evicts some of a's blocks
    payload = encode_batch(mgr.take_events(), block_size=4, hash_format=hash_format, ts=1.0)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    stored = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
              for e in batch.events if isinstance(e, BlockStored)]
    assert stored[:3] == [(0, "full_attention", None), (1, "sliding_window", 6),
                          (2, "chunked_local_attention", None)]
    assert {e.group_idx for e in batch.events if isinstance(e, BlockRemoved)} == {0, 1, 2}
    assert msgspec.msgpack.encode(batch) == payload
