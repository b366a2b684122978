"""A store start of a prepared prompt (this manager's Prompt, no extra keys, every other
argument its default, a new id with no fetch waiting) takes its own short path
(``core/store_start.py``, ``_start``): it must do exactly what the general path
(``_admit``) does. Each case runs the same steps on two managers over the same store,
one as shipped, one whose ``_start`` hands every call to ``_admit``, and requires the
same answers, raises, block ids, request fields, stats, fetches (slots, held, run and
tail blocks, content ids planned, the chain it continues), waits, host slots, plans,
events and free order after every step, and sound invariants; each fetch then lands,
is re-admitted, fails, is refused or outlives its request on both alike. Hypothesis
draws the steps: starts (prepared, token ids, a tuple, arguments that leave the short
path), fetches run and polled in any order, steps, frees, preemptions, uncached
blocks, an executor that refuses (shut down), a cost rule that says no. A real Redis
(conftest), block size 4, 8-byte payloads."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import Admission, KVCacheManager
from prefixkv.core import store_start
from prefixkv.store import FetchCost, SharedStore
from waiting import LIVE

from .conftest import always
from .test_readmit_path import BASE, RIDS, answer, stored  # noqa: F401 (a fixture)
from .test_readmit_path import PROMPTS as READMIT_PROMPTS
from .test_readmit_path import call as readmit_call
from .test_store_machine import Manual

PROMPTS = [*READMIT_PROMPTS, BASE[:3], BASE[:5]]        # and two of no full block to hit
HOW = ["prompt", "prompt", "ids", "tuple", "none", "lookahead", "chunk", "keep", "capped",
       "nocache"]
ARGS = {"lookahead": {"num_lookahead_tokens": 1}, "chunk": {"num_new_tokens": 2},
        "keep": {"keep_free": 1}, "capped": {"max_hit_tokens": 8}, "nocache": {"read_cache": False}}
ADD = st.tuples(st.just("add"), st.sampled_from(RIDS), st.integers(0, len(PROMPTS) - 1),
                st.sampled_from(HOW))
steps = st.lists(st.one_of(
    ADD, ADD, st.sampled_from([("run",), ("poll",), ("step",)]),
    st.tuples(st.sampled_from(["free", "preempt", "uncache"]), st.sampled_from(RIDS)),
    st.tuples(st.sampled_from(["refuse", "costly"]), st.booleans()),
), max_size=24)


class Executor(Manual):
    """``Manual`` (``refusing``: shut down), whose ``run`` runs every job given."""

    def run(self):
        while self.jobs:
            super().run()


@pytest.fixture
def short(monkeypatch):
    """The answers of each call of the short path (None: it handed the call on)."""
    served = []
    start = store_start._start

    def spy(self, *args):
        out = start(self, *args)
        served.append("Admission" if isinstance(out, Admission) else type(out).__name__)
        return out

    monkeypatch.setattr("prefixkv.core.manager.KVCacheManager._start", spy)
    return served


def general_path(m):
    """``m._start`` sending each call to ``_admit``, with the arguments it stands for."""
    def start(rid, prompt):
        return m._admit(rid, prompt, None, None, False, True, 0, False, 0, None)
    return start


def twin(backend, layout, num_blocks, host_blocks, events, pending, general):
    """A manager over the store (as shipped, or ``general``: its starts all take
    ``_admit``), its executor and its own Prompt of each of PROMPTS."""
    ex = Executor()
    m = KVCacheManager(num_blocks, 4, hash_mode="sha256", host_blocks=host_blocks,
                       enable_events=events, store=SharedStore(
                           backend, layout, cost=always(), timeout=LIVE, executor=ex))
    m._index.pending_runs = pending
    if general:
        m._start = general_path(m)
    return m, ex, [m.prepare(p) for p in PROMPTS]


def call(m, ex, prepared, step):
    """Apply ``step`` (these, and ``test_readmit_path.call``'s others); what it answered
    (an exception as its type and message)."""
    try:
        if step[0] == "add":
            _, rid, k, how = step
            given = {"prompt": prepared[k], "tuple": tuple(PROMPTS[k]), "none": None}
            return answer(m.add_request(rid, given.get(how, PROMPTS[k]), **ARGS.get(how, {})))
        if step[0] == "step":
            return m.take_kv_ops(), m.take_events()
        if step[0] == "preempt":
            return m.preempt(step[1])
        if step[0] == "refuse":
            ex.refusing = step[1]
            m._store.quiet_until = 0.0  # (the store asked again at once)
            return None
        if step[0] == "costly":  # a cost rule that never fetches, or one that always does
            cost = FetchCost(1e12) if step[1] else always()
            m._store._worth = cost.worth_for(m._store.payload, 4)
            return None
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return readmit_call(m, ex, prepared, step)


def ids(blocks):
    return None if blocks is None else [b.block_id for b in blocks]


def seen(m):
    """Everything the two paths could leave differently."""
    m.check_invariants()
    waits = m._waits
    requests = {rid: (ids(r.blocks), r.num_cached, r.num_scheduled, r.num_reserved,
                      r.prompt is None, r.prompt_chunks is None, r.prompt_hashes is None,
                      list(r.tokens))
                for rid, r in m._requests.items()}
    fetches = {rid: (f.first, f.parent, ids(f.slots), ids(f.hits), list(f.hit_cids),
                     f.parent_cid, list(f.planned), f.ids, f.ids_given is not None,
                     ids(f.held), ids(f.front), ids(f.devices), ids(f.tail), f.step,
                     f.pend is not None, f.index is not None, len(f.chunks), f.ended,
                     f.on_device, f.promoted, list(f.cids), ids(f.blocks), f.expired)
               for rid, f in waits.waiting.items()}
    host = sorted((s.block_id, s.key, s.parent_cid, s.content_id, s.refs) for s in m._host.slots
                  if s.key is not None)
    link = m._store
    return (requests, fetches, sorted(b.block_id for b in waits.held.holds()), waits.in_flight,
            waits.reserved, m._stats.total, link.quiet_until > 0,
            m.free_block_order(), host, m._host.num_free, m._num_prefilling)


def run(stored, num_blocks, todo, host_blocks=8, events=False, pending=True):  # noqa: F811
    (m1, ex1, p1), (m2, ex2, p2) = (twin(*stored, num_blocks, host_blocks, events, pending, g)
                                    for g in (False, True))
    for step in todo:
        assert call(m1, ex1, p1, step) == call(m2, ex2, p2, step), step
        assert seen(m1) == seen(m2), step
    assert m1.take_kv_ops() == m2.take_kv_ops()
    assert m1.take_events() == m2.take_events()


START = [("add", "a", 0, "prompt"), ("step",), ("run",), ("poll",), ("add", "a", 0, "prompt"),
         ("step",)]
# bench_store.py's rotation: four stored prompts in turn, each hit, freed; by the fifth
# the host keeps the prompt's first block, which goes up at the start (``promote``)
ROTATION = [step for k in (0, 6, 7, 8, 0, 6) for step in (
    ("add", "a", k, "prompt"), ("step",), ("run",), ("poll",), ("add", "a", k, "prompt"),
    ("free", "a"), ("step",))]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(num_blocks=st.sampled_from([8, 10, 14, 16, 24]), host_blocks=st.sampled_from([3, 7, 8]),
       events=st.booleans(), pending=st.booleans(), todo=steps)
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=START)
@example(num_blocks=14, host_blocks=7, events=False, pending=True, todo=ROTATION)
@example(num_blocks=16, host_blocks=8, events=True, pending=True, todo=[
    ("add", "a", 1, "prompt"), ("step",), ("run",), ("poll",), ("add", "a", 1, "prompt"),
    ("add", "b", 4, "prompt"), ("step",)])                             # a full last block
@example(num_blocks=14, host_blocks=7, events=True, pending=False, todo=ROTATION)
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=[
    ("add", "b", 2, "ids"), ("add", "a", 0, "prompt"), ("run",), ("poll",),
    ("add", "a", 0, "prompt")])                             # device hits before the run
@example(num_blocks=16, host_blocks=3, events=False, pending=True, todo=[
    ("add", "a", 0, "prompt"), ("add", "b", 6, "prompt"), ("add", "c", 7, "prompt")])
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=[
    ("refuse", True), ("add", "a", 0, "prompt"), ("add", "b", 6, "prompt"), ("step",)])
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=[
    ("costly", True), ("add", "a", 0, "prompt"), ("step",)])
@example(num_blocks=8, host_blocks=8, events=False, pending=True, todo=[
    ("add", "b", 5, "prompt"), ("add", "a", 0, "prompt"), ("run",), ("poll",),
    ("add", "a", 0, "prompt")])                       # the pool short: the run in slots alone
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=[
    ("add", "a", 0, "prompt"), ("add", "a", 0, "prompt"), ("free", "a"), ("run",),
    ("poll",), ("add", "a", 10, "prompt"), ("add", "b", 9, "prompt")])
def test_the_short_start_does_what_the_general_path_does(stored, num_blocks, host_blocks,  # noqa: F811
                                                       events, pending, todo):
    run(stored, num_blocks, todo, host_blocks, events, pending)


@pytest.mark.parametrize(("todo", "served"), [
    (START, ["StoreWait"]),
    ([("add", "a", 1, "prompt"), ("run",), ("poll",), ("add", "a", 1, "prompt")],
     ["StoreWait"]),                                         # a full last block: not hit
    ([("add", "a", 5, "prompt")], ["StoreWait"]),  # nothing stored: found at the fetch
    ([("costly", True), ("add", "a", 0, "prompt")], ["Admission"]),  # not worth it
    ([("refuse", True), ("add", "a", 0, "prompt")], ["Admission"]),  # the executor refused
    ([("add", "a", 9, "prompt")], ["Admission"]),                  # no block to hit
    ([("add", "a", 0, "ids"), ("add", "a", 0, "tuple")], []),      # not a Prompt
    ([("add", "a", 0, "chunk"), ("add", "a", 0, "capped")], []),   # not the defaults
])
def test_a_prepared_start_takes_the_short_path(stored, short, todo, served):  # noqa: F811
    """Not a test that cannot fail: the short path serves the prepared starts (and the
    checks above then compare it with ``_admit``), whatever the start answers, and no
    other call."""
    run(stored, 16, todo)
    assert short == served


def test_the_rotation_takes_the_short_path(stored, short):  # noqa: F811
    """bench_store.py's steady state (a host hit before the run, which goes up at the
    start; pending runs evicted whole): every start on the short path."""
    run(stored, 14, ROTATION, 7)
    assert short == ["StoreWait"] * 6
