"""A store fetch's start that evicts a pending run whole leaves each of its blocks'
``counted`` as it was (``BlockPool.take(n, stale=True)``: the run is evicted, its count
1, each block's as taken): the start clears it on the blocks it takes for host hits and
for the tokens after the run, the fetcher on the run's blocks it fills
(``fill_pending``, ``fill_device``), and every path that gives those blocks back unfilled
clears it first (a failed or lost fetch's landing, an executor that refuses the fetch).
Each test runs its steps on two managers over the same store, one landing pending runs,
one writing each block (the index's ``pending_runs`` off), and requires the same answers,
plans, free order and host slots at every step, and sound invariants, fetches in flight
included. Block size 4, 8-byte payloads."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import PrefixKVError, StoreWait

from . import test_landed_pending as landed
from .test_landed_pending import MISSES, STORED, apply, seen, store_all
from .test_store_fetch import Manual

X = list(range(900, 909))                         # two full blocks + 1: a miss


@pytest.fixture
def stored(backend, layout):
    """The store holding the blocks of each of ``STORED``."""
    return store_all(backend, layout)


class Refusing(Manual):
    """``Manual``, refusing what is submitted while ``refuse`` is set (an executor shut
    down)."""

    def __init__(self):
        super().__init__()
        self.refuse = False

    def submit(self, fn, *args):
        if self.refuse:
            raise RuntimeError("cannot schedule new futures after shutdown")
        super().submit(fn, *args)


def managers(backend, layout, num_blocks, host_blocks):
    """Two managers over the store, pending runs on, then off, with ``Refusing``
    executors."""
    return landed.managers(backend, layout, num_blocks, host_blocks, Refusing)


def stale(m):
    """The blocks of ``m`` whose ``counted`` names a run evicted whole (``take``'s
    ``stale``): held by a fetch in flight, each counted 1."""
    out = [b for b in m._pool.blocks if b.counted is not None and b.counted.ok == -1
           and not b.counted.shared]
    assert all(b.ref_cnt == 1 and b.refs == 1 for b in out), out
    return out


def test_a_store_start_evicting_a_landed_run_whole_leaves_its_counts_to_the_fetcher(stored):
    """S0 (five blocks after its first) lands as a pending run and is freed; S2's start
    (eight blocks) evicts it whole: in flight, the blocks it takes for its run still name
    S0's run (counted 1, as the fetch holds each), the one it takes for the tokens after
    the run not; the fetcher writes each; S2 lands, is admitted and freed, S0 is found in
    the host tier as before."""
    backend, layout = stored
    logs, kept = [], []
    for m, ex in managers(backend, layout, 10, 16):
        log = [m.add_request("a", STORED[0])]
        ex.run()
        log += [m.poll_store(), m.add_request("a", STORED[0]), seen(m)]
        m.free("a")
        runs = [r.blocks for r in m._index.run_counts.pending]
        log += [seen(m), m.add_request("b", STORED[2])]
        assert isinstance(log[-1], StoreWait), log[-1]
        f = m._waits.waiting["b"]
        if m._index.pending_runs:
            got = stale(m)
            kept.append(len(got))
            assert set(map(id, got)) <= set(map(id, f.devices)), (got, f.devices)
            assert [f.devices is r for r in runs] == [True]   # S0's own list: not copied
        else:
            assert not stale(m)
        log.append(seen(m))                       # (the checks read the stale blocks' counts)
        ex.run()
        assert not stale(m)
        log += [m.poll_store(), seen(m), m.add_request("b", STORED[2]), seen(m)]
        m.free("b")
        log += [seen(m), m.add_request("c", STORED[0]), seen(m)]
        m.free("c")
        log.append(seen(m))
        logs.append(log)
    assert logs[0] == logs[1]
    assert kept == [4], kept                      # (S0's fifth block is the tail's)


def test_a_start_evicting_cached_blocks_then_a_landed_run_whole_takes_them_all(stored):
    """X (two full blocks and one token) is computed and freed, then S0 lands as a
    pending run and is freed: the cached tier holds X's blocks 1, 0, then S0's run 7..3
    (its head, 2, last). S2's start takes the empty blocks 8, 9, then evicts X's two and
    S0's run whole (kept ``stale``, after two other blocks of the same eviction): the
    fetch holds all nine blocks, in the free order, the run's list the eviction's (S0's
    own, X's blocks moved in before it); it lands, and S0 is found again as before."""
    backend, layout = stored
    logs, held = [], []
    for m, ex in managers(backend, layout, 10, 16):
        log = [landed.admitted(m, ex, "x", X), seen(m)]
        m.free("x")
        log += [landed.admitted(m, ex, "a", STORED[0]), seen(m)]
        m.free("a")
        log.append(seen(m))
        assert m.free_block_order() == [8, 9, 1, 0, 7, 6, 5, 4, 3, 2]
        runs = [r.blocks for r in m._index.run_counts.pending]
        log.append(m.add_request("b", STORED[2]))
        assert isinstance(log[-1], StoreWait), log[-1]
        f = m._waits.waiting["b"]
        assert [b.block_id for b in f.devices + f.tail] == [8, 9, 1, 0, 7, 6, 5, 4, 3]
        if m._index.pending_runs:
            held.append(sorted(b.block_id for b in stale(m)))
            assert [f.devices is r for r in runs] == [True]   # S0's own list: not copied
        log.append(seen(m))
        ex.run()
        assert not stale(m)
        log += [m.poll_store(), seen(m), m.add_request("b", STORED[2]), seen(m)]
        m.free("b")
        log += [seen(m), landed.admitted(m, ex, "c", STORED[0]), seen(m)]
        m.free("c")
        log.append(seen(m))
        logs.append(log)
    assert logs[0] == logs[1]
    assert held == [[4, 5, 6, 7]], held            # (S0's block 3 is the tail's)


@pytest.mark.parametrize("refuse", [True, False])
@pytest.mark.parametrize(("num_blocks", "prompt"), [(10, STORED[2]), (11, MISSES[0])])
def test_a_refused_or_empty_fetch_gives_back_the_stale_blocks_cleared(stored, refuse,
                                                                      num_blocks, prompt):
    """The start that evicted the landed run whole has its fetch refused by the executor
    (shut down: given back at once), or, for a prompt the store does not hold, finds
    nothing (given back at its landing): either way the blocks go back to the pool with
    their ``counted`` cleared, each counted alone."""
    backend, layout = stored
    logs, kept = [], []
    for m, ex in managers(backend, layout, num_blocks, 16):
        log = [m.add_request("a", STORED[0])]
        ex.run()
        log += [m.poll_store(), m.add_request("a", STORED[0])]
        m.free("a")
        ex.refuse = refuse
        log += [seen(m), m.add_request("b", prompt)]
        ex.refuse = False
        assert isinstance(log[-1], StoreWait) != refuse, log[-1]  # (refused: computed)
        if m._index.pending_runs:
            kept.append(len(stale(m)))
        log.append(seen(m))
        if not refuse:
            ex.run()
            log += [m.poll_store(), seen(m), m.add_request("b", prompt), seen(m)]
        assert not stale(m)
        m.free("b")
        assert all(b.counted is None or b.counted.shared for b in m._pool.blocks)
        log += [seen(m), m.add_request("c", STORED[0]), seen(m)]
        m.free("c")
        log.append(seen(m))
        logs.append(log)
    assert logs[0] == logs[1]
    assert kept == [0] if refuse else kept[0] >= 4, kept


STARTS = STORED + MISSES
OPS = st.lists(st.one_of(
    landed.STEPS,
    st.tuples(st.sampled_from(["start", "refused"]), st.integers(0, 5)),
    st.tuples(st.just("run")),
    st.tuples(st.just("fill")),  # (the fetches run, landed at a later step's poll)
    st.tuples(st.just("leave"), st.integers(0, 7))), min_size=1, max_size=24)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, num_blocks=st.integers(10, 16), host_blocks=st.integers(4, 20))
# the start's stale blocks, each found by a random search (the random steps reach them
# rarely; which block a start takes for what may depend on the order of sets of
# objects: these were seen to repeat): the block taken for the tokens after the run...
@example(ops=[("free", 5), ("free", 0), ("free", 3), ("hit", 2), ("free", 4), ("hit", 1),
              ("free", 2), ("run",), ("hit", 0)], num_blocks=11, host_blocks=18)
# ...the run's first block, filled as the head of a pending run...
@example(ops=[("start", 3), ("leave", 0), ("run",), ("hit", 2), ("free", 1), ("hit", 1),
              ("start", 0), ("run",)], num_blocks=12, host_blocks=18)
# ...run blocks filled one by one (``fill_device``)...
@example(ops=[("hit", 2), ("free", 3), ("leave", 2), ("free", 2), ("start", 5), ("start", 4),
              ("run",)], num_blocks=13, host_blocks=20)
# ...and a block taken for a host hit before the run (``up``)
@example(ops=[("start", 5), ("start", 2), ("run",), ("leave", 2), ("run",), ("run",),
              ("hit", 1), ("free", 5), ("start", 5), ("start", 4)], num_blocks=15,
         host_blocks=20)
def test_random_steps_with_fetches_in_flight_agree_with_pending_runs_on_and_off(
        stored, ops, num_blocks, host_blocks):
    """Starts of fetches (stored prompts and misses) left in flight while requests are
    freed, forked and rewound, and waits leave; fetches run and land together (or run in
    one step and land in a later one), their requests admitted again; executors refuse:
    the pending manager answers as the one that writes each block, with sound
    invariants at every step."""
    backend, layout = stored
    logs = []
    for m, ex in managers(backend, layout, num_blocks, host_blocks):
        live, waiting, log, n = [], {}, [], 0
        for op in ops:
            try:
                if op[0] in ("start", "refused"):
                    rid = f"r{n}"
                    n += 1
                    ex.refuse = op[0] == "refused"
                    got = m.add_request(rid, STARTS[op[1]])
                    ex.refuse = False
                    if isinstance(got, StoreWait):
                        waiting[rid] = STARTS[op[1]]
                    elif got is not None:
                        live.append(rid)
                    log.append(got)
                elif op[0] == "run":
                    ex.run()
                    log.append(m.poll_store())
                    for rid, prompt in list(waiting.items()):
                        got = m.add_request(rid, prompt)
                        if not isinstance(got, StoreWait) and got is not None:
                            del waiting[rid]
                            live.append(rid)
                        log.append(got)
                elif op[0] == "fill":  # (written in this step, landed in a later one:
                    ex.run()  # ``_on_device`` rewrites their steps)
                elif op[0] == "leave":
                    if waiting:
                        rid = list(waiting)[op[1] % len(waiting)]
                        m.free(rid)
                        del waiting[rid]
                else:  # (a hit: the fetch, and any other in flight, run at once)
                    n = apply(m, ex, op, live, log, n)
            except PrefixKVError as e:  # (the same typed error from both)
                log.append(type(e))
            log.append(seen(m))
        for rid in live + list(waiting):
            m.free(rid)
        ex.run()
        log.append(m.poll_store())
        log.append(seen(m))
        assert not stale(m)
        logs.append(log)
    assert logs[0] == logs[1]
