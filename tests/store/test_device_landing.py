"""A store fetch that continues device hits (or starts at the first block) lands in the
device blocks its run will occupy: the start takes them (and holds its device hits),
the fetcher fills their content, ``poll_store`` keys the first one after the content
check, and the re-admission takes them as device hits. These tests check what that
must never do: give a request a block whose load has not landed and been checked, let
another request's walk find the run before its first block is keyed, key a run (or
the part of it) that failed the check, or leak a block when the fetch ends late,
never, twice or after its request left. Block size 4, 8-byte payloads, fetches run
when the test says (``Manual``)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixkv import BlockLoads, KVCacheManager, StoreFetched, StoreWait
from prefixkv.store import SharedStore
from prefixkv.store.fetch import REJECTED
from waiting import LIVE

from .conftest import always
from .test_shared_store import A, computed
from .test_store_fetch import Manual, setup


def _keyed(m):
    """Ids of the device blocks that hold content (a key)."""
    return {b.block_id for b in m._pool.blocks if b.key is not None}


def test_the_run_lands_in_device_blocks_held_since_the_start(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    devices = list(f.devices)
    assert len(devices) == 3 and m.num_free_blocks == 4   # held by the fetch, and the tail's
    tail = f.tail[0]                                # (empty: the block after the run)
    assert tail.key is None and tail not in devices
    m.check_invariants()
    ex.run()                                        # filled on the "fetcher's" thread:
    # one pending run after the first block (no key until keyed at the landing), whose
    # last block alone holds its key (``fill_pending``)
    assert [b.key is None for b in devices] == [True, True, False]
    assert [b.counted is f.pending_run for b in devices] == [False, True, True]
    assert m.lookup(A) == 0 and m.lookup_block_ids(A) == ()   # not findable yet
    m.check_invariants()
    assert m.poll_store() == ["b"]
    ops = m.take_kv_ops()
    loads = [op for op in ops if isinstance(op, BlockLoads)]
    assert loads == [BlockLoads(tuple(s.block_id for s in f.slots), tuple(b.block_id for b in devices))]
    assert m.lookup_block_ids(A) == tuple(b.block_id for b in devices)   # on the device now
    m.check_invariants()
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids == (*(b.block_id for b in devices), tail.block_id)
    assert m.stats.store_hits == 12 and m.stats.host_hits == 0
    assert not m.take_kv_ops()                      # nothing to load again
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_the_block_after_the_run_is_taken_at_the_start_for_the_readmission(backend, layout):
    """The start takes, with the run's blocks, the one its request's first token after
    the run opens (empty, held by the fetch): the re-admission takes it with the run
    instead of evicting a block then (issue 25: 18 us of its 73 at a 512-block hit), and
    takes more from the pool when it needs more (lookahead)."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    tail, devices = f.tail[0], list(f.devices)
    assert tail.key is None and tail.ref_cnt == 1 and m.num_free_blocks == 4
    ex.run()
    assert m.poll_store() == ["b"]
    assert sum(b is tail for b in m._waits.held.holds()) == 1
    m.check_invariants()
    adm = m.add_request("b", A, num_lookahead_tokens=4)
    assert adm.num_cached_tokens == 12 and len(adm.block_ids) == 5
    assert adm.block_ids[:4] == (*(b.block_id for b in devices), tail.block_id)
    assert m.num_free_blocks == 3 and not f.tail
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_another_request_never_gets_a_block_before_it_landed(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    f = m._waits.waiting["b"]
    # another request with the same prompt, before the landing: its own wait, none of b's
    # blocks (its start does not find them)
    other = m.add_request("c", A)
    assert isinstance(other, StoreWait)
    g = m._waits.waiting["c"]
    assert not set(map(id, f.devices)) & set(map(id, g.devices))
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["b", "c"]              # both land: c's run lost the race
    m.check_invariants()
    adm_b = m.add_request("b", A)
    adm_c = m.add_request("c", A)
    assert adm_b.num_cached_tokens == adm_c.num_cached_tokens == 12
    assert adm_b.block_ids[:3] == adm_c.block_ids[:3]   # c shares what b's fetch landed
    m.check_invariants()
    m.free("b")
    m.free("c")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_guess_through_a_stale_child_link_misses_a_filled_run(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    f = m._waits.waiting["b"]
    first, second, last = f.devices
    # (a pending run: its last block alone keyed, ``fill_pending``)
    assert first.child is second and second.child is last and last.key is not None
    # a block whose content is the run's parent, as a stale guess would see it: the
    # filled blocks carry fresh content ids, which nothing findable holds
    assert second.parent_cid == first.content_id and last.parent_cid == second.content_id
    assert first.key is None and second.key is None
    assert not {first.content_id, second.content_id} & {
        b.content_id for b in m._pool.blocks if b.key is not None and b not in f.devices}
    assert m.lookup(A) == 0


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_a_run_that_failed_the_check_is_never_keyed(backend, layout, bad):
    puts = computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                                   store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                    backend, "w", A)
    backend.client.set(puts[bad].key, b"not a value")   # block ``bad`` fails its check
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex))
    m.add_request("b", A)
    f = m._waits.waiting["b"]
    devices = list(f.devices)
    ex.run()
    assert f.run == bad and f.stop == REJECTED
    m.check_invariants()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert not _keyed(m) & {b.block_id for b in devices[bad:]}   # the rest never keyed
    # (a run that landed holds the block after it too; none landed, none is held)
    assert m.lookup(A) == 4 * bad and m.num_free_blocks == (7 - bad if bad else 8)
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 4 * bad
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_fetch_whose_request_left_gives_its_blocks_back_cached(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    m.free("b")                                    # left before the fetch ended
    m.check_invariants()
    assert m.num_free_blocks == 4                  # the fetch holds them still
    ex.run()
    assert m.poll_store() == []
    assert m.num_free_blocks == 8                  # given back, its run cached
    m.check_invariants()
    assert m.lookup(A) == 12


def test_a_fetch_whose_request_left_after_the_landing_gives_its_blocks_back(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    assert m.poll_store() == ["b"]
    assert m.num_free_blocks == 4
    m.free("b")
    assert m.num_free_blocks == 8 and m.lookup(A) == 12
    m.check_invariants()


def test_a_fetch_delivered_twice_holds_nothing_twice(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    f = m._store.done[0]
    m._store.done.append(f)
    assert m.poll_store() == ["b"]
    m.check_invariants()
    m.add_request("b", A)
    m._store.done.append(f)
    assert m.poll_store() == []
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_fetch_past_its_deadline_keeps_its_blocks_until_it_ends(backend, layout):
    m, ex, shared = setup(backend, layout, timeout=0.05)
    m.add_request("b", A)
    time.sleep(0.2)
    assert m.poll_store() == ["b"]                  # past the deadline: b computes
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 0
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 5                   # the fetch holds its blocks still (the
    # block after the run went back at the re-admission, which computes)
    ex.run()                                         # (the fetcher returns, late)
    m.poll_store()
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_fetch_that_never_ends_is_the_only_holder_of_its_blocks(backend, layout):
    m, ex, _ = setup(backend, layout, timeout=0.05)
    m.add_request("b", A)
    m.free("b")
    m.check_invariants()                            # the held blocks are the fetch's
    assert m.num_free_blocks == 4 and not m.reset_prefix_cache()


def test_staged_payloads_are_copied_into_slots_then_loaded_into_the_blocks(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    f = m._waits.waiting["b"]
    ex.run()
    m.poll_store()
    ops = m.take_kv_ops()
    kinds = [type(op) for op in ops]
    assert kinds == [StoreFetched] * 3 + [BlockLoads]   # the payloads before the loads
    assert ops[-1].dst == tuple(b.block_id for b in f.devices)


def _first_block_in_a_slot(m):
    """A's first block computed on the device, then evicted into a host slot."""
    m.add_request("d", A[:5], read_cache=False)
    m.take_kv_ops()
    m.free("d")
    m.add_request("z", list(range(100, 129)), read_cache=False)   # evicts it into a slot
    m.take_kv_ops()
    m.free("z")
    m.take_kv_ops()


def test_a_host_hit_before_the_run_goes_up_at_the_start(backend, layout):
    """Block 0 in a slot, blocks 1-2 in the store: the start takes the slot up into a
    device block of the fetch's (its load in the start's step, the block findable and
    held as a device hit), and the run lands after it on the device (store25b-r21: the
    landing no longer takes host hits up)."""
    m, ex, _ = setup(backend, layout)
    _first_block_in_a_slot(m)
    assert m.lookup(A) == 4 and m.lookup_block_ids(A) == ()       # in the host alone
    (slot,) = [s for s in m._host.slots if s.key is not None]
    assert m.add_request("b", A) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    up, devices = list(f.held), list(f.devices)
    assert len(up) == 1 and len(devices) == 2 and f.promoted == 1 and f.front == up
    assert m.lookup_block_ids(A) == (up[0].block_id,)             # on the device now
    m.check_invariants()
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads == BlockLoads((slot.block_id,), (up[0].block_id,))   # in the start's step
    m.check_invariants()
    ex.run()
    joined = f.joined                       # the request's blocks, listed by the fetcher
    assert joined == up + devices
    assert m.poll_store() == ["b"]
    assert f.blocks is joined and f.joined is None   # (the held hits are the start's)
    m.check_invariants()
    assert m.lookup_block_ids(A) == tuple(b.block_id for b in up + devices)
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads.dst == tuple(b.block_id for b in devices)       # the run's alone
    tail = f.tail[0]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12
    assert adm.block_ids == tuple(b.block_id for b in up + devices + [tail])
    assert (m.stats.host_hits, m.stats.store_hits) == (4, 8)
    assert f.blocks is None and f.devices is None and not f.held   # the request's now
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_host_hit_of_a_fetch_the_executor_refuses_goes_up_once(backend, layout):
    """Block 0 in a slot, blocks 1-2 in the store, the executor shut down: the fetch is
    refused, so the admission goes on without it and loads the slot itself; the start
    took nothing up before the executor took the fetch (a block it had filled would
    hold block 0's content beside the admission's own: two device blocks for one content)."""
    refusing = ThreadPoolExecutor(1)
    refusing.shutdown()
    m, _, _ = setup(backend, layout, executor=refusing)
    _first_block_in_a_slot(m)
    (slot,) = [s for s in m._host.slots if s.key is not None]
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 4 and m.stats.store_errors == 1   # the host hit
    m.check_invariants()
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads == BlockLoads((slot.block_id,), (adm.block_ids[0],))   # once
    assert m.lookup_block_ids(A[:5]) == (adm.block_ids[0],)
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_a_host_hit_whose_slot_is_taken_before_the_landing_still_leads_the_run(backend, layout):
    """Block 0 in a slot, blocks 1-2 fetched; after the start's step the slot is taken for
    other offloads (its content dropped from the host) before the fetch ends: the
    block 0 the start took up is held on the device, so the run lands after it and the
    re-admission hits all three blocks (the landing took the slot up before store25b-r21:
    with the slot gone, the run continued nothing, and every block was computed)."""
    m, ex, _ = setup(backend, layout)
    _first_block_in_a_slot(m)
    assert m.add_request("b", A) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    slot, cid = f.hits[0], f.hits[0].content_id
    m.take_kv_ops()                                  # the start's step: the slot unpinned
    for rid, base in (("x", 300), ("y", 400)):       # each evicts cached device blocks
        m.add_request(rid, list(range(base, base + 13)), read_cache=False)
        m.take_kv_ops()
        m.free(rid)
        m.take_kv_ops()
    assert slot.key is None or slot.content_id != cid   # block 0 left the host
    assert m.lookup(A) == 4                          # on the device alone, the fetch's
    m.check_invariants()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.lookup(A) == 12 and f.on_device == 2
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and m.stats.store_hits == 8
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


@pytest.mark.parametrize("lookahead", [0, 4, 8])
def test_the_readmission_takes_the_starts_block_list_and_grows_it(backend, layout, lookahead):
    """A run landed whole on the device: the re-admission's blocks are the list the
    landing made (held hits, run; the start's own list is the run's: store-r17.md) with
    the tail block after it, and more from the pool for a lookahead, with no copy of it
    (``Fetch.blocks``, handed over: issue 25, a 2049-block list copied three times per
    re-admission); the request grows that list as it decodes, and the fetch keeps no
    reference to it."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    tail, devices = f.tail[0], list(f.devices)
    assert f.blocks is None and tail not in devices
    ex.run()
    joined = f.joined                       # listed by the fetcher, where it wrote them
    assert m.poll_store() == ["b"]
    taken = f.blocks
    assert taken is joined and taken == devices and tail not in taken
    adm = m.add_request("b", A, num_lookahead_tokens=lookahead)
    assert m._get("b").blocks is taken and f.blocks is None
    ids = tuple(b.block_id for b in devices + [tail])
    assert adm.num_cached_tokens == 12 and adm.block_ids[:4] == ids
    assert len(adm.block_ids) == 4 + lookahead // 4
    assert m.num_free_blocks == 4 - lookahead // 4
    m.check_invariants()
    m.append_tokens("b", [99] * 8)                    # decode: the list grows in place
    assert m.get_block_ids("b")[:4] == ids and adm.block_ids[:4] == ids
    m.check_invariants()
    m.free("b")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_uncache_blocks_leaves_a_run_being_filled_as_it_is(backend, layout):
    """Before its landing the run holds no findable content (like a free block): an
    ``uncache_blocks`` naming its blocks changes nothing (it once unkeyed the filled
    blocks out of the index's count)."""
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    f = m._waits.waiting["b"]
    ex.run()
    m.uncache_blocks([b.block_id for b in f.devices])
    m.check_invariants()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_readmission_that_finds_the_pool_short_gives_the_fetchs_blocks_back(backend, layout):
    """The engine may leave such a request waiting (or forget it): it holds nothing, its
    run stays cached, and its next admission finds it (found by the tiers' reference
    machine: an engine that dropped the request left the run's blocks held)."""
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    assert m.poll_store() == ["b"]
    m.add_request("h", list(range(50, 66)), read_cache=False)   # the pool's other 4 blocks
    assert m.num_free_blocks == 0
    assert m.add_request("b", A, num_lookahead_tokens=4) is None   # short of a 2nd new block
    assert m.num_free_blocks == 4                    # the run given back, cached; the tail's
    m.check_invariants()
    m.free("h")
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12
    m.free("b")
    assert m.num_free_blocks == 8 and m.reset_prefix_cache()
    m.check_invariants()
