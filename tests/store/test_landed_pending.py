"""A store fetch's run that lands whole in device blocks is one pending run
(``core.store_fill.fill_pending``, ``index/pending.py``): its eviction names the
blocks (``core.keyless``) instead of the index unkeying each, and the host tier reads
the content of those it keeps from the run's record. Each test runs one scenario on two
managers over the same store, one landing pending runs, one writing each block (the
index's ``pending_runs`` off), and requires the same answers, plans, free order and
host slots at every step, and sound invariants. Block size 4, 8-byte payloads, fetches
run when the test says."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, PrefixKVError, StoreWait
from prefixkv.core.block import key_chunk
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed
from .test_store_fetch import Manual

P = list(range(100, 125))                          # six full blocks + 1
Q = list(range(500, 541))                          # a miss: ten full blocks + 1


@pytest.fixture
def stored(backend, layout):
    """The store holding the blocks of each of ``STORED``."""
    return store_all(backend, layout)


def store_all(backend, layout):
    """Write the blocks of each of ``STORED`` to the store; ``(backend, layout)``."""
    for i, prompt in enumerate(STORED):
        computed(KVCacheManager(16, 4, hash_mode="sha256", host_blocks=8,
                                store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                 backend, f"w{i}", prompt)
    return backend, layout


def pair(backend, layout, num_blocks, host_blocks):
    """The two managers (pending runs on, off), the store holding P's blocks."""
    computed(KVCacheManager(16, 4, hash_mode="sha256", host_blocks=8,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", P)
    return managers(backend, layout, num_blocks, host_blocks)


def managers(backend, layout, num_blocks, host_blocks, executor=Manual):
    """Two managers over the store, pending runs on, then off, with their executors (each
    an ``executor()``)."""
    out = []
    for pending in (True, False):
        ex = executor()
        m = KVCacheManager(num_blocks, 4, hash_mode="sha256", host_blocks=host_blocks,
                           store=SharedStore(backend, layout, cost=always(), timeout=LIVE,
                                             executor=ex))
        m._index.pending_runs = pending
        out.append((m, ex))
    return out


def seen(m):
    """What an engine (or the tier's next walk) can observe of ``m`` now."""
    m.check_invariants()
    host = sorted((s.block_id, s.key if s.key is None else key_chunk(s.key), s.parent_cid,
                   s.content_id, s.chained) for s in m._host.slots if s.key is not None)
    return (m.take_kv_ops(), m.free_block_order(), host, m.lookup(P), m.lookup(Q))


def hit(m, ex, rid, prompt):
    """A store hit of ``prompt``: the start, the fetch, the landing, the re-admission."""
    wait = m.add_request(rid, prompt)
    assert isinstance(wait, StoreWait), wait
    ex.run()
    assert m.poll_store() == [rid]
    return m.add_request(rid, prompt)


def admitted(m, ex, rid, prompt):
    """``rid`` admitted (after its store fetch, if the start asks the store): the
    answers in order."""
    out = [m.add_request(rid, prompt)]
    if isinstance(out[0], StoreWait):
        ex.run()
        out.append(m.poll_store())
        out.append(m.add_request(rid, prompt))
    return out


def both(backend, layout, scenario, num_blocks=16, host_blocks=8):
    """Run ``scenario(m, ex, log)`` on both managers; the logs must agree; returns the
    pending manager's log and the manager."""
    logs = []
    for m, ex in pair(backend, layout, num_blocks, host_blocks):
        log = []
        scenario(m, ex, log)
        logs.append(log)
        if m._index.pending_runs:
            pending_m = m
    assert logs[0] == logs[1]
    return logs[0], pending_m


def _landed(m):
    """The pending runs of ``m`` now (a landed run's blocks carry hashes)."""
    return [r for r in m._index.run_counts.pending if r.blocks[0].hash is not None]


def test_a_landed_run_is_one_pending_run_readmitted_and_freed_whole(backend, layout):
    runs = []

    def scenario(m, ex, log):
        adm = hit(m, ex, "p", P)
        log.append((adm, seen(m)))
        if m._index.pending_runs:
            runs.append(len(_landed(m)))
        m.free("p")
        log.append(seen(m))
        log.append(m.add_request("p2", P))           # a device hit of the whole run
        log.append(seen(m))
        m.free("p2")
        log.append(seen(m))

    both(backend, layout, scenario)
    assert runs == [1]


@pytest.mark.parametrize("host_blocks", [8, 7])
@pytest.mark.parametrize("miss_tokens", [5, 13, 21, 29, 41])
def test_a_landed_run_evicted_whole_or_cut_keeps_its_contents_below(backend, layout,
                                                                    host_blocks, miss_tokens):
    """A miss after the landed run (freed) takes the empty blocks, then the run's last
    blocks (cut: it stays pending, shorter), or all of it and its head; the host tier
    keeps each evicted content, or refreshes the slot that holds it."""
    def scenario(m, ex, log):
        log.append((hit(m, ex, "p", P), seen(m)))
        m.free("p")
        log.append(seen(m))
        log.append((admitted(m, ex, "q", Q[:miss_tokens]), seen(m)))
        m.free("q")
        log.append(seen(m))
        log.append((admitted(m, ex, "p2", P), seen(m)))   # what is left: device, host
        m.free("p2")
        log.append(seen(m))

    both(backend, layout, scenario, num_blocks=12, host_blocks=host_blocks)


def test_a_landed_run_evicted_with_every_slot_pinned_loses_its_contents(backend, layout):
    """Two slots, pinned by the offloads of the step: the run's other contents are lost,
    and the orphan check reads their ids from the run's record (ranges)."""
    def scenario(m, ex, log):
        log.append((admitted(m, ex, "p", P), seen(m)))
        m.free("p")
        log.append(seen(m))
        log.append((m.add_request("q", Q), seen(m)))
        m.free("q")
        log.append(seen(m))

    both(backend, layout, scenario, num_blocks=12, host_blocks=2)


def test_a_forked_landed_run_is_written_and_counted_per_block(backend, layout):
    def scenario(m, ex, log):
        log.append((hit(m, ex, "p", P), seen(m)))
        log.append((m.fork("p", "c"), seen(m)))   # each block counted alone: settled
        if m._index.pending_runs:
            assert not _landed(m)
        m.free("p")
        log.append(seen(m))
        log.append((m.add_request("q", Q), seen(m)))
        m.free("c")
        m.free("q")
        log.append(seen(m))

    both(backend, layout, scenario, num_blocks=20)


@pytest.mark.parametrize("to", [0, 4, 9, 24])
def test_a_rewound_landed_run_forgets_what_the_rewind_drops(backend, layout, to):
    def scenario(m, ex, log):
        log.append((hit(m, ex, "p", P), seen(m)))
        m.rewind("p", to)
        log.append(seen(m))
        m.free("p")
        log.append(seen(m))
        log.append((m.add_request("q", Q), seen(m)))
        m.free("q")
        log.append(seen(m))

    both(backend, layout, scenario, num_blocks=14)


def test_a_landed_run_evicted_whole_is_named_not_unkeyed(backend, layout):
    """The index is given none of the run's blocks to unkey; the host tier keeps each."""
    def scenario(m, ex, log):
        log.append((hit(m, ex, "p", P), seen(m)))
        m.free("p")
        log.append(seen(m))
        if m._index.pending_runs:
            drop = m._index.drop
            calls = []

            def spied(blocks, skip=(), keyless=None):  # (a tier below: records kept)
                assert (keyless is None) == (not skip), (skip, keyless)
                assert keyless is None or [(lo, hi) for lo, hi, *_ in keyless.spans] == list(skip)
                calls.append((len(blocks), list(skip) or None))
                drop(blocks, skip, keyless)
            m._index.drop = spied
        log.append((m.add_request("q", Q), seen(m)))
        if m._index.pending_runs:
            assert calls and any(spans for _, spans in calls), calls
            assert not _landed(m)
        m.free("q")
        log.append(seen(m))

    log, _ = both(backend, layout, scenario, num_blocks=12, host_blocks=12)


STORED = [P, P[:13] + list(range(300, 312)), list(range(700, 733))]
MISSES = [Q, P[:9] + list(range(950, 970)), list(range(800, 817))]
STEPS = st.one_of(  # (``apply``'s)
    st.tuples(st.just("hit"), st.integers(0, 2)),
    st.tuples(st.just("miss"), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("rewind"), st.integers(0, 7), st.integers(0, 30)),
    st.tuples(st.just("step")))
OPS = st.lists(STEPS, min_size=1, max_size=20)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, num_blocks=st.integers(12, 16), host_blocks=st.integers(2, 9))
# a run landing under the head of a landed pending run (S1's block 2, P's parent too):
# ``land_run`` chained it under that head, whose ``child`` is the pending run's first block
@example(ops=[("miss", 1), ("hit", 1), ("free", 0), ("hit", 0)], num_blocks=13, host_blocks=4)
def test_random_steps_agree_with_pending_runs_on_and_off(stored, ops, num_blocks, host_blocks):
    """Random hits of stored prompts, misses, frees, forks and rewinds: the pending
    manager answers as the one that writes each block, with sound invariants."""
    backend, layout = stored
    logs = []
    for m, ex in managers(backend, layout, num_blocks, host_blocks):
        live, log, n = [], [], 0
        for op in ops:
            n = apply(m, ex, op, live, log, n)
            log.append(seen(m))
        for rid in live:
            m.free(rid)
        log.append(seen(m))
        logs.append(log)
    assert logs[0] == logs[1]


def apply(m, ex, op, live, log, n):
    """Apply random step ``op`` (``OPS``: a hit or a miss admitted, its fetch run at once;
    a free, fork or rewind of one of the ``live`` requests; a step's ops taken) to
    ``m``, its answers appended to ``log`` (a typed error: its type); returns the next
    request number after ``n``."""
    try:
        if op[0] in ("hit", "miss"):
            rid = f"r{n}"
            n += 1
            got = admitted(m, ex, rid, (STORED if op[0] == "hit" else MISSES)[op[1]])
            if got[-1] is not None and not isinstance(got[-1], StoreWait):
                live.append(rid)
            log.append(got)
        elif op[0] == "step":
            log.append(m.take_kv_ops())
        elif live:
            rid = live[op[1] % len(live)]
            if op[0] == "free":
                m.free(rid)
                live.remove(rid)
            elif op[0] == "fork":
                child = f"r{n}"
                n += 1
                got = m.fork(rid, child)
                if got is not None:
                    live.append(child)
                log.append(got)
            else:
                m.rewind(rid, min(op[2], m.num_scheduled_tokens(rid)))
    except PrefixKVError as e:  # (the same typed error from both)
        log.append(type(e))
    return n


def test_a_run_landing_from_the_first_block_leaves_other_pending_runs_pending(stored):
    """The landing of a run from the first block asks whether the device holds that
    block's content now (``holds``): no pending run's block can (none is a first block
    or in a dict), so none is written (it wrote every pending run)."""
    backend, layout = stored
    runs = []

    def scenario(m, ex, log):
        log.append((hit(m, ex, "a", STORED[0]), seen(m)))
        first = _landed(m)
        log.append((hit(m, ex, "b", STORED[2]), seen(m)))
        if m._index.pending_runs:
            runs.append((len(first), len(_landed(m)), all(r in _landed(m) for r in first)))
        m.free("a")
        m.free("b")
        log.append(seen(m))

    both(backend, layout, scenario, num_blocks=24, host_blocks=20)
    assert runs == [(1, 2, True)]


def test_an_uncache_elsewhere_leaves_a_landed_runs_fetch_its_blocks(backend, layout):
    """``p``'s run landed (one pending run, held by the fetch until ``p`` comes back);
    another request's block is found invalid. The fetch gives up only blocks that lost
    their content, and the landed run's did not: it stays pending (``uncache`` writes the
    runs it reads alone), and its blocks, with no key yet, are not taken for lost ones
    (before: the fetch gave up all but the run's head, and the re-admission counted 4 of
    its 24 tokens as store hits)."""
    kept = []

    def scenario(m, ex, log):
        assert isinstance(m.add_request("p", P), StoreWait)
        ex.run()
        assert m.poll_store() == ["p"]
        f = m._waits.waiting["p"]
        x = m.add_request("x", list(range(900, 909)), read_cache=False)
        m.uncache_blocks([x.block_ids[0]])
        log.append((f.on_device, seen(m)))
        if m._index.pending_runs:
            kept.append(len(_landed(m)))
        log.append((m.add_request("p", P), m.stats.store_hits, seen(m)))

    log, _ = both(backend, layout, scenario)
    assert log[0][0] == 6 and log[1][1] == 24
    assert kept == [1]
