"""The re-admission of a request whose store fetch landed reuses what its start found
and what the fetch landed (``StoreWaits.reuse``) instead of walking the index again:
only when that is exactly what the walk would find. Each test compares the
re-admission with the walk's answer taken just before it (``_find`` as a lookup, which
changes nothing): the same hits, so the same cached tokens and the same loads; and
checks whether the shortcut was taken. A real Redis (conftest), block_size 4."""

import time

import pytest

from prefixkv import BlockLoads, ExtraKeys, KVCacheManager, MultiModalInput, StorePut, StoreWait
from prefixkv.core import store_readmit, store_reuse
from prefixkv.core.store_waits import StoreWaits
from prefixkv.store import encode_value
from prefixkv.tiers import HostSlot
from waiting import PATIENCE

BS = 4
P = list(range(1, 22))                  # five full blocks + 1
IMAGE = ExtraKeys(mm=(MultiModalInput("img", 2, 8),))  # in blocks 0..2


@pytest.fixture
def taken(monkeypatch):
    """Whether each ``reuse`` call answered (True) or left it to the walk (False): the
    general path's (``StoreWaits.reuse``) and ``_readmit``'s (the same Prompt object:
    ``unmoved``, its checks)."""
    calls = []
    original = StoreWaits.reuse

    def spy(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    def spy_readmit(*args):
        out = store_reuse.unmoved(*args)
        calls.append(out)
        return out

    monkeypatch.setattr(StoreWaits, "reuse", spy)
    monkeypatch.setattr(store_readmit, "unmoved", spy_readmit)
    return calls


def stored(shared, backend, prompt, extra=None):
    """Write every full block of ``prompt`` to the store, from another manager."""
    w = KVCacheManager(16, BS, hash_mode="sha256", host_blocks=1, store=shared)
    w.add_request("w", prompt, extra=extra, read_cache=False)
    w.take_kv_ops()
    backend.put([(op.key, encode_value(op.head, bytes(8))) for op in w.take_kv_ops()
                 if isinstance(op, StorePut)])


def landed(m, rid, prompt, extra=None):
    """Start ``rid``'s fetch and land it (``poll_store`` lists it)."""
    assert isinstance(m.add_request(rid, prompt, extra=extra), StoreWait)
    deadline = time.monotonic() + PATIENCE
    while rid not in m.poll_store():
        assert time.monotonic() < deadline, "a fetch that never ended"
        time.sleep(0.001)


def readmit_as_walk(m, rid, prompt, extra=None):
    """Re-admit ``rid``; assert it got what the walk finds now; returns (the walk's
    hits, the admission)."""
    hits = m._find(None, prompt, extra, True, None)[1]
    loads_before = len(m._host.load_src)
    adm = m.add_request(rid, prompt, extra=extra)
    assert adm.num_cached_tokens == len(hits) * BS
    slots = [h.block_id for h in hits if type(h) is HostSlot]
    assert list(m._host.load_src[loads_before:]) == slots  # (a landed run's: a tuple)
    device = [h.block_id for h in hits if type(h) is not HostSlot]
    assert list(adm.block_ids[:len(device)]) == device
    m.check_invariants()
    return hits, adm


def manager(shared, num_blocks=16, host_blocks=8):
    return KVCacheManager(num_blocks, BS, hash_mode="sha256", host_blocks=host_blocks, store=shared)


@pytest.mark.parametrize("extra", [None, IMAGE])
def test_the_landed_run_is_reused(backend, shared, taken, extra):
    stored(shared, backend, P, extra)
    m = manager(shared)
    landed(m, "r", P, extra)
    hits, adm = readmit_as_walk(m, "r", P, extra)
    assert taken == [True] and len(hits) == 5 and m.stats.store_hits == 20
    assert BlockLoads(tuple(h.block_id for h in hits), adm.block_ids[:5]) in m.take_kv_ops()


def test_a_block_aligned_prompts_landed_run_is_reused(backend, shared, taken):
    """A prompt of whole blocks hits all but its last block (its last token is computed):
    the landed run reaching that far is reused (mutation pass: ``reuse`` asking for
    ``len(tokens) // block_size`` blocks never reused one; the walk answered the same)."""
    aligned = P[:20]
    stored(shared, backend, aligned)
    m = manager(shared)
    landed(m, "r", aligned)
    hits, _ = readmit_as_walk(m, "r", aligned)
    assert taken == [True] and len(hits) == 4


def test_the_start_device_hits_and_the_landed_run_are_reused(backend, shared, taken):
    m = manager(shared)
    m.add_request("d", P[:9], read_cache=False)             # blocks 0 and 1 computed on the device
    m.take_kv_ops()
    m.free("d")
    stored(shared, backend, P)
    landed(m, "r", P)                       # fetches blocks 2..4
    hits, adm = readmit_as_walk(m, "r", P)
    assert taken == [True] and [type(h) is HostSlot for h in hits] == [False] * 5   # landed on
    assert m.stats.store_hits == 12                                               # the device


@pytest.mark.parametrize("position", [0, 9, 19])  # in the first, a middle, the last block
def test_a_prompt_that_differs_in_one_fetched_token_is_walked(backend, shared, taken, position):
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)
    other = P[:position] + [99] + P[position + 1:]
    hits, _ = readmit_as_walk(m, "r", other)
    assert taken == [False] and len(hits) == position // BS


def test_a_prompt_with_other_extra_keys_is_walked(backend, shared, taken):
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)
    hits, _ = readmit_as_walk(m, "r", P, ExtraKeys(cache_salt="t"))
    assert taken == [False] and hits == []


def slots_alone(m):
    """Another request holds all of ``m``'s pool but 4 blocks: a run of 5 lands in host
    slots alone (the pool cannot give it device blocks); ``free`` it once landed."""
    m.add_request("h", list(range(300, 349)), read_cache=False)


@pytest.mark.parametrize("refilled", [False, True])
def test_a_landed_slot_taken_before_the_readmission_is_walked(backend, shared, taken, refilled):
    stored(shared, backend, P)
    m = manager(shared, host_blocks=6)
    slots_alone(m)
    landed(m, "r", P)                       # slots 0..4 land; slot 5 stays empty
    m.free("h", num_computed_tokens=0)
    m.take_kv_ops()                         # the step ran: the landed slots are cached
    stored(shared, backend, list(range(40, 49)))
    if refilled:                            # s takes 2 slots: the empty one, then the least
        landed(m, "s", list(range(40, 49)))  # recent (block 4's: a landed run leaves its
    else:                                   # slots leaves first), where its block 1 lands
        m.add_request("s", list(range(40, 49)))   # ... or is still landing (no content)
    # s's fetch took slot 4: it lands there still, or landed in device blocks (the slot
    # holds the payload until the step ran, keyless, then goes empty)
    assert m._host.slots[4].key is None and m._host.slots[3].key is not None
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [False] and [h.block_id for h in hits] == [0, 1, 2, 3]


def test_a_run_landed_on_the_device_is_reused_whatever_the_slots_do(backend, shared, taken):
    stored(shared, backend, P)
    m = manager(shared, host_blocks=6)
    landed(m, "r", P)                       # on the device too, held for r
    m.take_kv_ops()
    stored(shared, backend, list(range(40, 49)))
    landed(m, "s", list(range(40, 49)))     # takes a slot of r's run
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [True] and len(hits) == 5


def test_a_landed_run_is_known_pinned_until_the_step_ends(backend, shared, taken):
    """``reuse`` looks at the landed slots only once their pins were released (the cases
    where they may have been taken: the test above and the reset below)."""
    stored(shared, backend, P)
    m = manager(shared)
    slots_alone(m)
    landed(m, "r", P)
    m.free("h", num_computed_tokens=0)
    f = m._waits.waiting["r"]
    assert f.landed_at == m._host.num_unpins and all(s.ref_cnt == 1 for s in f.slots[:5])
    m.take_kv_ops()
    assert f.landed_at != m._host.num_unpins and not any(s.ref_cnt for s in f.slots[:5])
    hits, _ = readmit_as_walk(m, "r", P)    # (their content stayed: reused all the same)
    assert taken == [True] and len(hits) == 5


def test_a_landed_run_cleared_by_a_reset_before_the_readmission_is_walked(backend, shared, taken):
    stored(shared, backend, P)
    m = manager(shared)
    slots_alone(m)
    landed(m, "r", P)                       # pinned, in the same step, when the cache is reset
    m.free("h", num_computed_tokens=0)
    assert m.reset_prefix_cache()
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [False] and hits == []


def test_a_run_landed_on_the_device_holds_off_a_reset_until_readmitted(backend, shared, taken):
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)
    assert not m.reset_prefix_cache()       # r holds its device blocks (as a running request)
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [True] and len(hits) == 5


def two_on_the_device(shared, backend):
    """A manager of 8 blocks and 5 slots whose device holds P's first two blocks (the
    store: all of P's)."""
    m = manager(shared, num_blocks=8, host_blocks=5)
    m.add_request("d", P[:9], read_cache=False)  # blocks 0 and 1 on the device
    m.take_kv_ops()
    m.take_kv_ops()
    m.free("d")
    stored(shared, backend, P)
    return m


@pytest.mark.parametrize("tokens", [25, 32])
def test_a_start_device_hit_evicted_before_the_readmission_is_walked(backend, shared, taken, tokens):
    m = two_on_the_device(shared, backend)
    m.add_request("h", list(range(300, 313)), read_cache=False)   # the pool short: the run
    landed(m, "r", P)                       # device hits 0, 1; fetches 2..4 into 3 slots
    assert m._waits.waiting["r"].devices is None   # lands in slots alone, holding nothing
    m.free("h", num_computed_tokens=0)
    m.take_kv_ops()
    # x takes the 6 empty blocks and evicts one device hit (25 tokens: into its last
    # block, which holds no content) or both (32: both hold x's content); the evicted
    # go to the 2 free slots
    m.add_request("x", list(range(60, 60 + tokens)), read_cache=False)
    m.take_kv_ops()
    m.free("x")
    start = m._waits.waiting["r"].hits
    assert [b.key is None for b in start] == ([False, True] if tokens == 25 else [False, False])
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [False] and len(hits) == 5


def test_start_device_hits_are_held_until_the_readmission(backend, shared, taken):
    m = two_on_the_device(shared, backend)
    landed(m, "r", P)                       # device hits 0, 1 held; the run in 3 blocks
    m.take_kv_ops()
    assert m.num_free_blocks == 2           # (and the block after the run, empty)
    assert m.add_request("x", list(range(60, 85)), read_cache=False) is None   # no eviction
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [True] and len(hits) == 5


@pytest.mark.parametrize("extra", [None, IMAGE])
def test_content_the_device_got_meanwhile_is_hit_there(backend, shared, taken, extra):
    stored(shared, backend, P, extra)
    m = manager(shared)
    slots_alone(m)
    landed(m, "r", P, extra)
    m.free("h", num_computed_tokens=0)
    other = m.add_request("o", P, extra=extra)  # loads the landed slots: the device holds them
    assert other.num_cached_tokens == 20
    hits, adm = readmit_as_walk(m, "r", P, extra)
    assert taken == [False] and [type(h) is HostSlot for h in hits] == [False] * 5
    assert adm.block_ids[:5] == other.block_ids[:5]


def test_another_request_shares_a_run_landed_on_the_device(backend, shared, taken):
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)
    other = m.add_request("o", P)           # hits r's landed blocks on the device
    assert other.num_cached_tokens == 20
    hits, adm = readmit_as_walk(m, "r", P)
    assert taken == [True] and adm.block_ids[:5] == other.block_ids[:5]


def test_a_device_cut_off_from_its_parents_content_is_walked(backend, shared, taken):
    """Once ``uncache`` left a device block whose parent's content is gone (``cut``),
    the walk probes the device after slots too: the shortcut is not taken."""
    m = manager(shared)
    q = list(range(70, 79))
    m.add_request("y", q, read_cache=False)
    m.add_request("z", q)                   # hits y's blocks in the same step
    m.free("y", num_computed_tokens=0)      # never computed: z's hits are cut off
    assert m._index.cut
    stored(shared, backend, P)
    landed(m, "r", P)
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [False] and len(hits) == 5


def test_a_partly_landed_run_is_walked(backend, shared, taken):
    stored(shared, backend, P[:13])         # the store holds blocks 0..2 of 5
    m = manager(shared)
    landed(m, "r", P)
    hits, _ = readmit_as_walk(m, "r", P)
    assert taken == [False] and len(hits) == 3


def test_a_bad_prompt_at_the_readmission_raises_as_the_walk_does(backend, shared, taken):
    from prefixkv.errors import TokenError
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", P)
    for bad in (P[:-1] + [-1], P[:-1] + [2 ** 32], [True] + P[1:], P[:-1] + [1.0]):
        with pytest.raises(TokenError):
            m.add_request("r", bad)
    hits, _ = readmit_as_walk(m, "r", P)    # nothing changed: still reused
    assert taken == [True] and len(hits) == 5
