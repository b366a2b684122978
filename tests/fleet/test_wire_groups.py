"""A hybrid manager's events on the wire: group index and spec fields, exact maps, decoded
back, scored once per block by the router, and carried over real ZeroMQ on loopback."""

import msgpack
import pytest

from prefixkv import block_hashes
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.wire import encode_batch, to_wire_events, wire_hash
from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, sliding_window
from prefixkv.router import Removed, Router, Stored, decode_batch
from waiting import LIVE, await_subscribed, poll_until, wait_until

BS = 4
GROUPS = [full_attention(), sliding_window(5), chunked_local(8)]


def hybrid(num_blocks=12, groups=GROUPS):
    return HybridKVCacheManager(groups, num_blocks, BS, hash_mode="sha256", enable_events=True)


def hashes(tokens):
    return [wire_hash(d) for d in block_hashes(tokens, BS)]


def stored(group, kind, window, hs, parent, tokens):
    ev = {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent,
          "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
          "lora_name": None, "extra_keys": [None] * len(hs), "group_idx": group,
          "kv_cache_spec_kind": kind}
    if window is not None:
        ev["kv_cache_spec_sliding_window"] = window
    return ev


def removed(group, hs):
    return {"type": "BlockRemoved", "block_hashes": hs, "medium": "GPU", "group_idx": group}


def test_group_fields_exact_maps_and_order():
    m = hybrid()
    a = list(range(1, 13))
    h = hashes(a)
    m.add_request("a", a[:10])                     # blocks 0, 1 full in every group
    ts, events, rank = msgpack.unpackb(encode_batch(m.take_events(), block_size=BS, ts=2.0))
    assert events == [
        stored(0, "full_attention", None, h[:2], None, a[:8]),
        stored(1, "sliding_window", 5, h[:2], None, a[:8]),
        stored(2, "chunked_local_attention", None, h[:2], None, a[:8]),
    ]
    assert [list(e)[-3:] for e in events] == [
        ["extra_keys", "group_idx", "kv_cache_spec_kind"],
        ["group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"],
        ["extra_keys", "group_idx", "kv_cache_spec_kind"]]
    m.append_tokens("a", [11, 12])                 # block 2 fills: one run per group
    assert to_wire_events(m.take_events(), BS) == [
        stored(0, "full_attention", None, h[2:], h[1], a[8:]),
        stored(1, "sliding_window", 5, h[2:], h[1], a[8:]),
        stored(2, "chunked_local_attention", None, h[2:], h[1], a[8:]),
    ]
    # window 5 released block 0 of group 1, chunk 8 blocks 0 and 1 of group 2: freed group
    # by group, each group's tail first, as vLLM's remove_skipped_blocks frees them, except
    # that group 2's block 1 (tokens 5-8), which no hit can use (a hit of 4 tokens does not
    # reach it, one of 8 or more starts a new chunk), goes first (groups/release_order.py)
    assert m.free_block_order() == [10, 11, 8, 4, 7]
    m.free("a")
    assert m.free_block_order() == [10, 11, 8, 4, 7, 3, 6, 9, 2, 5, 1]
    c = list(range(100, 109))
    assert m.add_request("c", c).group_block_ids == ((10, 11, 8), (4, 7, 3), (6, 9, 2))
    # evicted in free-queue order; removals join only within one group
    wire = to_wire_events(m.take_events(), BS)
    hc = hashes(c)
    assert wire == [
        removed(2, [h[1]]), removed(1, [h[0]]), removed(2, [h[0]]), removed(0, [h[2]]),
        removed(1, [h[2]]), removed(2, [h[2]]), removed(0, [h[1]]),
        stored(0, "full_attention", None, hc, None, c[:8]),
        stored(1, "sliding_window", 5, hc, None, c[:8]),
        stored(2, "chunked_local_attention", None, hc, None, c[:8]),
    ]
    _, decoded, _ = decode_batch(encode_batch(m.take_events() or [], block_size=BS, ts=0.0))
    assert decoded == []


def test_decode_reads_group_fields():
    m = hybrid(num_blocks=28)
    a = list(range(1, 11))
    m.add_request("a", a)
    m.free("a")
    assert m.add_request("b", list(range(40, 76))) is not None  # 27 blocks: evicts a's
    _, evs, _ = decode_batch(encode_batch(m.take_events(), block_size=BS, ts=0.0))
    h = tuple(hashes(a))
    assert evs[:3] == [Stored(h, None, "GPU", 0, "full_attention", None),
                       Stored(h, None, "GPU", 1, "sliding_window", 5),
                       Stored(h, None, "GPU", 2, "chunked_local_attention", None)]
    assert {(e.group, e.hashes) for e in evs if isinstance(e, Removed)} == {
        (g, (x,)) for g in range(3) for x in h}


def test_decode_old_array_events_with_group_fields():
    old = msgpack.packb([1.0, [
        ["BlockStored", [5], None, [1, 2], 2, None, "GPU", None, None, 1, "sliding_window", 64],
        ["BlockRemoved", [5], "GPU", 1]]])
    _, evs, _ = decode_batch(old)
    assert evs == [Stored((5,), None, "GPU", 1, "sliding_window", 64), Removed((5,), "GPU", 1)]


def test_decode_rejects_a_mistyped_group_field():
    from prefixkv.router import DecodeError

    bad = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}]])
    with pytest.raises(DecodeError, match="group_idx"):
        decode_batch(bad)


def feed(router, replica, m):
    router.apply(replica, decode_batch(encode_batch(m.take_events(), block_size=BS))[1])


def test_router_scores_the_full_attention_group_once_per_block():
    # the full-attention group second: the sliding group's events come first
    m = hybrid(groups=[sliding_window(5), full_attention()])
    router = Router(["r"], block_size=BS)
    a = list(range(1, 14))
    m.add_request("a", a)                          # 3 full blocks in each group
    feed(router, "r", m)
    assert router.scored_group("r") == 1
    assert router.index.num_blocks("r") == 3       # not 6: one group is mirrored
    assert router.cached_tokens(a)["r"] == 12 == m.lookup(a + [0])
    m.free("a")
    # group 0 (sliding) held blocks 1 2 3 (4 partial), group 1 (full) 5 6 7 (8)
    assert m.free_block_order() == [8, 4, 9, 10, 11, 3, 7, 2, 6, 1, 5]
    m.add_request("x", list(range(200, 209)))      # 6 blocks: evicts 3 (sliding, block 2)
    feed(router, "r", m)
    # the sliding group's removal is not applied: the router predicts 12 tokens, an upper
    # bound; the manager serves 8 (a hit of 3 blocks needs block 2 in the window)
    assert router.cached_tokens(a)["r"] == 12 and m.lookup(a) == 8
    m.add_request("y", [7])                        # 2 blocks: evicts 7 (full, block 2), 2
    feed(router, "r", m)
    assert router.cached_tokens(a)["r"] == 8 and m.lookup(a) == 4
    assert router.index.num_blocks("r") == 2 + 2   # a's blocks 0, 1 and x's 2 full blocks


def test_router_without_group_fields_and_unknown_kind():
    router = Router(["r"], block_size=BS)
    router.apply("r", [Stored((1, 2), None, "GPU")])              # no group: a one-group stream
    assert router.scored_group("r") is None and router.index.num_blocks("r") == 2
    router.apply("r", [Removed((3,), "GPU", 3)])  # no scored group yet: a removal naming
    router.apply("r", [Removed((2,), "GPU", 3)])  # a group is applied (it can only understate)
    assert router.index.num_blocks("r") == 1
    router.apply("r", [Removed((1,), "GPU")])
    assert router.index.num_blocks("r") == 0
    other = Router(["r"], block_size=BS)
    other.apply("r", [Stored((1,), None, "GPU", 0, "sliding_window", 8)])
    assert other.scored_group("r") is None and other.index.num_blocks("r") == 0


def test_hybrid_publisher_to_subscriber_over_zeromq():
    from prefixkv.router.subscriber import Subscriber

    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", block_size=BS,
                         heartbeat=None)
    m = hybrid(num_blocks=40)
    router = Router(["r"], block_size=BS)
    p = [list(range(100 * i + 1, 100 * i + 14)) for i in range(3)]  # 3 full blocks each
    try:
        m.add_request("a", p[0])
        pub.publish(m.take_events())
        wait_until(lambda: pub.published_batches == 1, "a sent before anyone subscribes")
        sub = Subscriber(router, {"r": (pub.endpoint, pub.replay_endpoint)}, replay_timeout=LIVE)
        try:
            await_subscribed(sub)
            m.add_request("b", p[1])
            pub.publish(m.take_events())
            assert poll_until(sub, lambda: router.cached_tokens(p[1])["r"] == 12)
            assert sub.snapshots == 1             # first contact: the per-group snapshot
            assert router.scored_group("r") == 0
            assert [router.cached_tokens(x)["r"] for x in p] == [12, 12, 0]
            assert router.index.num_blocks("r") == 6
            m.free("a")
            m.free("b")
            m.add_request("c", list(range(500, 500 + 4 * 9)))  # evicts in every group
            pub.publish(m.take_events())
            assert poll_until(sub, lambda: sub.last_seq.get("r") == 2)  # batches a, b, c
            want = [m.lookup(x) for x in p]
            assert [router.cached_tokens(x)["r"] for x in p] == want == [4, 12, 0]
            # the index mirrors the full-attention group's contents, no more
            assert router.index.num_blocks("r") == m.group_stats()[0].blocks_cached
        finally:
            sub.close()
    finally:
        pub.close()


def test_publisher_snapshot_keeps_a_hash_per_group():
    pub = EventPublisher(block_size=BS, heartbeat=None)
    try:
        m = hybrid(groups=[full_attention(), sliding_window(5)])
        a = list(range(1, 14))
        m.add_request("a", a)
        m.free("a")
        m.add_request("x", list(range(200, 209)))  # evicts a's block 2 in group 0 only
        pub.publish(m.take_events())
        # the thread follows the batch in its mirror
        wait_until(lambda: pub.published_batches == 1, "the batch sent")
        _, evs, _ = decode_batch(pub._snapshot())
        h = hashes(a)
        got = {(e.group, e.kind, e.window): sorted(e.hashes) for e in evs[1:]}
        assert got[(0, "full_attention", None)] == sorted(h[:2] + hashes(list(range(200, 208))))
        # group 1 still holds h[2]: a mirror keyed by medium alone would have lost it
        assert got[(1, "sliding_window", 5)] == sorted(h + hashes(list(range(200, 208))))
    finally:
        pub.close()
