"""prefixkv's event stream against vLLM 0.33.0's own code (issue 26.6), loaded from the
release wheel (tests/fleet/vllm_kv_events.py says how and what is stood in for):

- prefixkv's live stream decodes with vLLM's ``KVEventBatch`` and re-encodes, with
  vLLM's encoder, to the same bytes;
- ``extra_keys`` are what vLLM's own ``generate_block_hash_extra_keys`` and
  ``to_event_extra_keys`` give for the same request (issue 26.2);
- prefixkv's router follows vLLM's real ``ZmqEventPublisher``: in order, a gap filled
  by vLLM's replay, and a restart without heartbeats.
"""

import time
from types import SimpleNamespace

import msgpack
import msgspec
import pytest
import zmq

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput
from prefixkv.fleet.publisher import EventPublisher
from prefixkv.fleet.wire import to_wire_events
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from prefixkv.router import Router
from prefixkv.router.subscriber import Subscriber
from prefixkv.store.local_cluster import _free_port
from waiting import LIVE, PATIENCE, await_subscribed, connect_sub, poll_until

from .vllm_kv_events import kv_cache_utils, kv_events

BS = 4
TOPIC = "kv-events"


@pytest.fixture(scope="module")
def kv():
    return kv_events()


def plain(value):
    """Tuples as lists, recursively (msgpack has one array type)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def recv_all(sub, n):
    out = []
    while len(out) < n:
        assert sub.poll(PATIENCE * 1000), f"got {len(out)} of {n} messages"
        out.append(sub.recv_multipart())
    return out


@pytest.mark.parametrize("handed_off", [False, True])
def test_prefixkv_stream_decodes_with_vllms_structs(kv, handed_off):
    """Also with the events handed off (``take_pending_events``: built by the publisher's
    thread), which must put the same stream on the wire."""
    ctx = zmq.Context.instance()
    extra = ExtraKeys(lora="ad", cache_salt="tenant-x", mm=(MultiModalInput("img-1", 5, 6),),
                      lora_id=3)
    mgr = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    hybrid = HybridKVCacheManager([full_attention(), sliding_window(6)], 24, BS,
                                  hash_mode="sha256", enable_events=True)
    with EventPublisher(block_size=BS, heartbeat=None, dp_rank=2) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        connect_sub(sub, pub.endpoint)
        mgr.add_request("a", list(range(1, 18)), extra=extra)
        take = [m.take_pending_events if handed_off else m.take_events for m in (mgr, hybrid)]
        pub.publish(take[0]())
        mgr.free("a")
        mgr.add_request("b", list(range(100, 160)))  # evicts a's blocks
        pub.publish(take[0]())
        hybrid.add_request("h", list(range(1, 11)))
        pub.publish(take[1]())
        messages = recv_all(sub, 3)
        sub.close(linger=0)
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    batches = [decoder.decode(payload) for _, _, payload in messages]
    for (_, _, payload), batch in zip(messages, batches, strict=True):
        # the same values; the bytes differ only in map headers: msgspec writes
        # BlockStored (16 fields in 0.33) with a map16 header whatever it omits
        assert msgpack.unpackb(encoder.encode(batch)) == msgpack.unpackb(payload)
        assert batch.data_parallel_rank == 2
    first = batches[0].events[0]
    assert isinstance(first, kv.BlockStored)
    assert (first.lora_name, first.lora_id, first.medium, first.block_size) == ("ad", 3, "GPU", BS)
    assert plain(first.extra_keys) == [["ad", "tenant-x"], ["ad", ["img-1", 1]],
                                       ["ad", ["img-1", -3]], ["ad"]]
    assert {type(e) for e in batches[1].events} >= {kv.BlockStored, kv.BlockRemoved}
    groups = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
              for e in batches[2].events]
    assert groups == [(0, "full_attention", None), (1, "sliding_window", 6)]


def vllm_request(prompt_len, lora=None, salt=None, mm=()):
    """What vLLM's extra-key functions read of a ``vllm.v1.request.Request``."""
    return SimpleNamespace(
        mm_features=[SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
                     for i, o, n in mm],
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/x"),
        cache_salt=salt, prompt_embeds=None, num_tokens=prompt_len)


def vllm_event_extra_keys(request, num_blocks):
    """vLLM's ``extra_keys`` for a request's first ``num_blocks`` blocks, computed as its
    ``BlockPool.cache_full_blocks`` does (one call a block, carrying the mm index)."""
    utils = kv_cache_utils()
    keys, mm_idx = [], 0
    for i in range(num_blocks):
        k, mm_idx = utils.generate_block_hash_extra_keys(request, i * BS, (i + 1) * BS, mm_idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


@pytest.mark.parametrize("lora, salt, mm", [
    (None, "tenant-x", [("img-1", 5, 2)]),               # the example
    ("ad", "s", [("a", 0, 3), ("b", 3, 9), ("c", 14, 2)]),  # inputs sharing and spanning blocks
    ("ad", None, []), (None, None, [("x", 8, 8)]),
])
def test_extra_keys_equal_vllms_own(lora, salt, mm):
    prompt = list(range(1, 18))  # 4 full blocks
    extra = ExtraKeys(lora=lora, cache_salt=salt,
                      mm=tuple(MultiModalInput(i, o, n) for i, o, n in mm))
    mgr = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    mgr.add_request("a", prompt, extra=extra)
    (ev,) = to_wire_events(mgr.take_events(), BS)
    assert plain(ev["extra_keys"]) == plain(
        vllm_event_extra_keys(vllm_request(len(prompt), lora, salt, mm), 4))


# ---- the router on vLLM's ZmqEventPublisher -----------------------------------------


def free_ports(n):
    """``n`` distinct free ports outside the ephemeral range: vLLM's publisher binds them
    later, and other connections draw from that range meanwhile."""
    taken = []
    for _ in range(n):
        taken.append(_free_port(taken))
    return tuple(taken)


def vllm_publisher(kv, ports):
    """vLLM's publisher bound on ``ports`` (a restarted one may wait for them)."""
    deadline = time.monotonic() + PATIENCE
    while True:
        try:
            return kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{ports[0]}",
                                        replay_endpoint=f"tcp://*:{ports[1]}", topic=TOPIC)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def publish(kv, pub, mgr, rid, prompt):
    """One engine step of ``mgr``, published by vLLM's publisher as vLLM's structs."""
    mgr.add_request(rid, prompt)
    kinds = {"BlockStored": kv.BlockStored, "BlockRemoved": kv.BlockRemoved,
             "AllBlocksCleared": kv.AllBlocksCleared}
    events = [kinds[m.pop("type")](**m) for m in to_wire_events(mgr.take_events(), BS)]
    pub.publish(kv.KVEventBatch(ts=time.time(), events=events))


P = [list(range(100 * i + 1, 100 * i + 13)) for i in range(6)]  # 3 blocks each


def test_router_follows_vllms_publisher_through_a_gap_and_a_restart(kv):
    ports = free_ports(2)
    pub = vllm_publisher(kv, ports)
    mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
    router = Router(["v"], block_size=BS)
    sub = Subscriber(router, {"v": (f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")},
                     replay_timeout=LIVE)
    held = lambda: [router.cached_tokens(p)["v"] for p in P]  # noqa: E731
    try:
        await_subscribed(sub)
        publish(kv, pub, mgr, "a", P[0])
        assert poll_until(sub, lambda: held()[0] == 12)
        assert sub.health()["replicas"]["v"]["protocol"] == "vllm"
        publish(kv, pub, mgr, "b", P[1])
        publish(kv, pub, mgr, "c", P[2])
        (sock,) = sub._sockets.subs  # lost on the way: seq 1 and 2
        assert len(recv_all(sock, 2)) == 2
        publish(kv, pub, mgr, "d", P[3])
        assert poll_until(sub, lambda: held()[:4] == [12] * 4)
        assert (sub.gaps_filled, sub.resyncs, sub.restarts, sub.last_seq["v"]) == (1, 0, 0, 3)
        pub.shutdown()  # the engine restarts, empty, on the same ports, and stays quiet
        pub = vllm_publisher(kv, ports)
        mgr = KVCacheManager(256, BS, hash_mode="sha256", enable_events=True)
        assert poll_until(sub, lambda: sub.restarts == 1)
        assert held() == [0] * 6 and sub.disconnects >= 1
        publish(kv, pub, mgr, "e", P[4])
        assert poll_until(sub, lambda: held()[4] == 12)
        assert sub.last_seq["v"] == 0 and sub.resyncs == 0 and sub.errors == 0
        assert sub.bad_batches == sub.bad_replies == 0
    finally:
        sub.close()
        pub.shutdown()
