"""The router's hash check (router/hash_check.py) on vLLM 0.33.0's own event structs and
extra keys (``generate_block_hash_extra_keys``, ``to_event_extra_keys``) and through its
real ``ZmqEventPublisher``: a replica that hashes as the router does is never flagged,
salted and multimodal requests included; one that hashes otherwise is counted."""

import msgspec
import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, block_hashes
from prefixkv.fleet.wire import wire_hash
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber
from waiting import LIVE, await_subscribed, poll_until

from .test_vllm_interop import BS, free_ports, publish, vllm_event_extra_keys, vllm_publisher, vllm_request
from .vllm_kv_events import kv_events

PROMPT = list(range(1, 26))  # 6 full blocks
REQUESTS = [  # (salt, multimodal inputs as (identifier, offset, length)), vLLM's request
    (None, []), ("tenant-x", []), ("tenant-x", [("img-1", 5, 6)]), (None, [("img-1", 9, 6)]),
]


@pytest.fixture(scope="module")
def kv():
    return kv_events()


def vllm_batch(kv, hash_mode, seed, hash_format="int"):
    """One vLLM ``KVEventBatch`` of the four requests' stores (hashed by prefixkv with
    ``hash_mode`` and ``seed``, extra keys by vLLM's own functions), msgspec's bytes."""
    events = []
    for salt, mm in REQUESTS:
        extra = ExtraKeys(cache_salt=salt, mm=tuple(MultiModalInput(*m) for m in mm))
        digests = block_hashes(PROMPT, BS, hash_mode=hash_mode, seed=seed, extra=extra)
        events.append(kv.BlockStored(
            block_hashes=[wire_hash(d, hash_format) for d in digests], parent_block_hash=None,
            token_ids=PROMPT[:len(digests) * BS], block_size=BS, lora_id=None, medium="GPU",
            lora_name=None, extra_keys=vllm_event_extra_keys(
                vllm_request(len(PROMPT), None, salt, mm), len(digests))))
    return msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.0, events=events))


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_vllm_structs_hashed_as_the_router_are_not_flagged(kv, hash_format):
    router = Router(["v"], block_size=BS, hash_format=hash_format)
    router.check_hashes("v", vllm_batch(kv, "sha256", None, hash_format))
    # the plain request's 6 blocks, the one whose image starts in block 2 its first 2;
    # the salted ones none (the salt enters every block's hash, sent on the first only)
    assert router.hash_mismatches == {"v": 0} and router.hash_checked == {"v": 8}


@pytest.mark.parametrize("hash_mode, seed", [("xxhash", 5), ("sha256", 1)])
def test_vllm_structs_hashed_otherwise_are_counted(kv, hash_mode, seed):
    router = Router(["v"], block_size=BS)
    router.check_hashes("v", vllm_batch(kv, hash_mode, seed))
    assert router.hash_mismatches == {"v": 2} and router.hash_checked == {"v": 8}


@pytest.mark.parametrize("hash_mode, mismatches", [("sha256", 0), ("xxhash", 1)])
def test_the_router_on_vllms_publisher(kv, hash_mode, mismatches):
    ports = free_ports(2)
    pub = vllm_publisher(kv, ports)
    mgr = KVCacheManager(256, BS, hash_mode=hash_mode, enable_events=True)
    router = Router(["v"], block_size=BS)
    sub = Subscriber(router, {"v": (f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")},
                     replay_timeout=LIVE)
    try:
        await_subscribed(sub)
        publish(kv, pub, mgr, "a", PROMPT)
        assert poll_until(sub, lambda: sub.health()["replicas"]["v"]["hash_checked"] == 6)
        assert sub.health()["replicas"]["v"]["hash_mismatches"] == mismatches
        assert router.cached_tokens(PROMPT)["v"] == (24 if hash_mode == "sha256" else 0)
    finally:
        sub.close()
        pub.shutdown()
