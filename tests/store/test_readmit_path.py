"""The re-admission after a store fetch that landed whole on the device (the start's
Prompt object, every other argument its default) takes its own short path
(``core/store_readmit.py``, ``_readmit``): it must do exactly what the general path
(``_admit``) does. Each case runs the same steps on two managers over the same store,
one as shipped, one whose ``_readmit`` hands every call to ``_admit``, and requires
the same answers, raises, block ids, request fields, stats, waits, host slots, plans
and free order after every step, and sound invariants. Hypothesis draws the steps:
starts and re-admissions (prepared, token ids, a tuple, None, or arguments that leave
the short path), fetches run and polled in any order, frees, uncached blocks, other
requests taking the same prefix meanwhile. A real Redis (conftest), block size 4, 8-byte
payloads."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import Admission, KVCacheManager, StoreWait
from prefixkv.core import store_readmit, store_reuse
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_landed_pending import managers
from .test_shared_store import computed

BASE = list(range(100, 125))                       # six full blocks + 1
OTHERS = [list(range(200, 225)), list(range(300, 325)), list(range(400, 425))]  # stored
MISS = list(range(500, 525))                       # in no store: computed
PROMPTS = [BASE, BASE[:24], BASE[:13], BASE[:8] + [7, 7, 7, 7, 7], BASE[:20] + [3, 3], MISS,
           *OTHERS]
RIDS = ["a", "b", "c"]
HOW = ["prompt", "ids", "tuple", "none", "lookahead", "chunk", "keep", "capped"]

steps = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(RIDS), st.integers(0, len(PROMPTS) - 1),
              st.sampled_from(HOW)),
    st.tuples(st.just("run")), st.tuples(st.just("poll")), st.tuples(st.just("step")),
    st.tuples(st.just("free"), st.sampled_from(RIDS)),
    st.tuples(st.just("uncache"), st.sampled_from(RIDS)),
), max_size=24)


@pytest.fixture
def stored(backend, layout):
    """The store holding the blocks of BASE and OTHERS (and so every prompt's that starts
    with them)."""
    for i, prompt in enumerate([BASE, *OTHERS]):
        computed(KVCacheManager(16, 4, hash_mode="sha256", host_blocks=8,
                                store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                 backend, f"w{i}", prompt)
    return backend, layout


@pytest.fixture
def short(monkeypatch):
    """Whether each call of the short path served its re-admission (``unmoved``)."""
    served = []

    def spy(*args):
        out = store_reuse.unmoved(*args)
        served.append(out)
        return out

    monkeypatch.setattr(store_readmit, "unmoved", spy)
    return served


def general_path(m):
    """``m._readmit`` sending each call to ``_admit``, with the arguments it stands for."""
    def readmit(rid, prompt, f):
        return m._admit(rid, prompt, None, None, False, True, 0, False, 0, None)
    return readmit


def pair(backend, layout, num_blocks, host_blocks):
    """The manager as shipped and one whose re-admissions all take ``_admit``, each with
    its executor and its own Prompt of each of PROMPTS (pending runs on for both)."""
    out = []
    for (m, ex), general in zip(managers(backend, layout, num_blocks, host_blocks),
                                (False, True), strict=True):
        m._index.pending_runs = True
        if general:
            m._readmit = general_path(m)
        out.append((m, ex, [m.prepare(p) for p in PROMPTS]))
    return out


def call(m, ex, prepared, step):
    """Apply ``step``; what it answered (an exception as its type and message)."""
    try:
        if step[0] == "add":
            _, rid, k, how = step
            prompt = {"prompt": prepared[k], "tuple": tuple(PROMPTS[k]),
                      "none": None}.get(how, PROMPTS[k])
            kw = {"lookahead": {"num_lookahead_tokens": 1}, "chunk": {"num_new_tokens": 2},
                  "keep": {"keep_free": 1}, "capped": {"max_hit_tokens": 8}}.get(how, {})
            return answer(m.add_request(rid, prompt, **kw))
        if step[0] == "run":
            return ex.run()
        if step[0] == "poll":
            return m.poll_store()
        if step[0] == "step":
            return m.take_kv_ops()
        if step[0] == "free":
            return m.free(step[1])
        rid = step[1]  # uncache: the request's first block, when it holds one
        blocks = m._requests[rid].blocks if rid in m._requests else []
        return m.uncache_blocks(b.block_id for b in blocks[:1])
    except Exception as exc:
        return type(exc).__name__, str(exc)


def answer(out):
    if isinstance(out, Admission):
        return ("admitted", out.request_id, out.block_ids, out.num_cached_tokens,
                out.num_new_tokens)
    if isinstance(out, StoreWait):
        return "wait", out.request_id, out.num_blocks
    return out


def seen(m):
    """Everything the two paths could leave differently."""
    m.check_invariants()
    waits = m._waits
    requests = {rid: ([b.block_id for b in r.blocks], r.num_cached, r.num_scheduled,
                      r.num_reserved, r.prompt is None, r.prompt_chunks is None,
                      r.prompt_hashes is None, list(r.tokens))
                for rid, r in m._requests.items()}
    fetches = {rid: (f.ended, f.on_device, f.promoted, list(f.cids), len(f.tail),
                     f.blocks is None, f.devices is None, [b.block_id for b in f.held])
               for rid, f in waits.waiting.items()}
    host = sorted((s.block_id, s.key, s.parent_cid, s.content_id) for s in m._host.slots
                  if s.key is not None)
    return (requests, fetches, sorted(b.block_id for b in waits.held.holds()), waits.in_flight,
            waits.reserved, m._stats.total, m.free_block_order(), host, m._num_prefilling)


def run(stored, num_blocks, todo, host_blocks=8):
    (m1, ex1, p1), (m2, ex2, p2) = pair(*stored, num_blocks, host_blocks)
    for step in todo:
        assert call(m1, ex1, p1, step) == call(m2, ex2, p2, step), step
        assert seen(m1) == seen(m2), step
    assert m1.take_kv_ops() == m2.take_kv_ops()


HIT = [("add", "a", 0, "prompt"), ("run",), ("poll",), ("add", "a", 0, "prompt")]
# bench_store.py's rotation: four stored prompts in turn, each hit, freed; by the fifth
# the host keeps the prompt's first block, which goes up at the start (``promote``)
ROTATION = [step for k in (0, 6, 7, 8, 0, 6) for step in (
    ("add", "a", k, "prompt"), ("step",), ("run",), ("poll",), ("add", "a", k, "prompt"),
    ("free", "a"), ("step",))]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(num_blocks=st.sampled_from([10, 14, 16, 24]), host_blocks=st.sampled_from([7, 8]),
       todo=steps)
@example(num_blocks=16, host_blocks=8, todo=HIT)
@example(num_blocks=14, host_blocks=7, todo=ROTATION)
@example(num_blocks=16, host_blocks=8, todo=[
    ("add", "a", 1, "prompt"), ("step",), ("run",), ("poll",), ("add", "a", 1, "prompt"),
    ("step",)])                                                         # a full last block
@example(num_blocks=16, host_blocks=8, todo=[
    ("add", "a", 0, "prompt"), ("run",), ("poll",), ("add", "b", 2, "ids"),
    ("add", "a", 0, "prompt")])
@example(num_blocks=16, host_blocks=8, todo=[
    ("add", "a", 0, "prompt"), ("run",), ("poll",), ("uncache", "b"),
    ("add", "a", 0, "lookahead")])
@example(num_blocks=16, host_blocks=8, todo=[
    ("add", "a", 0, "tuple"), ("run",), ("poll",), ("add", "a", 0, "none"),
    ("add", "a", 0, "prompt")])                # (a start's req.prompt is None, as is None)
def test_the_short_readmission_does_what_the_general_path_does(stored, num_blocks,
                                                              host_blocks, todo):
    run(stored, num_blocks, todo, host_blocks)


@pytest.mark.parametrize(("k", "served"), [(0, [True]), (1, [True]), (2, [True]), (4, [True]),
                                          (3, [])])
def test_a_landed_fetch_is_readmitted_on_the_short_path(stored, short, k, served):
    """Not a test that cannot fail: the short path serves these (and the checks above
    then compare it with ``_admit``), but for a run that did not reach the prompt's
    last full block (PROMPTS[3]: the store holds two of its three)."""
    run(stored, 16, [("add", "a", k, "prompt"), ("run",), ("poll",), ("add", "a", k, "prompt")])
    assert short == served


def test_a_readmission_after_a_host_hit_went_up_at_the_start(stored, short):
    """The host's hits before the run counted as host hits (``Fetch.promoted``)."""
    run(stored, 14, ROTATION, 7)
    assert short == [True] * 6


def test_a_readmission_after_another_took_the_prefix_meanwhile(stored, short):
    """Another request admitted between the landing and the re-admission hits the
    fetch's blocks; the re-admission still takes them (both hold them)."""
    run(stored, 16, [("add", "a", 0, "prompt"), ("run",), ("poll",), ("add", "b", 2, "ids"),
                     ("add", "a", 0, "prompt"), ("step",), ("free", "b"), ("free", "a")])
    assert short == [True]
