"""The landing's own fills, which no test reached (landing-r21's mutation pass): a run
the fetcher did not fill (its ``ready`` raised, or was never called) lands as the
fetcher's fill would have it land: the same plan (each slot's staged payload, the
loads), the same events, the same blocks for the re-admission; and a run shorter than
its slots (the store holds blocks 0-1 of A's three) is filled by the fetcher, and lands
those two alone. Block size 4, 8-byte payloads, fetches run when the test says."""

import pytest

from prefixkv import BlockLoads, KVCacheManager, StoreFetched, StoreWait
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_shared_store import A, computed, payload
from .test_store_fetch import Manual, pool_short


def _store(backend, layout, stored):
    """The store holds A's first ``stored`` blocks (written by another manager, from
    its blocks 0..stored-1: ``payload(i)`` is block i's KV)."""
    puts = computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                                   store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                    backend, "w", A[:4 * stored + 1])
    assert [p.src for p in puts] == list(range(stored))


def _fetch(backend, layout, where, broken):
    """A manager (8 blocks, 4 slots, events on) whose request b waits on a fetch of A's
    blocks 0-2 that ran; ``where``: the run lands on the device, or in the slots alone
    (another request holds 5 blocks: the pool is short); ``broken``: the fetcher's
    ``ready`` raised before it wrote anything (``StoreLink`` drops the error)."""
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, enable_events=True,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex))
    if where == "slots":
        pool_short(m)
        m.take_kv_ops()
    m.take_events()
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert (f.devices is None) == (where == "slots")
    if broken:
        def ready(f):
            raise RuntimeError("no fill")
        f.ready = ready
    ex.run()
    return m, f


def _landed(m):
    """Poll, then the plan, the events and what b's re-admission gets (its blocks, cached
    tokens, the store's hits)."""
    assert m.poll_store() == ["b"]
    m.check_invariants()
    ops, events = m.take_kv_ops(), m.take_events()
    m.check_invariants()
    if "h" in m._requests:
        m.free("h")
    adm = m.add_request("b", A)
    m.check_invariants()
    return ops, events, adm, m.take_kv_ops(), m.stats.store_hits


BLOCKS = {("device", 3): (0, 1, 2, 3), ("device", 2): (0, 1, 3, 2),   # (3: the tail block,
          ("slots", 3): (5, 6, 7, 4), ("slots", 2): (5, 6, 7, 4)}     # taken at the start)


@pytest.mark.parametrize("stored", [3, 2])
@pytest.mark.parametrize("where", ["device", "slots"])
def test_a_run_the_fetcher_did_not_fill_lands_as_a_filled_one(backend, layout, where, stored):
    """Blocks 0..stored-1 land in slots 0..stored-1, and on the device in blocks
    0..stored-1, loaded at the landing's step; in the slots alone, loaded by the
    re-admission into blocks 5-7. Each slot's staged payload is its block's KV. A run
    the fetcher did not fill: the same plan, events and admission (on main, the
    device's landing left its slots' content ids unwritten: ``check_invariants`` failed
    on the loads)."""
    _store(backend, layout, stored)
    m, f = _fetch(backend, layout, where, broken=False)
    assert f.filled and f.run == stored                # (a shorter run too: by the fetcher)
    ids = [s.block_id for s in f.slots[:stored]]       # (what ``ready`` states for the landing)
    assert f.unique and list(f.slot_ids) == ids and [op.dst for op in f.fetched] == ids
    assert list(f.device_ids) == (ids if where == "device" else [])  # (a device run's: tuples)
    want = _landed(m)
    m, f = _fetch(backend, layout, where, broken=True)
    assert not f.filled and f.run == stored and f.fetched == []
    got = _landed(m)
    assert got == want
    ops, _, adm, then, hits = got
    assert hits == 4 * stored and adm.num_cached_tokens == 4 * stored
    assert adm.block_ids == BLOCKS[where, stored]
    fetched = [op for op in ops if isinstance(op, StoreFetched)]
    assert [(op.dst, bytes(op.payload)) for op in fetched] == [(i, payload(i)) for i in range(stored)]
    (loads,) = [op for op in ops + then if isinstance(op, BlockLoads)]
    assert loads == BlockLoads(tuple(range(stored)), adm.block_ids[:stored])
    assert loads in (ops if where == "device" else then)


def test_a_pending_run_landed_after_a_spare_appeared_lands_chained(backend, layout):
    """The fetcher fills A's device run as one pending run (no spare then, no events:
    ``pend_counts``); before the landing, p and q decode the same block (q's a spare):
    the landing unpends the run and writes it again, each block keyed and chained,
    counted alone, as an index with spares records content."""
    _store(backend, layout, 3)
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex))
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    assert [b.block_id for b in f.devices] == [0, 1, 2] and f.pend is not None
    ex.run()
    assert f.filled and f.pending_run is not None
    m.add_request("p", [50, 51, 52])
    m.add_request("q", [50, 51, 52])
    m.append_step(["p", "q"], [53, 53])
    m.append_step(["p", "q"], [54, 54])              # q's block 5: p's block 4's spare
    assert m._index.pend_counts(None) is None
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.lookup_block_ids(A) == (0, 1, 2) and f.pending_run is None
    assert [(b.key is not None, b.chained, b.counted) for b in f.devices] == [
        (True, False, None), (True, True, None), (True, True, None)]
    m.take_kv_ops()
    m.free("p")
    m.free("q")
    m.check_invariants()
    adm = m.add_request("b", A)
    assert adm.block_ids == (0, 1, 2, 3) and adm.num_cached_tokens == 12
    m.free("b")
    m.check_invariants()
    assert m.lookup_block_ids(A) == (0, 1, 2)


@pytest.mark.parametrize("where", ["device", "slots"])
def test_a_shorter_run_readmitted_in_its_landing_step_gets_its_blocks_alone(
        backend, layout, where):
    """The store holds A's blocks 0-1 of the three fetched: b, admitted again in the
    step its run landed (its slots pinned since), gets those two and computes the
    rest; slot 2, given back empty, is not served."""
    _store(backend, layout, 2)
    m, f = _fetch(backend, layout, where, broken=False)
    assert m.poll_store() == ["b"]
    assert f.slots[2].key is None
    if where == "slots":
        m.free("h")
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 8 and adm.num_new_tokens == 5
    assert m.stats.store_hits == 8
    m.check_invariants()
