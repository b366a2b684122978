"""A store run that lands on the device is copied in by the landing step's plan (its
loads out of the slots), so its blocks count as recorded in that step: an eviction in
it neither offloads them (their KV is not there yet) nor leaves their loads in the plan.
The fetcher writes the blocks with the manager's step as it is then (``fetch_ready``),
the landing's in the common case (a fetch ends while the engine runs a step and is
landed at the next ``poll_store``); the landing rewrites each block's step only when a
step ended between the two (issue 25: a loop over the whole run on the scheduler's
thread, +42 us at 2048 blocks, whenever a step passed while the fetch ran). Block size
4; A's three blocks in the store."""

import threading

import pytest

from prefixkv import BlockLoads, BlockOffloads
from waiting import PATIENCE

from .test_shared_store import A
from .test_store_fetch import setup


def test_the_fetcher_writes_the_blocks_with_the_step_it_runs_in(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A).num_blocks == 3
    f = m._waits.waiting["b"]
    started = m._index.step
    m.take_kv_ops()                                  # a step ends while the fetch runs
    assert m._index.step == started + 1
    ex.run()
    assert f.step == m._index.step                   # the step the blocks were written in
    assert [b.step for b in f.devices] == [m._index.step] * 3
    assert m.poll_store() == ["b"]
    assert [b.step for b in f.devices] == [m._index.step] * 3
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_run_landed_a_step_after_it_was_written_is_rewritten_at_the_landing(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A).num_blocks == 3
    f = m._waits.waiting["b"]
    ex.run()
    m.take_kv_ops()                                  # a step ends before the landing
    assert f.step == m._index.step - 1
    assert m.poll_store() == ["b"]
    assert [b.step for b in f.devices] == [m._index.step] * 3
    m.check_invariants()


@pytest.mark.parametrize("step_at", ["before the fetch", "after the fetch", "none"])
def test_a_run_evicted_in_its_landing_step_is_not_offloaded_and_its_loads_leave(
        backend, layout, step_at):
    """The fetch's request left, so the landed run goes back to the pool cached at the
    landing; a miss then evicts it in the same step: no offload reads its blocks, no
    load writes them."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A).num_blocks == 3
    f = m._waits.waiting["b"]
    devices = list(f.devices)
    landed = {b.block_id for b in devices}
    if step_at == "before the fetch":
        m.take_kv_ops()
    ex.run()
    if step_at == "after the fetch":
        m.take_kv_ops()
    m.free("b")                                      # left while it waited
    assert m.poll_store() == []
    assert m.lookup_block_ids(A) == tuple(b.block_id for b in devices)   # cached, findable
    m.check_invariants()
    assert m.add_request("z", list(range(100, 129)), read_cache=False).num_new_tokens == 29
    m.check_invariants()
    ops = m.take_kv_ops()
    offloaded = {i for op in ops if isinstance(op, BlockOffloads) for i in op.src}
    loaded = {i for op in ops if isinstance(op, BlockLoads) for i in op.dst}
    assert not offloaded & landed and not loaded & landed, ops
    m.check_invariants()


class PausedStep:
    """The manager's content index as the fetcher sees it (``Fetch.index``), whose
    ``step`` the fetcher's first read returns as it was, then waits until the test says
    go: a step ends between the fetcher's (unlocked) read and its writes of the blocks."""

    def __init__(self, index):
        self.index, self.read, self.go = index, threading.Event(), threading.Event()
        self.seen = None

    @property
    def step(self):
        value = self.index.step
        if self.seen is None:
            self.seen = value
            self.read.set()
            assert self.go.wait(PATIENCE)
        return value


@pytest.mark.parametrize("leaves", [False, True])
def test_a_step_ending_between_the_fetchers_read_and_its_writes(backend, layout, leaves):
    """The fetcher reads ``index.step`` without a lock (``fetch_ready``); the engine's
    thread ends a step after that read and before the blocks are written with it. The
    blocks are then written with a stale step, and not yet findable (the first one has
    no key); the landing, on the engine's thread after the fetch is queued as done,
    writes them its own step. So they are neither offloaded nor evicted with stale KV in
    the landing step (``leaves``: the request left, the run is cached, a miss evicts it
    then), and the request is served what landed."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A).num_blocks == 3
    f = m._waits.waiting["b"]
    devices = list(f.devices)
    landed = {b.block_id for b in devices}
    paused = f.index = PausedStep(m._index)
    fetcher = threading.Thread(target=ex.run)
    fetcher.start()
    try:
        assert paused.read.wait(PATIENCE)            # the fetcher read the step ...
        m.take_kv_ops()                              # ... a step ends ...
        assert m.lookup_block_ids(A) == ()           # (nothing findable meanwhile)
    finally:
        paused.go.set()                              # ... then it writes the blocks
        fetcher.join(PATIENCE)
    assert not fetcher.is_alive() and len(m._store.done) == 1
    assert f.step == paused.seen == m._index.step - 1
    assert [b.step for b in devices] == [m._index.step - 1] * 3   # stale, as read
    assert m.lookup_block_ids(A) == ()               # still unfindable: not landed
    if leaves:
        m.free("b")
    assert m.poll_store() == ([] if leaves else ["b"])
    assert [b.step for b in devices] == [m._index.step] * 3       # the landing's step
    m.check_invariants()
    if leaves:
        assert m.lookup_block_ids(A) == tuple(b.block_id for b in devices)
        m.add_request("z", list(range(100, 129)), read_cache=False)   # evicts the run
        ops = m.take_kv_ops()
        offloaded = {i for op in ops if isinstance(op, BlockOffloads) for i in op.src}
        loaded = {i for op in ops if isinstance(op, BlockLoads) for i in op.dst}
        assert not offloaded & landed and not loaded & landed, ops
    else:
        assert m.add_request("b", A).num_cached_tokens == 12
        (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
        assert loads.dst == tuple(b.block_id for b in devices)
    m.check_invariants()
