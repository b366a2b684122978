"""Cases of ``StoreWaits`` no test reached (landing-r21's mutation pass over
``core/store_waits.py``). Block size 4, A's three blocks in the store, 8 device blocks,
fetches run when the test says."""

import pytest

from prefixkv import BlockLoads, ExtraKeysError, StoreWait

from .test_shared_store import A
from .test_store_fetch import block0_on_host, pool_short, setup


def test_a_readmission_the_pool_refuses_gives_the_fetchs_blocks_back_once(backend, layout):
    """A's run landed in blocks 0-2, block 3 taken at the start for the token after it;
    x holds the other four. b's re-admission with 8 lookahead tokens does not fit: the
    fetch gives its blocks back (the run stays cached), its empty block 3 too, and
    forgets them; b, admitted again once x left, walks to the cached run (the fetch's
    blocks are not its own any more) and takes one more block, none given back twice."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert [b.block_id for b in f.devices] == [0, 1, 2] and [b.block_id for b in f.tail] == [3]
    ex.run()
    assert m.poll_store() == ["b"]
    m.take_kv_ops()
    assert m.add_request("x", list(range(100, 113)), read_cache=False).block_ids == (4, 5, 6, 7)
    assert m.num_free_blocks == 0
    assert m.add_request("b", A, num_lookahead_tokens=8) is None
    assert m.num_free_blocks == 4 and not f.tail and m._waits.held.holds() == []
    m.check_invariants()
    m.free("x")
    assert m.num_free_blocks == 8
    adm = m.add_request("b", A)
    assert adm.block_ids == (0, 1, 2, 7) and adm.num_cached_tokens == 12
    assert m.num_free_blocks == 4
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_readmission_walks_when_the_device_got_the_block_after_its_hits(backend, layout):
    """r leaves A's blocks 0-1 cached in device blocks 0-1; b's fetch of block 2 lands
    in slot 0 alone (h holds five blocks); c, admitted before b comes back, loads that
    slot into device block 7. b's re-admission then does not reuse the landed slot
    (``reuse`` asks the device for the block after its own hits, under block 1): it
    walks, and shares c's block 7, loading nothing."""
    m, ex, _ = setup(backend, layout)
    m.add_request("r", A[:9], read_cache=False)
    m.take_kv_ops()
    m.take_kv_ops()
    m.free("r")
    pool_short(m)
    m.take_kv_ops()
    assert m.add_request("b", A) == StoreWait("b", 1)
    f = m._waits.waiting["b"]
    assert [h.block_id for h in f.hits] == [0, 1] and f.devices is None
    ex.run()
    assert m.poll_store() == ["b"]
    m.take_kv_ops()
    m.free("h")
    c = m.add_request("c", A)
    assert c.block_ids[:3] == (0, 1, 7)
    assert [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)] == [BlockLoads((0,), (7,))]
    adm = m.add_request("b", A)
    assert adm.block_ids[:3] == (0, 1, 7) and adm.num_cached_tokens == 12
    assert not [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    m.check_invariants()


class _EqualToAll:
    """Not ExtraKeys, but equal to anything (None included)."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def test_a_readmission_given_extra_keys_of_another_type_raises_as_without_a_fetch(
        backend, layout):
    """b's run landed; its re-admission is given, for ``extra``, an object that is not
    ExtraKeys though it compares equal to b's (None): ExtraKeysError, as a walk raises,
    nothing changed (``reuse`` declines a value of another type before comparing)."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    assert m.poll_store() == ["b"]
    with pytest.raises(ExtraKeysError):
        m.add_request("b", A, extra=_EqualToAll())
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_no_fetch_starts_when_the_only_free_slot_is_the_requests_own_hit(backend, layout):
    """One host slot, holding A's block 0 (cached, unpinned: the tier counts it free).
    b's admission hits it and pins it for its step, which leaves no slot to reserve for
    blocks 1-2: no fetch starts (no wait for nothing), and b is admitted on its hit,
    loaded, computing the rest."""
    m, ex, _ = setup(backend, layout, host_blocks=1)
    block0_on_host(m)
    assert m._host.num_free == 1
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 4 and adm.num_new_tokens == 9
    assert [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)] == [
        BlockLoads((0,), (adm.block_ids[0],))]
    assert ex.jobs == [] and "b" not in m._waits.waiting and m._host.num_landing == 0
    m.check_invariants()


def test_a_readmission_refused_while_its_fetch_runs_leaves_the_run_blocks_held(
        backend, layout):
    """b's fetch (A's run, into blocks 0-2, block 3 for the token after it) is past its
    deadline at a poll (b computes) but still runs; x holds the other four blocks, and
    b's re-admission with 8 lookahead tokens does not fit. Block 3 goes back, but the
    run's blocks stay the fetch's until it lands (its fetcher may be writing them: a
    block given back could be x's by then); once it lands, b finds the run cached."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    deadline, f.deadline = f.deadline, -1.0
    assert m.poll_store() == ["b"] and f.expired and not f.ended
    f.deadline = deadline                            # (the fetcher's reads: in time)
    assert m.add_request("x", list(range(100, 113)), read_cache=False).block_ids == (4, 5, 6, 7)
    assert m.add_request("b", A, num_lookahead_tokens=8) is None
    assert m.num_free_blocks == 1 and [b.block_id for b in m._waits.held.holds()] == [0, 1, 2]
    m.check_invariants()
    ex.run()
    assert m.poll_store() == []
    m.check_invariants()
    m.free("x")
    assert m.lookup_block_ids(A) == (0, 1, 2) and m.num_free_blocks == 8
    adm = m.add_request("b", A)
    assert adm.block_ids[:3] == (0, 1, 2) and adm.num_cached_tokens == 12
    m.check_invariants()
