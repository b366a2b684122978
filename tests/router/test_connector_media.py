"""Events of a KV connector's tiers (vLLM 0.33: ``medium`` "CPU" or "STORAGE", set by
its offloading connectors; LMCache's own names and chunk hashes), encoded with vLLM's
own structs from the wheel (tests/fleet/vllm_kv_events.py).

The router scores what a replica can serve: a connector's blocks under the router's
hashes count in the replica's run on any medium (not on the GPU); a connector keyed by
its own hash is no sign that the replica's engine hashes otherwise, so the hash check
compares GPU runs only; and the offloading connector's placeholder (block size 0, no
token ids: a key it holds no metadata for) is decoded, not indexed and not counted as a
block size that differs. Before fleet-r19 a placeholder made its whole batch a
DecodeError (the replica's GPU events in it lost, the replica marked lossy) and an
LMCache-like tier raised ``hash_mismatches``."""

from __future__ import annotations

import msgspec
import pytest

from fleet.vllm_kv_events import kv_events
from prefixkv.router import Router, decode_batch

BS = 4
TOKENS = list(range(1, 13))  # 3 full blocks


@pytest.fixture(scope="module")
def kv():
    return kv_events()


def payload(kv, *events):
    return msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=list(events)))


def stored(kv, hashes, tokens, medium, **fields):
    return kv.BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                          token_ids=list(tokens), block_size=BS, lora_id=None,
                          medium=medium, lora_name=None, **fields)


def placeholder(kv, h, medium):
    """As ``OffloadingEventsTracker._placeholder_stored`` builds it (vLLM 0.33)."""
    return kv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
                          lora_id=None, block_size=0, medium=medium, lora_name=None,
                          group_idx=0, locality="LOCAL", ownership=None)


def feed(router, data):
    """What the subscriber does with a batch (a DecodeError would mark it lost)."""
    router.apply("a", decode_batch(data)[1])
    router.check_hashes("a", data)


def runs(router, tokens=TOKENS):
    return router.index.prefix_runs(router.prompt_hashes(tokens), ["a"]).get("a", (0, 0))


@pytest.mark.parametrize("medium", ["STORAGE", "CPU"])
def test_a_connector_tier_under_the_routers_hashes_is_scored_off_the_gpu(kv, medium):
    router = Router(["a"], block_size=BS)
    h = router.prompt_hashes(TOKENS)
    feed(router, payload(kv, stored(kv, h[:1], TOKENS[:4], "GPU"),
                         stored(kv, h, TOKENS, medium, locality="LOCAL")))
    assert runs(router) == (3, 1)  # (any medium, the GPU alone)
    assert router.cached_tokens(TOKENS)["a"] == 12
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 1}
    feed(router, payload(kv, kv.BlockRemoved(block_hashes=h[1:], medium=medium)))
    assert runs(router) == (1, 1)


@pytest.mark.parametrize("medium", ["STORAGE", "CPU"])
def test_the_offloading_connectors_placeholder_is_decoded_and_not_indexed(kv, medium, caplog):
    router = Router(["a"], block_size=BS)
    h = router.prompt_hashes(TOKENS)
    feed(router, payload(kv, placeholder(kv, h[0], medium), stored(kv, h, TOKENS, "GPU"),
                         placeholder(kv, 77, medium)))
    assert runs(router) == (3, 3)  # (the GPU run in the same batch is applied)
    assert router.lossy == {"a": 0} and router.block_size_mismatches == {"a": 0}
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 3}
    assert router.index.num_blocks("a") == 3  # (the placeholders: not indexed)
    assert "block_size" not in caplog.text
    feed(router, payload(kv, placeholder(kv, 5, medium)))  # (alone in its batch too)
    assert router.index.num_blocks("a") == 3


def test_a_connector_keyed_by_its_own_hash_is_not_a_hash_mismatch(kv):
    """LMCache's connector forwards its own events (its chunk hashes, its medium names)."""
    router = Router(["a"], block_size=BS)
    h = router.prompt_hashes(TOKENS)
    for medium in ("cpu", "STORAGE", "LocalDiskBackend"):
        feed(router, payload(kv, stored(kv, [11, 22, 33], TOKENS, medium)))
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 0}
    assert runs(router) == (0, 0)
    feed(router, payload(kv, stored(kv, [11, 22, 33], TOKENS, "GPU")))  # (the engine's own)
    assert router.hash_mismatches == {"a": 1} and router.hash_checked == {"a": 3}
    feed(router, payload(kv, stored(kv, h, TOKENS, None)))  # (nil: the GPU, before media)
    assert router.hash_checked == {"a": 6} and router.hash_mismatches == {"a": 1}
