"""Replicas whose blocks are keyed with lookahead tokens (``LookaheadKVCacheManager``,
vLLM's ``num_hash_lookahead_tokens``) announce hashes that cover the L tokens after each
block. Before ``Router(hash_lookahead_tokens=L)`` a router hashed prompts without them:
such a replica was never routed to for its cache (0 cached tokens whatever it held), and
the hash check called it "another hash_mode, seed or hash_format". Now the router hashes
as they do, rehashes their runs with the ``lookahead_token_ids`` they send, and counts a
replica with another L than its own (with a warning that names lookahead)."""

from __future__ import annotations

import itertools
import logging

import msgpack
import pytest

from prefixkv import ExtraKeys, KVCacheManager
from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import Router, RouterError, decode_batch
from prefixkv.router.subscriber import Subscriber
from waiting import await_subscribed, poll_until

BS = 4
PROMPT = list(range(1, 30))  # 29 tokens: 7 full blocks
IDS = itertools.count()


def replica(lookahead, **kw):
    kw.setdefault("hash_mode", "sha256")
    if lookahead == 0:
        return KVCacheManager(256, BS, enable_events=True, **kw)
    return LookaheadKVCacheManager(256, BS, hash_lookahead_tokens=lookahead,
                                   enable_events=True, **kw)


def admit(mgr, prompt=PROMPT, extra=None):
    """Schedules what the replica may key: its prompt up to the lookahead tokens."""
    la = getattr(mgr, "hash_lookahead_tokens", 0)
    mgr.add_request(f"q{next(IDS)}", prompt, extra=extra, num_new_tokens=len(prompt) - la)


def feed(router, mgr, name="a"):
    payload = encode_batch(mgr.take_events(), block_size=BS)
    router.apply(name, decode_batch(payload)[1])
    router.check_hashes(name, payload)


@pytest.mark.parametrize("extra", [None, ExtraKeys(cache_salt="tenant-x"),
                                   ExtraKeys(lora="ad", lora_path="/w")], ids=["plain", "salt", "lora"])
@pytest.mark.parametrize("lookahead", [1, 2, 5])
def test_a_router_with_the_replicas_lookahead_finds_their_blocks(lookahead, extra):
    mgr = replica(lookahead)
    router = Router(["a", "b"], block_size=BS, hash_lookahead_tokens=lookahead)
    router.prompt_hashes(PROMPT, extra)  # (a LoRA's path becomes known, as a prompt gives it)
    admit(mgr, extra=extra)
    feed(router, mgr)
    full = (len(PROMPT) - lookahead) // BS  # blocks whose lookahead tokens the prompt holds
    assert router.cached_tokens(PROMPT, extra) == {"a": full * BS, "b": 0}
    assert router.hash_mismatches == {"a": 0, "b": 0}
    assert router.hash_checked["a"] == full
    assert router.route(PROMPT, extra).replica == "a"
    # a prompt that differs at token 12 (block 3's first) keeps the blocks whose
    # lookahead ends by then: block 2's covers token 12 whatever L, block 1's once L > 4
    other = PROMPT[:3 * BS] + [999] + PROMPT[3 * BS + 1:]
    assert router.cached_tokens(other, extra)["a"] == (3 * BS - lookahead) // BS * BS


@pytest.mark.parametrize("replica_la, router_la", [(2, 0), (0, 2), (2, 1), (1, 3)])
def test_another_lookahead_is_counted_and_logged_as_such(replica_la, router_la, caplog):
    mgr = replica(replica_la)
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=router_la)
    admit(mgr)
    with caplog.at_level(logging.WARNING, logger="prefixkv.router"):
        feed(router, mgr)
        admit(mgr, [7] * 24)
        feed(router, mgr)
    assert router.hash_mismatches["a"] == 2 and router.hash_checked["a"] > 0
    assert router.cached_tokens(PROMPT)["a"] == 0
    warned = [r.getMessage() for r in caplog.records if "lookahead" in r.getMessage()]
    assert len(warned) == 1
    assert f"hashed with {replica_la} lookahead tokens" in warned[0]
    assert f"hashes prompts with {router_la}" in warned[0]


def test_a_wrong_hash_under_the_same_lookahead_is_still_found():
    mgr = replica(2, seed=9)  # another seed: its lookahead is the router's, its hashes not
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    admit(mgr)
    feed(router, mgr)
    assert router.hash_mismatches["a"] == 1 and router.hash_checked["a"] == 6


def test_vllm_array_form_with_lookahead_token_ids_is_read():
    """vLLM 0.33's ``BlockStored`` sent in array form puts ``lookahead_token_ids`` last,
    after ``locality``, ``ownership`` and ``session_id``: the check reads it there."""
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    toks = list(range(1, 13))
    h = router.prompt_hashes(toks + [13, 14])  # 3 blocks, each with its 2 tokens after
    after = [[5, 6], [9, 10], [13, 14]]

    def batch(hashes, lookahead_ids):
        ev = ["BlockStored", hashes, None, toks, BS, None, "GPU", None, [None] * 3,
              0, "full_attention", None, None, None, None, lookahead_ids]
        return msgpack.packb([1.0, [ev], 0])

    router.check_hashes("a", batch(h, after))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)
    router.check_hashes("a", batch(h, [[5, 6], [9, 11], [13, 14]]))  # block 1's lookahead
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (6, 1)


@pytest.mark.parametrize("entries", [
    [[5, 6], [9, 10]],            # fewer entries than blocks
    [[5, 6], "x", [13, 14]],      # an entry that is not a list
    [[5, 6], list(range(65)), [13, 14]],  # an entry longer than the check reads
])
def test_lookahead_entries_that_cannot_be_read_are_not_compared(entries):
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    toks = list(range(1, 13))
    h = router.prompt_hashes(toks + [13, 14])
    ev = {"type": "BlockStored", "block_hashes": h, "parent_block_hash": None,
          "token_ids": toks, "block_size": BS, "lookahead_token_ids": entries}
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (0, 0)


def test_empty_lookahead_entries_are_no_lookahead():
    """A run that sends an empty list of tokens after each block hashes as one without
    lookahead keys (0 tokens): not flagged behind a router without them."""
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    ev = {"type": "BlockStored", "block_hashes": router.prompt_hashes(toks),
          "parent_block_hash": None, "token_ids": toks, "block_size": BS,
          "lookahead_token_ids": [[], [], []]}
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_a_bad_lookahead_option_is_refused(bad):
    with pytest.raises(RouterError, match="hash_lookahead_tokens"):
        Router(["a"], block_size=BS, hash_lookahead_tokens=bad)


def test_a_subscribed_router_follows_a_lookahead_replica():
    pub = EventPublisher(block_size=BS, heartbeat=None)
    mgr = replica(2)
    router = Router(["r"], block_size=BS, hash_lookahead_tokens=2)
    sub = Subscriber(router, {"r": (pub.endpoint, None)})
    try:
        await_subscribed(sub)
        admit(mgr)
        pub.publish(mgr.take_events())
        assert poll_until(sub, lambda: router.index.num_blocks("r") == 6)
        with sub.lock:
            assert router.cached_tokens(PROMPT)["r"] == 24
        state = sub.health()["replicas"]["r"]
        assert (state["hash_mismatches"], state["hash_checked"]) == (0, 6)
    finally:
        sub.close()
        pub.close()
