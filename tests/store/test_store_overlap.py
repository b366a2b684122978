"""An engine that schedules the next step while this step's copies still run, with host
memory attached to a shared store on a real Redis: a host slot that this step's load
reads must not be reserved by the next step's store fetch (its thread writes the slot at
once) until the engine reports the copies done (``take_kv_ops(pending=True)``,
``kv_ops_done()``)."""

import time
import uuid
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixkv import BlockLoads, BlockOffloads, KVCacheManager, PlanError, StoreWait
from prefixkv.store import SharedStore, StoreLayout
from waiting import PATIENCE, wait_until

from .conftest import always
from .test_shared_store import A, admit, computed, manager

B = list(range(50, 63))                 # another three full blocks + 1
C = list(range(70, 83))


def wait_landed(m, rid):
    deadline = time.monotonic() + PATIENCE
    while rid not in m.poll_store():
        assert time.monotonic() < deadline, "a fetch that never ended"
        time.sleep(0.001)


@pytest.fixture
def loaded(backend, shared):
    """A store holding A, B and C (payload: the writer's block id, repeated: 0-2, 4-6,
    8-10); a manager with
    three host slots, attached, that admitted A from the store and took the step's plan
    (loads from its three slots) with ``pending=True``: the copies run."""
    m1 = manager(shared, num_blocks=16)
    for rid, prompt in (("a", A), ("b", B), ("c", C)):
        computed(m1, backend, rid, prompt)
    m = manager(shared, host_blocks=3)
    memory = [[memoryview(bytearray(8))] for _ in range(3)]
    m.attach_host_memory(memory)
    assert admit(m, "x", A).num_cached_tokens == 12
    (loads,) = [op for op in m.take_kv_ops(pending=True) if isinstance(op, BlockLoads)]
    read = [bytes(memory[s][0]) for s in loads.src]
    assert read == [bytes([i]) * 8 for i in range(3)]
    return m, memory, loads, read


def test_a_slot_a_running_load_reads_is_not_fetched_into(loaded):
    m, memory, loads, read = loaded
    adm = m.add_request("y", B)       # the next step, scheduled while the loads run
    # before: a StoreWait whose fetch reserved the three slots the loads read and wrote
    # B's payloads into them (4, 5, 6) under the running copies
    assert not isinstance(adm, StoreWait) and adm.num_cached_tokens == 0
    assert [bytes(memory[s][0]) for s in loads.src] == read
    m.check_invariants()
    m.kv_ops_done()                   # the copies are done: the slots may be taken
    m.take_kv_ops()
    m.free("y")
    assert isinstance(m.add_request("z", C), StoreWait)
    wait_landed(m, "z")
    assert sorted(bytes(v[0]) for v in memory) == [bytes([i]) * 8 for i in (8, 9, 10)]
    m.check_invariants()


def test_a_slot_hit_again_stays_pinned_for_the_new_plan(loaded):
    """A slot in flight that the next step loads again is that step's pin as well: the
    report of the first plan's copies does not unpin it; the new plan's end does."""
    m, memory, loads, read = loaded
    m.free("x")
    m.kv_ops_done()                                # (A's run is on the device alone: the
    m.take_kv_ops()                                # slots only held its payload)
    m.add_request("v", list(range(110, 139)), read_cache=False)   # 8 blocks: A's go down
    m.take_kv_ops()
    m.free("v")
    assert m.add_request("x1", A).num_cached_tokens == 12 and m.stats.host_hits == 12
    (loads,) = [op for op in m.take_kv_ops(pending=True) if isinstance(op, BlockLoads)]
    m.free("x1")                                   # the loads from A's slots run
    m.add_request("y", B)                          # computed: no slot is free to fetch into
    m.add_request("w", list(range(90, 103)))       # evicts A's device blocks
    m.free("w")
    m.free("y")
    adm = m.add_request("x2", A)                   # A from the slots in flight
    assert adm.num_cached_tokens == 12 and m.stats.host_hits == 24
    m.kv_ops_done()
    assert m._host.num_free == 0                   # pinned for the new plan's loads
    m.check_invariants()
    (again,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert sorted(again.src) == sorted(loads.src) and m._host.num_free == 3
    m.check_invariants()


def test_the_order_of_pending_plans_is_enforced(loaded):
    m = loaded[0]
    with pytest.raises(PlanError, match="kv_ops_done"):
        m.take_kv_ops()               # the previous plan's copies were not reported
    assert m.reset_prefix_cache() is False
    m.kv_ops_done()
    with pytest.raises(PlanError, match="without a plan"):
        m.kv_ops_done()
    m.take_kv_ops()
    m.check_invariants()


def test_a_pending_plan_without_a_host_tier():
    m = KVCacheManager(8, 4, seed=0)
    m.add_request("a", A)
    assert m.take_kv_ops(pending=True) == []
    with pytest.raises(PlanError):
        m.take_kv_ops()
    m.kv_ops_done()
    assert m.take_kv_ops() == []


class PendingPlans(RuleBasedStateMachine):
    """Admissions of prompts the store holds (fetched into attached host slots), frees,
    plans taken pending or not, their copies reported done, fetches left to end. While a
    plan is pending, the host slots it loads from or offloads into keep the bytes they
    had when it was taken (no fetch thread writes them), and the manager's invariants
    hold. ``backend``: the store's server, set by the test.

    Every precondition and every draw reads only what the machine itself did (``made``,
    ``flight``), never what the manager answered: whether an admission was admitted,
    waits or found the pool short can change with timing (a fetch's measured cost, its
    deadline, the threads), and a precondition reading it chose other rules for the
    same draws (Hypothesis's FlakyStrategyDefinition). ``free`` draws a request made and
    not freed yet, and frees it if it was admitted."""

    backend = None
    prompts = [list(range(1000 * k + 1, 1000 * k + 14)) for k in range(4)]

    @initialize()
    def start(self):
        shared = SharedStore(self.backend, StoreLayout(f"t-{uuid.uuid4().hex}", "float32", 8),
                             cost=always(), timeout=10.0)
        writer = manager(shared, num_blocks=16)
        for k, p in enumerate(self.prompts):
            computed(writer, self.backend, f"w{k}", p)
        self.m = manager(shared, num_blocks=8, host_blocks=4)
        self.memory = [[memoryview(bytearray(8))] for _ in range(4)]
        self.m.attach_host_memory(self.memory)
        self.rids: dict[str, int] = {}       # admitted -> prompt index (the manager's answers)
        self.n = 0                           # requests made (the machine's own record:
        self.made: set[str] = set()          # their count, and those not freed by ``free``)
        self.flight: dict[int, bytes] | None = None  # a pending plan's slots' bytes

    @rule(k=st.integers(0, 3))
    def admit(self, k):
        """An engine's admission: a fetch is let end (its thread writes the slots)
        and landed, and the request admitted again."""
        rid = f"r{self.n}"
        self.n += 1
        self.made.add(rid)
        adm = self.m.add_request(rid, self.prompts[k])
        if isinstance(adm, StoreWait):
            link = self.m._store
            wait_until(lambda: len(link.done) >= self.m._waits.in_flight, "the fetch's end")
            self.m.poll_store()
            adm = self.m.add_request(rid, self.prompts[k])
        if adm is not None and not isinstance(adm, StoreWait):
            self.rids[rid] = k
        elif adm is not None:
            self.m.free(rid)                  # (still waiting: a retry would fetch again)

    @precondition(lambda self: self.made)
    @rule(data=st.data())
    def free(self, data):
        """Free a request made and not freed yet, if the manager admitted it."""
        rid = data.draw(st.sampled_from(sorted(self.made)))
        self.made.remove(rid)
        if self.rids.pop(rid, None) is not None:
            self.m.free(rid)

    @precondition(lambda self: self.flight is None)
    @rule(pending=st.booleans())
    def take(self, pending):
        ops = self.m.take_kv_ops(pending=pending)
        if pending:
            slots = {s for op in ops if isinstance(op, BlockLoads) for s in op.src}
            slots |= {s for op in ops if isinstance(op, BlockOffloads) for s in op.dst}
            self.flight = {s: bytes(self.memory[s][0]) for s in slots}

    @precondition(lambda self: self.flight is not None)
    @rule()
    def done(self):
        self.m.kv_ops_done()
        self.flight = None

    @invariant()
    def sound(self):
        if hasattr(self, "m"):
            self.m.check_invariants()
            for s, was in (self.flight or {}).items():
                assert bytes(self.memory[s][0]) == was, f"slot {s} rewritten in flight"


def test_pending_plans_against_fetches_machine(backend):
    PendingPlans.backend = backend
    try:
        run_state_machine_as_test(
            PendingPlans, settings=settings(max_examples=25, stateful_step_count=30, deadline=None))
    finally:
        PendingPlans.backend = None


def test_no_precondition_reads_the_managers_answers():
    """Each rule's preconditions answer alike whatever the manager answered (which
    requests were admitted: ``rids``), for the same rules run (``made``, ``flight``)."""
    rules = PendingPlans.setup_state().rules
    for n in range(3):
        made = {f"r{i}" for i in range(n)}
        for flight in (None, {}):
            answers = []
            for rids in ({}, {"r0": 0}, dict.fromkeys(made, 0)):
                state = SimpleNamespace(n=n, made=made, flight=flight, rids=rids)
                answers.append([all(p(state) for p in r.preconditions) for r in rules])
            assert answers[0] == answers[1] == answers[2], (n, flight, answers)
