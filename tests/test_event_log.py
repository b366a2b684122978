"""Handed-off events (``take_pending_events``): built on another thread, while the
scheduler goes on mutating the pool, they equal what ``take_events()`` returns for the
same workload, event for event, over many random workloads."""

import queue
import random
import threading

import pytest

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, PendingEvents

BS = 4
PREFIXES = [list(range(1, 13)), list(range(100, 117)), [7] * 9]
EXTRAS = [None, ExtraKeys(cache_salt="t"), ExtraKeys(lora="a", lora_id=1),
          ExtraKeys(mm=(MultiModalInput("img", 2, 5),))]


def workload(rng: random.Random, m: KVCacheManager, live: list[str], step: int) -> None:
    """One random step on ``m``: admit (shared prefixes, extra keys), decode, free,
    preempt, now and then a reset."""
    op = rng.random()
    if op < 0.45 or not live:
        rid = f"r{step}"
        prompt = rng.choice(PREFIXES)[: rng.randint(1, 17)] + [rng.randrange(500)
                                                              for _ in range(rng.randint(1, 14))]
        extra = rng.choice(EXTRAS)
        if extra is not None and extra.mm and len(prompt) < 7:
            extra = None
        if m.add_request(rid, prompt, extra=extra) is not None:
            live.append(rid)
    elif op < 0.75:
        rid = rng.choice(live)
        m.append_tokens(rid, [rng.randrange(500) for _ in range(rng.randint(1, 6))])
    elif op < 0.93:
        m.free(live.pop(rng.randrange(len(live))))
    elif op < 0.98:
        m.preempt(live.pop(rng.randrange(len(live))))
    else:
        for rid in live:
            m.free(rid)
        live.clear()
        m.reset_prefix_cache()


def builder(batches: "queue.Queue[PendingEvents | None]", out: list) -> None:
    """What the publisher's thread does: build each batch as it comes, in order."""
    while (batch := batches.get()) is not None:
        out.append(batch.build())


@pytest.mark.parametrize("hash_mode", ["xxhash", "sha256"])
@pytest.mark.parametrize("seed", range(12))
def test_handed_off_events_built_on_another_thread_equal_take_events(hash_mode, seed):
    rng = random.Random(seed)
    make = dict(num_blocks=rng.choice([12, 24, 64]), block_size=BS, hash_mode=hash_mode, seed=3,
                enable_events=True, max_events=rng.choice([1, 1 << 20]))
    ref, m = KVCacheManager(**make), KVCacheManager(**make)
    batches: queue.Queue[PendingEvents | None] = queue.Queue()
    built: list = []
    thread = threading.Thread(target=builder, args=(batches, built))
    thread.start()
    expected, got = [], []
    ref_live: list[str] = []
    live: list[str] = []
    try:
        for step in range(300):
            state = rng.getstate()
            workload(rng, ref, ref_live, step)
            rng.setstate(state)
            workload(rng, m, live, step)
            expected.append(ref.take_events())
            if rng.random() < 0.1:  # a plain take now and then: the handed-off ones first
                got.append(("now", m.take_events()))
            else:
                pending = m.take_pending_events()
                got.append(("handed", pending))
                batches.put(pending)
            m.check_invariants()
    finally:
        batches.put(None)
        thread.join(30)
    assert not thread.is_alive()
    stream = [events if how == "now" else events.build() for how, events in got]
    assert stream == expected
    if make["max_events"] == 1:  # an overflow restates the index, built at once
        assert m.events_dropped == ref.events_dropped > 0
    assert sum(map(len, built)) == sum(len(s) for (how, _), s in zip(got, stream, strict=True)
                                       if how == "handed")


def test_a_pending_batch_builds_once_and_the_older_ones_first():
    m = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
    ref = KVCacheManager(8, BS, hash_mode="sha256", enable_events=True)
    expected, pending = [], []
    for i in range(6):  # a pool of 8: later prompts evict earlier ones
        for mgr in (m, ref):
            mgr.add_request(i, list(range(10 * i, 10 * i + 9)))
            mgr.free(i)
        expected.append(ref.take_events())
        pending.append(m.take_pending_events())
    assert not pending[-1].empty
    newest = pending[-1].build()  # builds the five before it first
    assert newest is pending[-1].build()  # once
    assert [p.build() for p in pending] == expected
    assert m.take_pending_events().empty and m.take_pending_events().build() == []


def test_a_step_that_recorded_nothing_hands_off_one_shared_empty_batch():
    """Nothing recorded: no batch is made (one object serves every such step, as most
    decode steps are), yet each ``build()`` is a list of its own, and the batch of the
    next step that records something is built as before."""
    m = KVCacheManager(8, BS, enable_events=True)
    m.add_request("a", list(range(9)))
    assert m.take_pending_events().build()  # (the store of block 0, deferred)
    first, second = m.take_pending_events(), m.take_pending_events()
    assert first is second and first.empty and first.is_built
    got = first.build()
    got.append("not an event")  # a caller's own list
    assert first.build() == [] and second.build() == []
    m.free("a")
    m.add_request("b", [100 + t for t in range(9)])
    m.add_request("c", list(range(200, 220)))  # evicts: stored and removed
    pending = m.take_pending_events()
    assert pending is not first and len(pending.build()) >= 2
    assert m.take_pending_events() is first


def test_events_off_hand_off_an_empty_batch():
    m = KVCacheManager(8, BS)
    m.add_request("a", list(range(9)))
    pending = m.take_pending_events()
    assert pending.empty and pending.build() == []


def test_a_hybrid_manager_hands_off_its_events_built():
    from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

    def make():
        return HybridKVCacheManager([full_attention(), sliding_window(8)], 32, BS,
                                    hash_mode="sha256", enable_events=True)
    m, ref = make(), make()
    for mgr in (m, ref):
        mgr.add_request("a", list(range(1, 11)))
    pending = m.take_pending_events()
    assert not pending.empty and pending.build() == ref.take_events() != []


def test_a_batch_of_spares_alone_is_empty_once_built():
    """``empty`` is known without building: a batch taken unbuilt is not empty, though
    its one item (a ``StoredRun`` of spares alone) builds no event; built, it is."""
    m = KVCacheManager(16, BS, enable_events=True)
    m.add_request("a", list(range(8)))
    m.take_events()
    m.add_request("b", list(range(8)), read_cache=False)  # (its full blocks: spares)
    pending = m.take_pending_events()
    assert not pending.empty and not pending.is_built
    assert pending.build() == [] and pending.empty
