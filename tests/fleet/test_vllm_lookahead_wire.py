"""A lookahead manager's events (``core.lookahead.LookaheadKVCacheManager``: vLLM 0.33's
lookahead hashing) on vLLM's wire, against vLLM 0.33.0's own code
(tests/fleet/vllm_kv_events.py): the batch decodes with vLLM's ``KVEventBatch`` and
re-encodes to the same values; each ``BlockStored`` carries ``lookahead_token_ids`` (per
block, the ``L`` tokens after it) and ``extra_keys`` over the block and those tokens,
equal to vLLM's ``generate_lookahead_block_hash_extra_keys``; its hashes are
``hashing.block_hashes(..., hash_lookahead_tokens=L)``'s, on the wire as any other.
"""

import msgpack
import msgspec

from prefixkv import ExtraKeys, MultiModalInput
from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.fleet.wire import encode_batch, wire_hash
from prefixkv.hashing import block_hashes

from .test_vllm_interop import plain, vllm_request
from .vllm_kv_events import kv_cache_utils, kv_events

BS, L = 4, 2


def vllm_lookahead_extra_keys(request, first, last):
    """vLLM's ``extra_keys`` of blocks ``first..last-1`` under lookahead hashing, as its
    ``BlockPool.cache_full_blocks`` builds them (one call a block, the mm index carried)."""
    utils = kv_cache_utils()
    keys, mm_idx = [], 0
    for i in range(first, last):
        k, mm_idx = utils.generate_lookahead_block_hash_extra_keys(
            request, i * BS, (i + 1) * BS, (i + 1) * BS + L, mm_idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


def test_lookahead_events_decode_with_vllms_structs_and_carry_its_fields():
    kv = kv_events()
    # an image over tokens 9..10: in block 1's lookahead window (its extra keys, as vLLM's)
    extra = ExtraKeys(lora="ad", cache_salt="s", mm=(MultiModalInput("img-1", 9, 2),), lora_id=3)
    m = LookaheadKVCacheManager(32, BS, hash_lookahead_tokens=L, hash_mode="sha256",
                                enable_events=True)
    tokens = list(range(1, 20))  # 19 known: 4 blocks have their lookahead tokens
    m.add_request("a", tokens, extra=extra, num_new_tokens=12)
    m.add_tokens("a", [30, 31])  # (sampled: block 3's lookahead is 17, 18 either way)
    payloads = [encode_batch(m.take_events(), block_size=BS)]
    m.extend("a", 4)  # block 3, a run whose parent is block 2
    payloads.append(encode_batch(m.take_events(), block_size=BS))
    decoder, encoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch), msgspec.msgpack.Encoder()
    events = []
    for payload in payloads:
        batch = decoder.decode(payload)
        assert msgpack.unpackb(encoder.encode(batch)) == msgpack.unpackb(payload)
        (ev,) = batch.events
        assert isinstance(ev, kv.BlockStored) and (ev.lora_name, ev.lora_id) == ("ad", 3)
        events.append(ev)
    first, second = events
    assert first.lookahead_token_ids == [[5, 6], [9, 10], [13, 14]]
    assert second.lookahead_token_ids == [[17, 18]]
    known = tokens + [30, 31]
    request = vllm_request(len(known), "ad", "s", [("img-1", 9, 2)])
    assert plain(first.extra_keys) == plain(vllm_lookahead_extra_keys(request, 0, 3))
    assert plain(second.extra_keys) == plain(vllm_lookahead_extra_keys(request, 3, 4))
    assert plain(first.extra_keys)[1] == ["ad", ["img-1", 5]]  # (past the block: vLLM's offset)
    hashes = [wire_hash(h) for h in block_hashes(known, BS, hash_mode="sha256", extra=extra,
                                                 hash_lookahead_tokens=L)]
    assert first.block_hashes + second.block_hashes == hashes[:4]
    assert (first.parent_block_hash, second.parent_block_hash) == (None, hashes[2])
