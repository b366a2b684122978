"""The router's hash check (router/hash_check.py) on vLLM 0.33.0's own event structs and
extra keys (``generate_block_hash_extra_keys``, ``to_event_extra_keys``) and through its
real ``ZmqEventPublisher``: a replica that hashes as the router does is never flagged,
salted, LoRA and multimodal requests included; one that hashes otherwise is counted
(fleet-r19: salted and LoRA runs compared, with the salt and name as vLLM sends them)."""

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
REQUESTS = [  # (LoRA, salt, multimodal inputs as (identifier, offset, length))
    (None, None, []), (None, "tenant-x", []), (None, "tenant-x", [("img-1", 5, 6)]),
    (None, None, [("img-1", 9, 6)]), ("ad", None, []), ("ad", "tenant-x", []),
]
LORA = ExtraKeys(lora="ad", lora_path="/x")  # (vllm_request's path: what prompts give)


@pytest.fixture(scope="module")
def kv():
    return kv_events()


def vllm_batch(kv, hash_mode, seed, hash_format="int"):
    """One vLLM ``KVEventBatch`` of the requests' stores (hashed by prefixkv with
    ``hash_mode`` and ``seed``, extra keys by vLLM's own functions), msgspec's bytes."""
    events = []
    for lora, salt, mm in REQUESTS:
        extra = ExtraKeys(lora=lora, cache_salt=salt, mm=tuple(MultiModalInput(*m) for m in mm),
                          lora_path=None if lora is None else "/x")
        digests = block_hashes(PROMPT, BS, hash_mode=hash_mode, seed=seed, extra=extra)
        events.append(kv.BlockStored(
            block_hashes=[wire_hash(d, hash_format) for d in digests], parent_block_hash=None,
            token_ids=PROMPT[:len(digests) * BS], block_size=BS, lora_id=None, medium="GPU",
            lora_name=lora, extra_keys=vllm_event_extra_keys(
                vllm_request(len(PROMPT), lora, salt, mm), len(digests))))
    return msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.0, events=events))


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_vllm_structs_hashed_as_the_router_are_not_flagged(kv, hash_format):
    router = Router(["v"], block_size=BS, hash_format=hash_format)
    router.prompt_hashes(PROMPT, LORA)  # (the LoRA's path, which the wire leaves out)
    router.check_hashes("v", vllm_batch(kv, "sha256", None, hash_format))
    # 6 blocks of each request but those with images: before the first image (2 blocks
    # for the one at token 9, 1 for the salted one at token 5)
    assert router.hash_mismatches == {"v": 0} and router.hash_checked == {"v": 27}


@pytest.mark.parametrize("hash_mode, seed", [("xxhash", 5), ("sha256", 1)])
def test_vllm_structs_hashed_otherwise_are_counted(kv, hash_mode, seed):
    router = Router(["v"], block_size=BS)
    router.prompt_hashes(PROMPT, LORA)
    router.check_hashes("v", vllm_batch(kv, hash_mode, seed))
    assert router.hash_mismatches == {"v": 6} and router.hash_checked == {"v": 27}


def test_a_lora_no_prompt_gave_is_not_compared(kv):
    router = Router(["v"], block_size=BS)  # ("ad"'s path unknown: its runs are skipped)
    router.check_hashes("v", vllm_batch(kv, "xxhash", 5))
    assert router.hash_mismatches == {"v": 4} and router.hash_checked == {"v": 15}


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
