"""The engine hands each step's events off unbuilt (``StepRecord.pending_events``): a
publisher's thread builds them, and they equal the events of the same run read on the
engine's thread; a batch nobody builds is built by the engine at the end of the next
step, so at most one waits."""

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")
pytest.importorskip("zmq", reason="the publisher needs pyzmq (extra prefixkv[events])")

from prefixkv import BlockStored, KVCacheManager, event_log  # noqa: E402
from prefixkv.engine import SamplingParams  # noqa: E402
from prefixkv.fleet.publisher import EventPublisher  # noqa: E402

from .helpers import CONFIG  # noqa: E402
from .test_engine import prompts_with  # noqa: E402

PROMPTS = prompts_with(list(range(100, 148)), 8, 40, seed=7)  # a shared 3-block prefix


def manager():
    """A manager with events on and a fixed hash seed (two runs announce equal hashes);
    16 blocks for 8 requests of 3 shared and 3 own blocks each: later ones evict."""
    return KVCacheManager(16, 16, seed=0, enable_events=True, vocab_size=CONFIG.vocab_size)


def shape(events):
    return [(type(e).__name__, tuple(e.block_hashes), tuple(e.block_ids)) for e in events]


def test_a_publishers_thread_builds_the_steps_events(make_engine, calling_threads):
    built_on = calling_threads(event_log, "_expand")
    engine, alloc = make_engine(allocator=manager(), max_num_seqs=2)
    pub = EventPublisher(block_size=16, heartbeat=None)
    records = []

    def on_step(rec):
        alloc.check_invariants()
        records.append(rec)
        if rec.pending_events.empty:
            return
        sent = pub.published_batches
        assert pub.publish(rec.pending_events)
        deadline = time.monotonic() + 20  # sent, so built: the engine never has to
        while pub.published_batches == sent and time.monotonic() < deadline:
            time.sleep(0.001)

    engine.generate(PROMPTS, SamplingParams(max_tokens=6), on_step=on_step)
    pub.close()
    assert pub.health()["dropped_batches"] == 0
    assert built_on and threading.get_ident() not in built_on
    assert all(r.pending_events.is_built for r in records)
    handed = [shape(r.events) for r in records]
    engine, alloc = make_engine(allocator=manager(), max_num_seqs=2)
    eager = [shape(r.events) for r in engine.generate(PROMPTS, SamplingParams(max_tokens=6)).steps]
    assert handed == eager
    assert any(t == "BlockRemoved" for step in eager for t, *_ in step)  # evictions too


def test_a_batch_nobody_builds_is_built_at_the_end_of_the_next_step(make_engine):
    engine, alloc = make_engine(allocator=manager(), max_num_seqs=2)
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=6))
    records = [engine.step()]
    assert not records[0].pending_events.empty and not records[0].pending_events.is_built
    while engine.has_unfinished():
        records.append(engine.step())
        assert records[-2].pending_events.is_built  # the engine built it
    stored = [e for r in records for e in r.events if isinstance(e, BlockStored)]
    assert stored and all(len(e.block_hashes) == len(e.block_ids) for e in stored)
