"""Cases of the store landing no test reached (landing-r20's mutation pass): a run
landed in host slots leaves them leaves first, as the device's offloads and a hit's
loads do; a run that starts after block 0 of its request (the device, or a host slot,
holds the prefix) with an image whose placeholder starts inside one of its blocks; a
slot whose content went up to a chained device block, found only through the tier's
``up`` guess. Block size 4, A's three blocks in the store (``setup``), fetches run when
the test says."""

import pytest

from prefixkv import (
    BlockLoads,
    BlockOffloads,
    BlockStored,
    ExtraKeys,
    KVCacheManager,
    MultiModalInput,
    StoreFetched,
    StoreWait,
)
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_device_landing import _first_block_in_a_slot
from .test_shared_store import A, computed, payload
from .test_store_fetch import Manual

X = list(range(100, 117))   # four full blocks and one token
Y = list(range(200, 221))   # five full blocks and one token


def _manager(backend, layout, extra=None, host_blocks=4, **kw):
    """A's three blocks in the store (written by another manager, in its blocks 0-2:
    ``payload(i)`` is block i's KV), and a manager with 8 blocks and 4 slots whose
    fetches run when the test says (``host_blocks`` slots)."""
    puts = computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                                   store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                    backend, "w", A, extra=extra)
    assert [p.src for p in puts] == [0, 1, 2]
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=host_blocks,
                       store=SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=ex),
                       **kw)
    return m, ex


def _kv(ops, kv):
    """Run a plan's copies on ``kv`` (("slot" | "block", id) -> KV bytes)."""
    for op in ops:
        if isinstance(op, BlockOffloads):
            kv.update({("slot", d): kv.get(("block", s)) for s, d in zip(op.src, op.dst, strict=True)})
        elif isinstance(op, StoreFetched):
            kv[("slot", op.dst)] = bytes(op.payload)
        elif isinstance(op, BlockLoads):
            kv.update({("block", d): kv[("slot", s)] for s, d in zip(op.src, op.dst, strict=True)})
    return kv


def _by_position(events):
    """Each stored block of A's: its hash, parent hash, token ids and extra keys, by
    position (the same block stored twice, on the device and in a slot: once)."""
    out = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            for i, h in enumerate(ev.block_hashes):
                pos, tokens = ev.first_block + i, ev.token_ids[4 * i:4 * i + 4]
                if tokens == A[4 * pos:4 * pos + 4]:
                    parent = ev.block_hashes[i - 1] if i else ev.parent_block_hash
                    block = (h, parent, tokens, ev.block_extra(i))
                    assert out.setdefault(pos, block) == block
    return out


def _take_one_slot(m):
    """X (computed, freed) makes room for Y: two of X's full blocks are evicted, tail
    first, and offloaded: one into the empty slot, one into the least recently used."""
    m.free("x")
    m.add_request("y", Y, read_cache=False)
    (offloads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockOffloads)]
    assert len(offloads.dst) == 2
    m.check_invariants()
    return offloads.dst


def test_a_run_landed_in_host_slots_leaves_them_leaves_first(backend, layout):
    """A's run lands in three slots alone (X holds five of the 8 blocks: the pool is
    short) while its request left; one slot taken for an offload takes the run's last
    block, as if the device had offloaded A (tail first), not its first, which would
    cut the other two off (withdrawn: A's hit falls from 12 tokens to 0). The device's
    rule: a request releases its tail first, so the pool evicts (and offloads) children
    first; ``HostTier.hold`` unpins loaded slots leaves first for the same reason."""
    m, ex = _manager(backend, layout)
    m.add_request("x", X, read_cache=False)
    m.take_kv_ops()
    m.add_request("b", A)
    f = m._waits.waiting["b"]
    assert f.devices is None                         # in the slots alone
    m.free("b")
    ex.run()
    assert m.poll_store() == []
    m.take_kv_ops()                                  # the plan drained: the run unpinned
    assert m.lookup(A) == 12 and m.lookup_block_ids(A) == ()
    slots = [s.block_id for s in f.slots]
    assert _take_one_slot(m)[1] == slots[2]          # the run's last slot went
    assert m.lookup(A) == 8
    m.free("y")
    m.check_invariants()


def test_a_host_hit_taken_up_at_the_start_is_pinned_until_the_plan_is_taken(backend, layout):
    """Block 0 in a slot, blocks 1-2 fetched: the start takes the slot up into the device
    block it took for it (``store_landing.promote``), its load in the start's plan and
    the slot pinned until that plan is taken (an offload stated meanwhile, which runs
    before the loads, must not write it: block 0 would be loaded with another block's
    KV); the landing loads the run alone, and the re-admission takes block 0's block."""
    m, ex = _manager(backend, layout)
    _first_block_in_a_slot(m)
    (slot,) = [s for s in m._host.slots if s.key is not None]
    assert m.add_request("b", A) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    (up,) = f.held
    assert slot.ref_cnt == 1 and slot in m._host._pinned   # pinned, with its load
    m.check_invariants()
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads == BlockLoads((slot.block_id,), (up.block_id,))
    assert slot.ref_cnt == 0 and slot.key is not None      # the plan taken: unpinned, kept
    ex.run()
    assert m.poll_store() == ["b"]
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert up.block_id not in loads.dst and len(loads.dst) == 2
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[0] == up.block_id
    m.check_invariants()


IMAGE = ExtraKeys(mm=(MultiModalInput("img", 6, 4), MultiModalInput("img2", 10, 2)))
# (tokens 6-9: blocks 1, from its token 2, and 2; tokens 10-11: block 2)


@pytest.mark.parametrize("where", ["device", "slots"])
def test_a_multimodal_run_after_block_0_lands_with_its_blocks_own_extra_keys(backend, layout, where):
    """Block 0 of A (no image in it: the same key with or without one) computed on the
    device by a text-only request; blocks 1-2, under an image whose placeholder starts
    inside block 1, fetched: in the device blocks the start took (``where``: device), or
    in the slots alone (X holds five blocks: the pool is short). The run is findable
    with the image only, its events are those of a manager that computed A with the
    image (hashes, parents, tokens, each block's extra keys), and the readmission's
    blocks 1-2 hold the KV the writer stored for them. (The events' extra keys are
    those of blocks 1-2, tokens 4-11: with those of tokens 0-7, the second image would
    be missing.)"""
    m, ex = _manager(backend, layout, extra=IMAGE, enable_events=True)
    ref = KVCacheManager(8, 4, hash_mode="sha256", enable_events=True)
    ref.add_request("r", A, extra=IMAGE)
    want = _by_position(ref.take_events())
    assert set(want) == {0, 1, 2} and want[0][3] is None and want[1][3] is not None
    m.add_request("t", A[:5], read_cache=False)       # block 0, without the image
    m.take_kv_ops()
    m.free("t")
    if where == "slots":
        m.add_request("x", X, read_cache=False)
    kv = _kv(m.take_kv_ops(), {})
    assert m.lookup(A, extra=IMAGE) == 4 and m.lookup(A) == 4
    assert m.add_request("b", A, extra=IMAGE) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    assert f.first == 1 and (f.devices is None) == (where == "slots")
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.lookup(A, extra=IMAGE) == 12 and m.lookup(A) == 4
    if where == "slots":
        m.free("x")                                   # (room for the readmission)
    adm = m.add_request("b", A, extra=IMAGE)
    assert adm.num_cached_tokens == 12
    kv = _kv(m.take_kv_ops(), kv)
    assert [kv.get(("block", b)) for b in adm.block_ids[1:3]] == [payload(1), payload(2)]
    got = _by_position(m.take_events())
    assert got == want
    m.check_invariants()


@pytest.mark.parametrize("where", ["device", "slots"])
def test_a_run_whose_every_block_was_computed_meanwhile_lands_nothing(backend, layout, where):
    """Block 0 of A on the device (the start's hit), blocks 1-2 fetched; before the
    landing another request computes both after that hit: the landing walks on past the
    run's first block (``land``'s second match) and lands nothing, where one block past
    the first held one it would land block 2 beside c's copy. ``where``: the run would
    land on the device, or in the slots alone (X holds five blocks). Two slots: the
    fetch reserves both, so c's admission starts none."""
    m, ex = _manager(backend, layout, host_blocks=2)
    m.add_request("d", A[:5], read_cache=False)
    m.take_kv_ops()
    m.free("d")                                      # block 0 cached on the device
    if where == "slots":
        m.add_request("x", X, read_cache=False)
        m.take_kv_ops()
    assert m.add_request("b", A) == StoreWait("b", 2)
    f = m._waits.waiting["b"]
    (b0,) = f.held if where == "device" else f.hits
    assert (f.devices is None) == (where == "slots")
    if where == "slots":
        m.free("x")
    c = m.add_request("c", A)                        # hits block 0, computes blocks 1-2
    assert c.num_cached_tokens == 4
    mine = m.get_block_ids("c")
    m.take_kv_ops()
    m.take_kv_ops()
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert f.devices is None                         # nothing landed on the device
    assert m.lookup_block_ids(A) == (b0.block_id, *mine[1:3])
    assert m._host.num_landing == 0 and m._host.num_free == 2   # every slot given back
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and adm.block_ids[:3] == (b0.block_id, *mine[1:3])
    assert m.stats.store_hits == 0
    m.check_invariants()


def test_a_run_from_block_0_whose_first_block_came_to_a_slot_meanwhile_lands_after_it(
        backend, layout):
    """b's fetch of A's blocks 0-2 and c's of block 0 (A[:5]) both land in slots alone
    (h holds 7 of the 8 blocks); c's lands first: b's landing finds block 0 in c's slot
    (the host's probe of a run from block 0, with nothing on the device) and lands
    blocks 1-2 after it, giving slot 0 back: block 0 is not landed twice."""
    m, ex = _manager(backend, layout)
    m.add_request("h", list(range(200, 228)), read_cache=False)
    m.take_kv_ops()
    assert m.add_request("b", A) == StoreWait("b", 3)
    f = m._waits.waiting["b"]
    b_jobs, ex.jobs = ex.jobs, []
    assert m.add_request("c", A[:5]) == StoreWait("c", 1)
    g = m._waits.waiting["c"]
    assert f.devices is None and g.devices is None
    assert [s.block_id for s in f.slots] == [0, 1, 2] and [s.block_id for s in g.slots] == [3]
    ex.run()
    assert m.poll_store() == ["c"] and m.lookup(A) == 4 and m.lookup_block_ids(A) == ()
    m.free("c")
    ex.jobs = b_jobs
    ex.run()
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.lookup(A) == 12 and m.lookup_block_ids(A) == ()
    assert m._host.num_free == 1 and f.slots[0].key is None      # slot 0 given back
    m.take_kv_ops()
    m.free("h")
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and m.stats.store_hits == 8
    assert [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)] == [
        BlockLoads((3, 1, 2), adm.block_ids[:3])]
    m.check_invariants()
