"""Handed-off events (``take_pending_events``, built later on another thread) across last
session's calls that forget contents: ``uncache_blocks`` (and the descendants and
later blocks it takes along), ``rewind`` and the recompute, ``fork``, and
``free(num_computed_tokens=)`` of a request aborted before its step ran. Built after
the pool went on mutating (blocks emptied, reused for other contents), each batch must
equal what ``take_events()`` returned at the same point on a twin manager."""

import queue
import random
import threading

import pytest

from prefixkv import KVCacheManager, PendingEvents
from prefixkv.errors import RequestError
from test_event_log import builder, workload

BS = 4


def forgetting(rng: random.Random, m: KVCacheManager, live: list[str], step: int) -> None:
    """One random step: one of test_event_log's, or a call that forgets content."""
    op = rng.random()
    if op < 0.5 or not live:
        workload(rng, m, live, step)
        return
    rid = rng.choice(live)
    n = m.num_scheduled_tokens(rid)
    if op < 0.65:  # a load into one of its blocks failed
        ids = m.get_block_ids(rid)[:n // BS]
        if ids:
            m.uncache_blocks([rng.choice(ids)])
    elif op < 0.8:  # taken back and recomputed (refused while another holds the tail)
        back = rng.randint(0, n)
        try:
            m.rewind(rid, back)
        except RequestError:
            return
        if back < n:
            m.extend(rid, n - back)
    elif op < 0.9:
        if n == m.num_tokens(rid) and m.fork(rid, f"f{step}") is not None:
            live.append(f"f{step}")
    else:  # aborted before its last step ran
        live.remove(rid)
        m.free(rid, num_computed_tokens=rng.randint(0, n))


@pytest.mark.parametrize("hash_mode", ["xxhash", "sha256"])
@pytest.mark.parametrize("seed", range(10))
def test_handed_off_events_equal_take_events_across_forgetting_calls(hash_mode, seed):
    rng = random.Random(seed)
    make = dict(num_blocks=rng.choice([12, 24, 64]), block_size=BS, hash_mode=hash_mode, seed=3,
                enable_events=True)
    ref, m = KVCacheManager(**make), KVCacheManager(**make)
    batches: queue.Queue[PendingEvents | None] = queue.Queue()
    built: list = []
    thread = threading.Thread(target=builder, args=(batches, built))
    expected, got, held = [], [], []
    ref_live: list[str] = []
    live: list[str] = []
    thread.start()
    try:
        for step in range(300):
            state = rng.getstate()
            forgetting(rng, ref, ref_live, step)
            rng.setstate(state)
            forgetting(rng, m, live, step)
            ref.take_kv_ops()  # (each call a step: its copies run before the next)
            m.take_kv_ops()
            assert live == ref_live
            expected.append(ref.take_events())
            pending = m.take_pending_events()
            got.append(pending)
            held.append(pending)
            if rng.random() < 0.3:  # built a few steps late, while the pool moved on
                for p in held:
                    batches.put(p)
                held = []
            m.check_invariants()
    finally:
        for p in held:
            batches.put(p)
        batches.put(None)
        thread.join(30)
    assert not thread.is_alive()
    assert [p.build() for p in got] == expected
