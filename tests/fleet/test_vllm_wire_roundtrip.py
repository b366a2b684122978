"""prefixkv's wire to vLLM 0.33's own consumer structs and back, under Hypothesis: any
stream of a manager's steps (prompts that share prefixes, salts, LoRA, images, a pool
small enough to evict, cache resets, both hash forms) encodes to payloads that vLLM's
``KVEventBatch`` decoder (msgspec, from the release wheel: vllm_kv_events.py) takes,
that vLLM's encoder writes back value for value, and that a router fed the re-encoded
bytes indexes exactly what the manager caches."""

import msgpack
import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Router, decode_batch

from .vllm_kv_events import kv_events

BS = 4
KV = kv_events()  # (module level: loaded once; it holds no state between examples)

extras = st.one_of(
    st.none(),
    st.builds(ExtraKeys, cache_salt=st.sampled_from(["t1", "tenant-é", "租户"])),
    st.builds(ExtraKeys, lora=st.just("ad"), lora_id=st.just(7)),
    st.builds(lambda s: ExtraKeys(mm=(MultiModalInput(f"img-{s}", 2, 5),)), st.integers(0, 2)),
)
steps = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 4), min_size=8, max_size=20), extras),
    st.tuples(st.just("reset"), st.none(), st.none())), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(steps, st.sampled_from(["int", "bytes"]), st.integers(0, 3))
def test_any_stream_goes_to_vllms_structs_and_back(ops, hash_format, dp_rank):
    mgr = KVCacheManager(12, BS, hash_mode="sha256", enable_events=True)
    router = Router(["r"], block_size=BS, hash_format=hash_format)
    decoder, encoder = msgspec.msgpack.Decoder(type=KV.KVEventBatch), msgspec.msgpack.Encoder()
    asked = []
    for i, (kind, prompt, extra) in enumerate(ops):
        if kind == "reset":
            mgr.reset_prefix_cache()
        elif mgr.add_request(str(i), prompt, extra=extra) is not None:
            mgr.free(str(i))
            asked.append((prompt, extra))
        payload = encode_batch(mgr.take_events(), block_size=BS, hash_format=hash_format,
                               ts=float(i), dp_rank=dp_rank)
        batch = decoder.decode(payload)  # vLLM's consumer takes it
        again = encoder.encode(batch)  # and writes back the same values (the bytes
        # differ in map headers only: msgspec writes BlockStored's with a map16 header)
        assert msgpack.unpackb(again) == msgpack.unpackb(payload)
        ts, events, rank = decode_batch(again)
        assert (ts, rank) == (float(i), dp_rank)
        router.apply("r", events)
    for prompt, extra in asked:  # (one token more: a manager leaves the last to compute)
        assert router.cached_tokens(prompt + [9], extra)["r"] == mgr.lookup(prompt + [9],
                                                                             extra=extra)
