"""prefixkv's vLLM scheduler hands its KV events to vLLM's own ``ZmqEventPublisher``
unbuilt (``prefixkv.integrations.vllm.handoff``): the publisher's thread builds them, and
the bytes it sends are those of the events built on the scheduler's thread. Needs vllm
installed (``make install-vllm``)."""

from __future__ import annotations

import os
import threading

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from waiting import PATIENCE, connect_sub  # noqa: E402

from .test_vllm_plugin import BS, manager, request  # noqa: E402

TOPIC = "kv"


def step(m, rid, tokens):
    """Admit ``tokens`` as request ``rid`` (computed at once) and free it."""
    r = request(rid, tokens)
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None
    r.num_computed_tokens = len(tokens)
    m.free(r)


def publish(pub, events, ts):
    """What vLLM 0.33's scheduler does with a step's events (scheduler.py:2623-2637)."""
    from vllm.distributed.kv_events import KVEventBatch

    if events:
        pub.publish(KVEventBatch(ts=ts, events=events))


def test_the_publishers_thread_builds_the_same_bytes(tmp_path, calling_threads):
    """Two managers run the same steps (stores, evictions in an 11-block pool, a step
    with nothing new); one builds its events as vLLM's scheduler takes them, the other
    hands them to vLLM's publisher. Every payload sent equals msgspec's encoding of the
    built events (the connector's events after the manager's in the second step)."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    from prefixkv.integrations.vllm.handoff import PendingVllmEvents, hand_off

    built_on = calling_threads(PendingVllmEvents, "build")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/kv", topic=TOPIC)  # (binds it)
    try:
        connect_sub(sub, f"ipc://{tmp_path}/kv")  # (the subscription reaches the publisher)
        assert hand_off(pub)
        eager = manager(enable_kv_cache_events=True)
        handed = manager(enable_kv_cache_events=True)
        handed.hands_off_events = True
        connector = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1] * BS,
                                block_size=BS, lora_id=None, medium="STORAGE", lora_name=None)
        expected = []
        prompts = [list(range(100 * i, 100 * i + 40)) for i in range(5)] + [list(range(40))]
        for i, tokens in enumerate(prompts):
            for m in (eager, handed):
                step(m, f"r{i}", tokens)
            want, got = eager.take_events(), handed.take_events()
            # not built here; a step that recorded nothing: a plain empty list
            assert type(got) is (PendingVllmEvents if want else list) and len(got) == 0
            if i == 1:
                want.append(connector)
                got.extend([connector])
            if want:
                expected.append(msgspec.msgpack.encode(
                    KVEventBatch(ts=float(i), events=want, data_parallel_rank=0)))
            assert bool(got) == bool(want)
            publish(pub, got, float(i))
        sent = []
        while len(sent) < len(expected) and sub.poll(PATIENCE * 1000):  # (sent by a thread)
            topic, seq, payload = sub.recv_multipart()
            sent.append(payload)
        assert not sub.poll(100)  # nothing more
        assert sent == expected and len(sent) >= 5
        assert built_on and threading.get_ident() not in built_on
    finally:
        pub.shutdown()
        sub.close(linger=0)


def test_only_vllms_own_zmq_publisher_is_handed_off():
    from vllm.distributed.kv_events import NullEventPublisher, ZmqEventPublisher

    from prefixkv.integrations.vllm.handoff import hand_off

    class Mine(ZmqEventPublisher):
        pass

    assert not hand_off(NullEventPublisher()) and not hand_off(None)
    assert not hand_off(Mine.__new__(Mine))


def test_prefixkvs_scheduler_hands_off_when_events_go_to_vllms_publisher(tmp_path):
    """The constructor of prefixkv's Scheduler (over a stand-in for vLLM's, which would
    need a model config) sets ``hands_off_events`` only with events on and vLLM's
    ZmqEventPublisher."""
    from vllm.distributed.kv_events import NullEventPublisher, ZmqEventPublisher

    from prefixkv.integrations.vllm.scheduler import _build

    class VllmLike:
        def __init__(self, publisher, events):
            self.kv_event_publisher = publisher
            self.kv_cache_manager = manager(enable_kv_cache_events=events)

    def Scheduler(publisher, events):  # noqa: N802 (as the plug-in's __init__ builds one)
        s = VllmLike.__new__(VllmLike)
        _build(s, lambda: VllmLike.__init__(s, publisher, events))
        return s

    zmq_pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/kv", topic=TOPIC)
    try:
        assert Scheduler(zmq_pub, True).kv_cache_manager.hands_off_events
        assert not Scheduler(zmq_pub, False).kv_cache_manager.hands_off_events
        assert not Scheduler(NullEventPublisher(), True).kv_cache_manager.hands_off_events
    finally:
        zmq_pub.shutdown()


def test_metrics_and_the_block_pool_get_built_events():
    """A metrics collector counts evictions from the events as they are taken, and
    ``block_pool.take_events()`` is vLLM's list: neither is handed off."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    from prefixkv.integrations.vllm.handoff import PendingVllmEvents

    m = manager(enable_kv_cache_events=True, metrics_collector=KVCacheMetricsCollector())
    m.hands_off_events = True
    step(m, "a", list(range(40)))
    assert type(m.take_events()) is list
    m = manager(enable_kv_cache_events=True)
    m.hands_off_events = True
    step(m, "a", list(range(40)))
    events = m.block_pool.take_events()
    assert type(events) is list and len(events) == 1
    assert type(m.take_events()) is list  # (nothing recorded since: nothing to hand off)
    step(m, "b", list(range(100, 140)))
    assert type(m.take_events()) is PendingVllmEvents
