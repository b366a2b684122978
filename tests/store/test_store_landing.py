"""How a fetched run lands in host slots. When a slot already holds other content under
the same token bytes (a block of the same tokens after another parent), the fetcher's
map of the run (``Fetch.keyed``) cannot be merged as it is, and the colliding slot is
keyed by its whole content instead; both contents stay findable, each under its own
parent. The landing records the run with its slot ids for a load in the same step
(``HostTier.hold``/``load``), and ``check_invariants`` checks the record. Block size 4,
8-byte payloads; fetches run when the test says."""

import pytest

from prefixkv import BlockLoads, ExtraKeys, InvariantError, MultiModalInput, StoreWait

from .test_shared_store import A
from .test_store_fetch import setup

X = [9, 9, 9, 9, 5, 6, 7, 8, 1]          # in the store: (9 9 9 9) under the root
Y = [1, 2, 3, 4, 9, 9, 9, 9, 0]          # in a host slot: (9 9 9 9) under (1 2 3 4)
Z = list(range(100, 125))                # 7 blocks: pushes Y's last block out of the device
C9 = bytes([9, 0, 0, 0] * 4)             # the token bytes of (9 9 9 9), uint32 little-endian
C5 = bytes([5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 8, 0, 0, 0])


def _manager(backend, layout, host_blocks=4):
    """A manager whose store holds X's two blocks (written by another manager), its
    fetches run when the test says (``Manual.run``), host slots with memory attached."""
    m, ex, _ = setup(backend, layout, X, host_blocks=host_blocks)
    m.attach_host_memory([[memoryview(bytearray(8))] for _ in range(host_blocks)])
    return m, ex


def test_a_run_whose_token_bytes_a_slot_holds_under_another_parent_lands_beside_it(backend, layout):
    m, ex = _manager(backend, layout, 8)   # (h's 5 evicted blocks go to empty slots)
    m.add_request("y", Y, read_cache=False)
    m.take_kv_ops()
    m.free("y")
    m.add_request("z", Z, read_cache=False)          # evicts Y's (9 9 9 9) into slot 0
    assert m.take_kv_ops()[0].dst == (0,)
    m.free("z")
    m.take_kv_ops()
    y = m._host.slots[0]
    assert m._host.by_chunk[C9] is y and m.lookup(Y) == 8   # keyed by its token bytes
    m.add_request("h", list(range(200, 224)), read_cache=False)   # 6 blocks: x's run lands
    m.take_kv_ops()                                                # in slots alone
    assert m.add_request("x", X) == StoreWait("x", 2)  # (9 9 9 9) under the root: a miss
    ex.run()
    f = m._store.done[0]
    a, b = f.slots
    assert f.run == 2 and f.unique and f.keyed == {C9: a, C5: b}
    assert m.poll_store() == ["x"]
    m.check_invariants()
    assert m._host.by_chunk[C9] is y                 # Y's keeps the token bytes' entry
    assert a.key == (0, C9, b"") and m._host.by_key[a.key] is a   # X's: its whole content
    assert m._host.by_chunk[C5] is b
    assert m.lookup(Y) == 8 and m.lookup(X) == 8     # both, each under its own parent
    m.free("h")
    adm = m.add_request("x", X)
    assert adm.num_cached_tokens == 8
    assert m.take_kv_ops()[-1] == BlockLoads((a.block_id, b.block_id), tuple(adm.block_ids[:2]))
    m.check_invariants()


def _waiting(backend, layout):
    """A manager whose store holds X's two blocks, and X waiting on their fetch, run."""
    m, ex = _manager(backend, layout)
    # the pool held by another request but for one block: the run lands in host slots
    # alone (not in device blocks: ``test_device_landing``), the slots' landing record
    # is what these tests are about
    m.add_request("h", list(range(200, 228)), read_cache=False)
    assert m.add_request("x", X) == StoreWait("x", 2)
    assert m._waits.waiting["x"].devices is None
    ex.run()
    m.free("h", num_computed_tokens=0)
    return m


def test_a_run_loaded_in_the_step_it_landed_is_neither_pinned_nor_listed_again(backend, layout):
    """The landing records the run with the fetcher's list of its slot ids: the
    re-admission in the same step loads those slots under those ids, and the record
    ends with the step."""
    m = _waiting(backend, layout)
    f = m._store.done[0]
    assert m.poll_store() == ["x"]
    (run, ids), = m._host._landed
    assert run == f.slots and ids == f.slot_ids == [s.block_id for s in f.slots]
    adm = m.add_request("x", X)
    assert adm.num_cached_tokens == 8
    assert all(s.ref_cnt == 1 for s in run)         # pinned since the landing, once
    m.check_invariants()
    assert m.take_kv_ops()[-1] == BlockLoads(tuple(ids), tuple(adm.block_ids[:2]))
    assert m._host._landed == [] and all(s.ref_cnt == 0 for s in run)
    m.check_invariants()


def test_a_run_loaded_a_step_after_it_landed_is_pinned_again(backend, layout):
    """After the step ended (its pins released), the record is gone: the re-admission
    pins the slots itself and lists their ids."""
    m = _waiting(backend, layout)
    f = m._store.done[0]
    assert m.poll_store() == ["x"]
    m.take_kv_ops()                                  # the step ends: the landed slots unpinned
    assert m._host._landed == [] and all(s.ref_cnt == 0 for s in f.slots)
    adm = m.add_request("x", X)
    assert adm.num_cached_tokens == 8
    assert all(s.ref_cnt == 1 for s in f.slots)      # pinned by the load
    m.check_invariants()
    assert m.take_kv_ops()[-1] == BlockLoads(tuple(f.slot_ids), tuple(adm.block_ids[:2]))
    m.check_invariants()


def test_check_invariants_refuses_a_landed_run_record_that_names_other_slots(backend, layout):
    m = _waiting(backend, layout)
    m.poll_store()
    m.check_invariants()
    run, ids = m._host._landed[0]
    m._host._landed[0] = (run, [ids[1], ids[0]])
    with pytest.raises(InvariantError, match="landed in this step"):
        m.check_invariants()


def test_a_run_larger_than_the_host_map_lands_as_the_map(backend, layout):
    """A whole run whose map (``Fetch.keyed``) is larger than the tier's token-bytes map
    becomes that map, the tier's few entries merged into it (no entry of the run's is
    inserted again); the fetch lets go of it. The slots stay findable and are loaded,
    evicted and fetched again as any others."""
    m = _waiting(backend, layout)
    f = m._store.done[0]
    a, b = f.slots
    run_map = f.keyed
    assert run_map == {C9: a, C5: b} and not m._host.by_chunk
    assert m.poll_store() == ["x"]
    assert m._host.by_chunk is run_map and f.keyed is None
    m.check_invariants()
    assert m.lookup(X) == 8
    assert m.add_request("x", X).num_cached_tokens == 8
    m.take_kv_ops()
    m.free("x")
    m.add_request("z", Z, read_cache=False)          # X's blocks leave the device
    m.take_kv_ops()
    m.free("z")
    m.check_invariants()
    assert m.lookup(X) == 8                          # in host slots (kept, or offloaded)


def test_a_multimodal_run_from_the_first_block_lands_beside_the_same_tokens_without_it(
        backend, layout):
    """``land`` asks what the device holds with the request's own extra keys: a run from
    block 0 of a prompt with an image is not the same tokens' text-only blocks that came
    on the device while it was fetched (one probe with the base keys would take them for
    the run and land nothing)."""
    image = ExtraKeys(mm=(MultiModalInput("img", 2, 8),))   # in blocks 0..2
    m, ex, _ = setup(backend, layout, extra=image)
    assert m.add_request("b", A, extra=image) == StoreWait("b", 3)
    m.add_request("t", A, read_cache=False)           # the same tokens without the image
    m.take_kv_ops()
    m.free("t")
    assert m.lookup(A) == 12 and m.lookup(A, extra=image) == 0
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.lookup(A, extra=image) == 12 and m.lookup(A) == 12
    adm = m.add_request("b", A, extra=image)
    assert adm.num_cached_tokens == 12 and m.stats.store_hits == 12
    m.check_invariants()
