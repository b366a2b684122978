"""A replica that hashes otherwise than the router (another mode, seed or hash format)
never hits and, before hash_check.py, nothing said so (issue 26.3: a default-xxhash
replica behind a sha256 router). The router rehashes a sample of the stored runs it
applies (``Router.check_hashes``) and counts those that differ in ``hash_mismatches``;
runs whose hashes take what the wire does not carry whole (multimodal inputs, a LoRA
whose path no prompt gave) are not compared, so they are never flagged falsely; a salt
and a LoRA are read from the run's extra keys (fleet-r19: before, a replica whose every
block was salted or of a LoRA was never checked)."""

from __future__ import annotations

import itertools
import logging
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput
from prefixkv.fleet.metrics import HealthMetrics
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.wire import encode_batch
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.router import Router, RouterError, decode_batch
from prefixkv.router.hash_check import SAMPLE_BATCHES, SAMPLE_BLOCKS, sample_runs
from prefixkv.router.subscriber import Subscriber
from waiting import await_subscribed, poll_until

BS = 4
PROMPT = list(range(1, 30))  # 7 full blocks
SALTED = ExtraKeys(cache_salt="tenant-x")
MM = ExtraKeys(mm=(MultiModalInput("img-1", 9, 6),))  # blocks 2 to 3
LORA = ExtraKeys(lora="ad", lora_id=3, lora_path="/w")
LORA_SALTED = ExtraKeys(lora="ad", cache_salt="tenant-x", lora_path="/w")
MM_FIRST = ExtraKeys(mm=(MultiModalInput("img-0", 0, 6),))  # from block 0: not compared
IDS = itertools.count()  # (request ids: new ones for every call)


def payload_of(mgr, hash_format="int"):
    return encode_batch(mgr.take_events(), block_size=BS, hash_format=hash_format)


def feed(router, payload, replica="a"):
    """What the subscriber does with a batch it applies."""
    router.apply(replica, decode_batch(payload)[1])
    router.check_hashes(replica, payload)


def stores(mgr, *requests):
    for prompt, extra in requests:
        mgr.add_request(f"q{next(IDS)}", prompt, extra=extra)


@pytest.mark.parametrize("extra", [None, SALTED, MM, LORA])
@pytest.mark.parametrize("hash_mode, seed, hash_format", [
    ("sha256", None, "int"), ("sha256", None, "bytes"), ("sha256", 7, "int"),
    ("xxhash", 11, "int"), ("xxhash", 11, "bytes")])
def test_a_replica_hashing_as_the_router_is_not_flagged(hash_mode, seed, hash_format, extra):
    mgr = KVCacheManager(256, BS, hash_mode=hash_mode, seed=seed, enable_events=True)
    router = Router(["a"], block_size=BS, hash_mode=hash_mode, seed=seed,
                    hash_format=hash_format)
    stores(mgr, ([7, 7, 7, 7] * 3, None), (PROMPT, extra), ([9] * 12 + PROMPT, extra))
    feed(router, payload_of(mgr, hash_format))
    assert router.hash_mismatches == {"a": 0}
    assert router.hash_checked["a"] >= 3  # (the plain request's, at least: it compared)
    assert router.cached_tokens(PROMPT, extra)["a"] == 28  # (it does hit)


@pytest.mark.parametrize("extra", [None, SALTED, MM])
@pytest.mark.parametrize("replica, router_kw", [
    (dict(hash_mode="xxhash"), {}),                              # the case
    (dict(hash_mode="sha256", seed=1), {}),                      # another seed
    (dict(hash_mode="xxhash", seed=11), dict(hash_mode="xxhash", seed=12)),
    (dict(hash_mode="sha256"), dict(hash_mode="sha256", hash_format="bytes")),  # format
])
def test_a_replica_hashing_otherwise_is_counted_and_logged_once(replica, router_kw, extra,
                                                                caplog):
    mgr = KVCacheManager(256, BS, enable_events=True, **replica)
    router = Router(["a", "b"], block_size=BS, **router_kw)
    caplog.set_level(logging.WARNING, "prefixkv.router.router")
    stores(mgr, (PROMPT, extra))
    feed(router, payload_of(mgr))
    assert router.hash_mismatches == {"a": 1, "b": 0}  # (an image from block 2 leaves
    # blocks 0 and 1 compared; the salt is read from block 0's extra keys)
    stores(mgr, ([6] * 8, None), ([8] * 8, None))
    feed(router, payload_of(mgr))
    assert router.hash_mismatches["a"] == 3
    assert sum("other than the router computes" in r.message for r in caplog.records) == 1


def test_hybrid_groups_are_compared_in_the_scored_group_only():
    mgr = HybridKVCacheManager([full_attention(), sliding_window(8)], 64, BS,
                               hash_mode="sha256", enable_events=True)
    router = Router(["a"], block_size=BS)
    mgr.add_request("q", PROMPT)
    feed(router, payload_of(mgr))
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 7}


def test_the_sample_is_bounded_and_taken_again_after_forget():
    mgr = KVCacheManager(1024, BS, hash_mode="xxhash", enable_events=True)
    router = Router(["a"], block_size=BS)
    for i in range(SAMPLE_BLOCKS):  # one block a batch: the blocks bound it
        stores(mgr, ([1000 + i] * BS, None))
        feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == router.hash_mismatches["a"] == SAMPLE_BLOCKS
    stores(mgr, ([5] * BS, None))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == SAMPLE_BLOCKS  # spent: not read
    router.forget("a")  # (a restart)
    stores(mgr, ([6] * BS, None))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == SAMPLE_BLOCKS + 1
    router.forget("a")
    for i in range(SAMPLE_BATCHES):  # batches of nothing to compare bound it too
        stores(mgr, ([2000 + i] * 8, MM_FIRST))
        feed(router, payload_of(mgr))
    stores(mgr, ([7] * BS, None))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == SAMPLE_BLOCKS + 1


def runs_payload(*events):
    return msgpack.packb([1.0, list(events), 0])


def stored(hashes, tokens, **fields):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, **fields}


def test_runs_that_cannot_be_rehashed_are_not_compared():
    router = Router(["a"], block_size=BS)
    h = router.prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8])
    cases = [
        stored([123, 456], []),                              # a snapshot's run: no tokens
        stored([123], [1, 2, 3, 4], parent_block_hash=99),    # not a chain's start
        stored([123], [1, 2, 3, 4], extra_keys=[[["img", 0], "salt"]]),  # an image on it
        stored([123], [1, 2, 3, 4], lora_name="ad", extra_keys=[["ad"]]),  # no path known
        stored([123], [1, 2, 3, 4], lora_name="ad"),          # a LoRA without its keys
        stored([123], [1, 2, 3, 4], lora_id=3),               # a LoRA's id, no name
        stored([123], [1, 2, 3, 4], extra_keys=[["s", "t"]]),  # not vLLM's form
        stored([123], [1, 2, 3, 4], extra_keys=[["s", "t", "u", "v", "w"]]),
        stored([123], [1, 2, 3, 4, 5]),                        # tokens not a block's worth
        stored([123], [1, 2, 3, 4], kv_cache_spec_kind="sliding_window"),
        {**stored([123], [1, 2, 3, 4]), "block_size": 8},      # block_size_mismatches
        stored([123], [1, 2, 3, -4]),                          # not token ids
        ["BlockStored", h, None, [1, 2, 3, 4, 5, 6, 7, 8], BS],  # (an array event: matches)
    ]
    for ev in cases:
        router.check_hashes("a", runs_payload(ev))
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 2}
    router.check_hashes("a", runs_payload(stored([h[0], 5], [1, 2, 3, 4, 5, 6, 7, 8],
                                                 extra_keys=[None, ["img", 0]])))
    assert router.hash_mismatches == {"a": 0} and router.hash_checked == {"a": 3}
    router.check_hashes("a", runs_payload(stored([h[0], 5], [1, 2, 3, 4, 5, 6, 7, 8])))
    assert router.hash_mismatches == {"a": 1}
    for bad in (b"", b"\xc1", runs_payload(5), msgpack.packb([1.0, [[]] * 100, 0])):
        router.check_hashes("a", bad)  # (nothing to compare: never raises)
    with pytest.raises(RouterError):
        router.check_hashes("zz", runs_payload())
    with pytest.raises(RouterError):
        router.check_hashes("a", "not bytes")  # type: ignore[arg-type]


def test_reading_the_sample_builds_only_what_it_compares():
    """A batch of 64 KiB of empty maps as events: the sample's reader skips them unbuilt
    (``unpackb`` would build ~70x the payload)."""
    payload = msgpack.packb([1.0, [{}] * (1 << 16), 0])
    big = msgpack.packb([1.0, [stored([1] * 5000, list(range(4 * 5000)))], 0])
    for data in (payload, big):
        tracemalloc.start()
        try:
            sample_runs(data, BS, SAMPLE_BLOCKS)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * len(data) + 20_000


def test_the_subscriber_counts_them_in_health_and_metrics():
    pub = EventPublisher(block_size=BS, heartbeat=None)
    mgr = KVCacheManager(256, BS, hash_mode="xxhash", enable_events=True)  # router: sha256
    router = Router(["r"], block_size=BS)
    sub = Subscriber(router, {"r": (pub.endpoint, None)})
    try:
        await_subscribed(sub)
        mgr.add_request("q", PROMPT)
        pub.publish(mgr.take_events())
        assert poll_until(sub, lambda: router.index.num_blocks("r") == 7)
        state = sub.health()["replicas"]["r"]
        assert (state["hash_mismatches"], state["hash_checked"]) == (1, 7)
        metrics = HealthMetrics()
        metrics.observe_subscriber(sub.health())
        assert b'prefixkv:router_hash_mismatches_total{replica="r"} 1.0' in metrics.exposition()
    finally:
        sub.close()
        pub.close()


SALTED_ONLY = [SALTED, LORA, LORA_SALTED, ExtraKeys(lora="ad")]  # (a path or none)


def learned(router, extra):
    """The router hashes a prompt with ``extra`` (a LoRA's path becomes known)."""
    router.prompt_hashes(PROMPT, extra)
    return router


@pytest.mark.parametrize("extra", SALTED_ONLY, ids=["salt", "lora", "lora+salt", "lora-bare"])
@pytest.mark.parametrize("replica, wrong", [
    (dict(hash_mode="sha256"), False), (dict(hash_mode="xxhash"), True),
    (dict(hash_mode="sha256", seed=1), True)])
def test_a_replica_whose_every_block_is_salted_or_of_a_lora_is_checked(replica, wrong, extra):
    mgr = KVCacheManager(256, BS, enable_events=True, **replica)
    router = learned(Router(["a"], block_size=BS), extra)
    stores(mgr, (PROMPT, extra), ([9] * 12 + PROMPT, extra), ([3] * 8, extra))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == 7 + 10 + 2  # (every block of the three chains)
    assert router.hash_mismatches["a"] == (3 if wrong else 0)
    if not wrong:
        assert router.cached_tokens(PROMPT, extra)["a"] == 28


def test_a_lora_is_compared_with_the_path_prompts_give_it():
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    router = Router(["a"], block_size=BS)
    stores(mgr, (PROMPT, LORA))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == 0  # (no prompt named "ad": its path is unknown)
    learned(router, ExtraKeys(lora="ad", lora_path="/other"))  # (not the replica's path)
    stores(mgr, ([3] * 8, LORA))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == 2 and router.hash_mismatches["a"] == 1
    learned(router, LORA)  # (the replica's path given too: its runs match)
    stores(mgr, ([4] * 8, LORA))
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == 4 and router.hash_mismatches["a"] == 1


def test_replicas_loading_one_lora_name_from_different_paths_each_match_theirs():
    """Replica a loads "ad" from /w, b from /v; the router's prompts named both: neither
    is flagged (before, the path given last was the only one compared: a flagged). The
    last ``MAX_PATHS`` paths of a name are kept: four more push /w out, and a is
    flagged then."""
    from prefixkv.router.hash_check import MAX_PATHS

    other = ExtraKeys(lora="ad", lora_id=3, lora_path="/v")
    mgrs = {r: KVCacheManager(256, BS, hash_mode="sha256", enable_events=True) for r in "ab"}
    router = learned(learned(Router(["a", "b"], block_size=BS), LORA), other)
    stores(mgrs["a"], (PROMPT, LORA))
    stores(mgrs["b"], (PROMPT, other))
    for r in "ab":
        feed(router, payload_of(mgrs[r]), replica=r)
    assert router.hash_checked == {"a": 7, "b": 7}
    assert router.hash_mismatches == {"a": 0, "b": 0}
    for i in range(MAX_PATHS):
        learned(router, ExtraKeys(lora="ad", lora_path=f"/p{i}"))
    stores(mgrs["a"], ([3] * 8, LORA))
    feed(router, payload_of(mgrs["a"]), replica="a")
    assert router.hash_checked["a"] == 9 and router.hash_mismatches["a"] == 1


def test_the_learned_lora_paths_are_bounded():
    from prefixkv.router.hash_check import MAX_LORAS
    router = Router(["a"], block_size=BS)
    for i in range(MAX_LORAS + 5):
        router.prompt_hashes(PROMPT, ExtraKeys(lora=f"l{i}", lora_path=f"/p{i}"))
    learned(router, ExtraKeys(lora="l5", lora_path="/p5"))  # (given again: kept longest)
    router.prompt_hashes(PROMPT, ExtraKeys(lora="new"))
    paths = router._hash_check._paths
    assert len(paths) == MAX_LORAS and "l5" in paths and "l6" not in paths
    assert list(paths)[-2:] == ["l5", "new"]


def test_vllm_salted_and_lora_entries_are_read_as_vllm_sends_them():
    """vLLM 0.33's ``extra_keys`` of a salted LoRA request: the name on every block, the
    salt after it on block 0 only (``to_event_extra_keys``), as hand-built events."""
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    for extra, keys in ((SALTED, [["tenant-x"], None, None]),
                        (LORA_SALTED, [["ad", "tenant-x"], ["ad"], ["ad"]])):
        h = learned(router, extra).prompt_hashes(toks, extra)
        lora = {"lora_name": extra.lora} if extra.lora else {}
        router.check_hashes("a", runs_payload(stored(h, toks, extra_keys=keys, **lora)))
        router.check_hashes("a", runs_payload(stored(h[:1] + [5, 6], toks, extra_keys=keys,
                                                     **lora)))
    assert router.hash_checked["a"] == 12 and router.hash_mismatches["a"] == 2


requests_st = st.lists(st.tuples(
    st.integers(1, 6),                                   # full blocks
    st.sampled_from([None, "ad", "be"]),                 # LoRA
    st.sampled_from([None, "/w"]),                       # its path
    st.sampled_from([None, "tenant-x"]),                 # salt
    st.none() | st.tuples(st.integers(0, 23), st.integers(1, 6)),  # an image: offset, length
    st.booleans()), min_size=1, max_size=3)              # whether a prompt named the LoRA


@settings(max_examples=40, deadline=None)
@given(requests_st, st.booleans())
def test_compared_blocks_match_a_reference_and_only_a_wrong_seed_is_flagged(requests, wrong):
    """Each request its own chain: compared are its blocks before the first one its image
    overlaps, all when the LoRA's path is known from a prompt (none otherwise)."""
    mgr = KVCacheManager(256, BS, hash_mode="sha256", seed=2 if wrong else None,
                         enable_events=True)
    router = Router(["a"], block_size=BS)
    named: dict[str, list[str | None]] = {}  # LoRA -> the paths prompts gave it
    expect = []  # (blocks compared, its LoRA and path) per request
    for i, (n, lora, path, salt, image, prompted) in enumerate(requests):
        prompt = [1000 * (i + 1)] + [i] * (n * BS - 1)
        mm = () if image is None or image[0] + image[1] > len(prompt) else (
            MultiModalInput(f"img{i}", *image),)
        extra = ExtraKeys(lora=lora, cache_salt=salt, mm=mm,
                          lora_path=None if lora is None else path)
        if lora is not None and prompted:
            router.prompt_hashes(prompt, extra)
            named.setdefault(lora, []).append(extra.lora_path)
        stores(mgr, (prompt, extra))
        expect.append((n if not mm else mm[0].offset // BS, lora, extra.lora_path))
    checked = runs = 0
    for k, lora, path in expect:
        if lora is not None and lora not in named:
            continue  # (its path unknown: not compared)
        checked += k
        runs += k > 0 and (wrong or lora is not None and path not in named[lora][-4:])
    feed(router, payload_of(mgr))
    assert router.hash_checked["a"] == checked
    assert router.hash_mismatches["a"] == runs
