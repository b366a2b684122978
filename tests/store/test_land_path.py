"""A store landing whose run follows device hits the start held (``Fetch.held``) asks
what the device and host hold up to the run's first block: while the index has lost no
content since the start (``Fetch.losses``), it takes the held hits as the walk's and
probes the run's first block alone (``store_landing.land``); else it walks. Both must
give the same landing. Each case runs the same steps on two managers over the same
store, one as shipped, one whose fetches always walk (their ``losses`` stamp spoiled
after every call), and requires the same answers, fetches, waits, host slots, plans,
events and free order after every step, and sound invariants (``test_start_path``'s
steps and comparison: starts, fetches run and polled in any order, other requests
admitted between a start and its landing, steps, frees, preemptions, uncached blocks).
A real Redis (conftest), block size 4, 8-byte payloads."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixkv import StoreWait
from prefixkv.core import store_landing

from .test_landing_gaps import IMAGE, _manager
from .test_readmit_path import stored  # noqa: F401 (a fixture)
from .test_shared_store import A
from .test_start_path import ROTATION, START, call, seen, steps, twin
from .test_store_fetch import setup


def walking(m):
    """Spoil the stamp of ``m``'s waiting fetches: their landings walk."""
    for f in m._waits.waiting.values():
        f.losses = -2


def run(stored, num_blocks, todo, host_blocks=8, events=False, pending=True):  # noqa: F811
    (m1, ex1, p1), (m2, ex2, p2) = (twin(*stored, num_blocks, host_blocks, events, pending,
                                         False) for _ in range(2))
    for step in todo:
        one = call(m1, ex1, p1, step)
        two = call(m2, ex2, p2, step)
        walking(m2)
        assert one == two, step
        assert seen(m1) == seen(m2), step
    assert m1.take_kv_ops() == m2.take_kv_ops()
    assert m1.take_events() == m2.take_events()


# (another request between the start and the landing computes the block before the run,
# or the run's first block: prompt 2 is BASE's first two blocks and a token)
MEANWHILE = [("add", "a", 0, "prompt"), ("step",), ("run",), ("poll",),
             ("add", "a", 0, "prompt"), ("free", "a"), ("step",), ("add", "a", 0, "prompt"),
             ("add", "b", 2, "ids"), ("step",), ("run",), ("poll",), ("add", "a", 0, "prompt"),
             ("step",)]


@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=MEANWHILE)
@example(num_blocks=16, host_blocks=8, events=True, pending=True, todo=MEANWHILE)
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=[
    ("add", "b", 2, "ids"), ("add", "a", 0, "prompt"), ("run",), ("poll",),
    ("add", "a", 0, "prompt")])                             # device hits before the run
@example(num_blocks=14, host_blocks=7, events=True, pending=False, todo=ROTATION)
@example(num_blocks=16, host_blocks=8, events=False, pending=True, todo=START)
@given(todo=steps, events=st.booleans(), pending=st.booleans(),
       num_blocks=st.sampled_from([8, 10, 12, 14, 16, 24]), host_blocks=st.sampled_from([3, 7, 8, 12]))
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_the_landings_probe_lands_as_its_walk(stored, num_blocks, host_blocks,  # noqa: F811
                                              events, pending, todo):
    run(stored, num_blocks, todo, host_blocks, events, pending)


def test_the_rotation_lands_without_the_walk(stored, monkeypatch):  # noqa: F811
    """Not a test that cannot fail: in bench_store.py's steady state (a host hit before
    the run, gone up at the start) the shipped side's landings after the first probe
    (no walk up to the run), and the walking side's walk; the same landings."""
    walks = []

    def spy(self, *args, **kw):
        walks.append(self)
        return match(self, *args, **kw)

    index_type = type(twin(*stored, 14, 7, False, True, False)[0]._index)
    match = index_type.match
    monkeypatch.setattr(index_type, "match", spy)
    landed = []
    land = store_landing.land

    def spy_land(f, *args):
        before = len(walks)
        out = land(f, *args)
        landed.append((f.losses, len(walks) - before))  # (the stamp: -2 the walking side's)
        return out

    monkeypatch.setattr("prefixkv.core.store_waits.land", spy_land)
    run(stored, 14, ROTATION, 7)
    probed = [n for stamp, n in landed if stamp >= 0]
    walked = [n for stamp, n in landed if stamp == -2]
    assert len(probed) == len(walked) == 6 and sum(probed) < sum(walked)


def test_a_run_whose_first_content_another_fetch_landed_in_slots_lands_past_it(backend, layout):
    """Block 0 on the device (held by the start), blocks 1-2 fetched; before the landing
    another fetch of the same blocks, short of device blocks, lands them in host slots
    alone, and nothing was evicted: the landing takes the held hit unwalked, and its
    probe of the run's first block finds the slot; the run lands nowhere, the device
    blocks go back, and the slots keep blocks 1-2 (the twin fixtures cannot order two
    fetches so: their executor runs every job)."""
    m, ex, _ = setup(backend, layout, host_blocks=6)
    m.add_request("d", A[:5], read_cache=False)      # d holds block 0
    m.add_request("e", list(range(100, 109)), read_cache=False)    # e holds 3 blocks
    m.take_kv_ops()
    assert m.add_request("b", A).num_blocks == 2
    f = m._waits.waiting["b"]
    (b0,) = f.held
    assert len(f.devices) == 2 and m.num_free_blocks == 0
    assert m.add_request("c", A).num_blocks == 2     # the pool short: slots alone
    g = m._waits.waiting["c"]
    assert g.devices is None and g.held == []
    while mine := [j for j in ex.jobs if any(a is g for a in j[1])]:  # c's fetch (and
        ex.jobs.remove(mine[0])                      # its parts) ends first
        mine[0][0](*mine[0][1])
    assert m.poll_store() == ["c"]
    assert m.lookup(A) == 12 and m.lookup_block_ids(A) == (b0.block_id,)
    m.check_invariants()
    assert f.losses == m._index.losses               # (no loss: the probe, not the walk)
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.devices is None and f.on_device == 0 and m.lookup(A) == 12
    assert m.lookup_block_ids(A) == (b0.block_id,)
    m.free("e")
    for rid in ("b", "c"):
        adm = m.add_request(rid, A)
        assert adm.num_cached_tokens == 12 and adm.block_ids[0] == b0.block_id
        m.check_invariants()
    for rid in ("b", "c", "d"):
        m.free(rid)
        m.check_invariants()


def test_a_multimodal_runs_blocks_computed_meanwhile_are_not_landed_twice(backend, layout):
    """Block 0 of A (no image in it) held on the device, blocks 1-2 under an image
    fetched; before the landing, with nothing evicted, another request computes blocks
    1-2 with the image: a probe with the prompt's base extra bytes would miss them (their
    keys carry the image) and land the run beside them; the landing walks with each
    block's own extra keys and lands nothing. Two slots: the fetch reserves both, so
    c's admission starts none."""
    m, ex = _manager(backend, layout, extra=IMAGE, host_blocks=2)
    m.add_request("d", A[:5], read_cache=False)      # d holds block 0
    m.take_kv_ops()
    assert m.add_request("b", A, extra=IMAGE) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    (b0,) = f.held
    assert f.devices is not None
    c = m.add_request("c", A, extra=IMAGE)           # hits block 0, computes blocks 1-2
    assert c.num_cached_tokens == 4
    mine = m.get_block_ids("c")
    m.take_kv_ops()
    m.take_kv_ops()
    assert f.losses == m._index.losses               # (nothing evicted since the start)
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.devices is None and m.lookup_block_ids(A, extra=IMAGE) == (b0.block_id, *mine[1:3])
    adm = m.add_request("b", A, extra=IMAGE)
    assert adm.num_cached_tokens == 12 and adm.block_ids[:3] == (b0.block_id, *mine[1:3])
    m.check_invariants()
