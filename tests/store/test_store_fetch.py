"""The asynchronous fetch, one rule at a time, on a real Redis with fetches run when the
test says (a manual executor): a wait answers the same until polled; a fetch that loses
a race lands only what still continues the chain; one delivered twice lands once; one
whose request left lands as cached content; one past its deadline releases its request
and keeps its slots until its threads return; a reset waits for fetches; host memory
is checked when attached. Block size 4, 8-byte payloads."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixkv import (
    BlockLoads,
    BlockOffloads,
    ConfigError,
    ExtraKeysError,
    KVCacheManager,
    PromptTooLongError,
    RequestError,
    StoreWait,
    TokenError,
)
from prefixkv.store import FetchCost, SharedStore
from prefixkv.store.fetch import FAILED
from waiting import LIVE

from .conftest import always
from .test_shared_store import A, computed


class Manual:
    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))

    def run(self):
        while self.jobs:
            fn, args = self.jobs.pop(0)
            fn(*args)


def setup(backend, layout, prompt=A, host_blocks=4, extra=None, **kw):
    """A store holding ``prompt``'s blocks (A's three unless given; written by another
    manager, with extra keys ``extra``), and a manager with ``host_blocks`` slots whose
    fetches run when the test says."""
    computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", prompt, extra=extra)
    ex = Manual()
    shared = SharedStore(backend, layout, cost=always(), **{"timeout": LIVE, "executor": ex, **kw})
    return KVCacheManager(8, 4, hash_mode="sha256", host_blocks=host_blocks, store=shared), ex, shared


def test_a_wait_answers_the_same_until_polled_and_holds_only_its_runs_blocks(backend, layout):
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert m.num_free_blocks == 4 and m.stats.requests == 0   # the run's device blocks, the tail's
    with pytest.raises(RequestError):
        m.get_block_ids("b")                         # not live
    ex.run()
    assert m.add_request("b", A) == StoreWait("b", 3)   # ended, but not polled yet
    m.check_invariants()
    assert m.poll_store() == ["b"] and m.poll_store() == []
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and m.stats.store_hits == 12
    m.check_invariants()


def test_a_fetch_delivered_twice_lands_once(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    f = m._store.done[0]
    m._store.done.append(f)                          # delivered again
    assert m.poll_store() == ["b"]
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12
    m._store.done.append(f)                          # and again, after the admission
    assert m.poll_store() == []
    m.check_invariants()



def test_a_fetch_delivered_twice_does_not_hold_back_the_next_one(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    m.add_request("c", list(range(50, 63)))          # not in the store: its fetch finds nothing
    ex.run()
    done = m._store.done
    order = [f.request_id for f in done]
    assert sorted(order) == ["b", "c"]
    done.insert(1, done[0])                          # the first delivered again, before the other
    assert m.poll_store() == order                   # both waits over in this poll
    m.check_invariants()

def test_a_fetch_whose_request_left_lands_as_cached_content(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    m.free("b")                                      # it left while waiting
    with pytest.raises(RequestError):
        m.free("b")
    ex.run()
    assert m.poll_store() == []                      # nobody to tell
    m.check_invariants()
    assert m.lookup(A) == 12 and m.num_free_blocks == 8   # device blocks hold it, free
    adm = m.add_request("c", A)
    assert adm.num_cached_tokens == 12 and m.stats.host_hits == 0 and m.stats.store_hits == 0


@pytest.mark.parametrize("prompt, extra, error", [
    ([], None, TokenError), ([1, -1], None, TokenError), (A, {"cache_salt": "a"}, ExtraKeysError),
    ([1] * 40, None, PromptTooLongError),
])
def test_bad_input_while_waiting_raises_as_without_a_wait(backend, layout, prompt, extra, error):
    """A re-admission while the fetch runs answered StoreWait whatever its prompt."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    with pytest.raises(error):
        m.add_request("b", prompt, extra=extra)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()
    assert m.poll_store() == ["b"] and m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_reset_leaves_no_offload_to_overwrite_a_fetch_into_attached_memory(backend, layout):
    """Offloads stated before a reset stayed in the step's plan, into slots the reset
    emptied; a fetch of the same step reserved those slots and read into them, the
    engine's plan then overwrote them, and the landed run served that KV."""
    m, ex, _ = setup(backend, layout)
    host = bytearray(32)
    m.attach_host_memory([[memoryview(host)[8 * i:8 * (i + 1)]] for i in range(4)])
    device = [bytes([0xEE]) * 8] * 8                 # what the device blocks hold
    m.add_request("x", list(range(50, 59)), read_cache=False)
    m.take_kv_ops()
    m.free("x")
    m.add_request("y", list(range(60, 89)), read_cache=False)   # evicts x's blocks
    m.free("y")
    assert m.reset_prefix_cache(keep_store=True)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.run()                                         # the fetch reads into slots 0..2
    for op in m.take_kv_ops():                       # the engine runs the step's plan
        assert isinstance(op, BlockOffloads), op
        for src, dst in zip(op.src, op.dst, strict=True):
            host[8 * dst:8 * dst + 8] = device[src]
    assert m.poll_store() == ["b"]
    adm = m.add_request("b", A)
    loads = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert adm.num_cached_tokens == 12 and len(loads) == 1
    for src, dst in zip(loads[0].src, loads[0].dst, strict=True):
        device[dst] = bytes(host[8 * src:8 * src + 8])
    assert [device[b] for b in adm.block_ids[:3]] == [bytes([i]) * 8 for i in range(3)]
    m.check_invariants()


def test_a_fork_cannot_take_the_id_of_a_request_waiting_on_the_store(backend, layout):
    """Its ``free`` would only end the wait: the child stayed live, its blocks leaked."""
    m, ex, _ = setup(backend, layout)
    assert m.add_request("b", A) == StoreWait("b", 3)
    m.add_request("p", [7, 7, 7, 7, 7, 7], read_cache=False)
    m.take_kv_ops()
    m.take_kv_ops()                                  # (p's block written to the store)
    free = m.num_free_blocks
    with pytest.raises(RequestError, match="waiting on the store"):
        m.fork("p", "b")
    assert m.num_free_blocks == free and m.take_kv_ops() == []
    m.check_invariants()
    m.free("b")                                      # the wait ends; nothing else was live
    m.free("p")
    assert m.num_free_blocks == 4                    # (the fetch holds its run's blocks, the tail's)
    ex.run()
    m.poll_store()
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_an_executor_that_refuses_the_fetch_costs_a_miss_and_leaks_no_slot(backend, layout):
    """``submit`` raising (an engine's executor shut down) escaped ``add_request`` as a
    RuntimeError after the wait was recorded: its host slots stayed reserved and the
    fetch in flight for ever (``reset_prefix_cache`` refused for ever)."""
    refusing = ThreadPoolExecutor(1)
    refusing.shutdown()
    m, ex, _ = setup(backend, layout, executor=refusing)
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 0 and adm.num_new_tokens == len(A)   # computed
    assert m.stats.store_errors == 1 and m._host.num_landing == 0 and not ex.jobs
    m.check_invariants()
    m.free("b")
    assert m.add_request("c", [5] * 13).num_cached_tokens == 0           # left alone
    assert m.stats.store_errors == 1
    m.free("c")
    assert m.reset_prefix_cache()
    m.check_invariants()


def test_a_fetch_that_lost_a_race_to_the_device_lands_only_what_follows(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    m.add_request("x", A[:4] + [0], read_cache=False)   # block 0 computed meanwhile
    m.take_kv_ops()
    ex.run()
    f = m._store.done[0]
    assert f.filled and f.slots[1].parent_cid == f.planned[0]   # the fetcher's guess
    assert m.poll_store() == ["b"]
    x0 = m._pool.blocks[m.get_block_ids("x")[0]]
    assert f.slots[1].parent_cid == x0.content_id    # the landing's: the device's block 0
    assert x0.content_id < f.slots[1].content_id < f.slots[2].content_id   # ids follow the
    assert list(f.cids) == [f.slots[1].content_id, f.slots[2].content_id]  # chain (new ones)
    m.check_invariants()                             # no content held twice
    assert m._host.num_landing == 0 and len(m._host) == 2   # blocks 1 and 2 landed
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12 and m.stats.store_hits == 8


def test_a_fetch_whose_prefix_left_lands_nothing(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("x", A[:4] + [0], read_cache=False)   # block 0 on the device
    assert m.add_request("b", A) == StoreWait("b", 2)   # blocks 1, 2 after the device's 0
    m.free("x", num_computed_tokens=0)               # block 0 was never computed: gone
    ex.run()
    assert m.poll_store() == ["b"]
    assert len(m._host) == 0 and not m._host.num_landing  # its children continue nothing
    m.check_invariants()
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 0 and m.stats.store_hits == 0


def test_reset_waits_for_fetches_under_way(backend, layout):
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    assert not m.reset_prefix_cache()
    ex.run()
    m.poll_store()
    assert not m.reset_prefix_cache()                # b holds its landed run
    m.add_request("b", A)
    m.free("b")
    assert m.reset_prefix_cache()
    m.check_invariants()


def test_a_fetch_past_its_deadline_releases_its_request_and_keeps_its_slots(backend, layout):
    m, ex, shared = setup(backend, layout, timeout=1.0)
    offset = [0.0]
    shared.clock = lambda: time.monotonic() + offset[0]
    m.add_request("b", A)
    offset[0] = 10.0                                 # the deadline passed; threads never ran
    assert m.poll_store() == ["b"] and m.stats.store_errors == 1
    adm = m.add_request("b", A)                      # computes
    assert (adm.num_cached_tokens, adm.num_new_tokens) == (0, 13)
    assert m._host.num_landing == 3                 # still the fetch's
    m.check_invariants()
    ex.run()                                         # the threads return at last
    assert m.poll_store() == []
    assert m._host.num_landing == 0
    m.check_invariants()


def test_a_fetch_that_fails_after_its_request_gave_up_on_it_is_one_error(backend, layout):
    """Counted at the expiry and again when it ended failed (its read past the deadline)."""
    m, ex, _ = setup(backend, layout, timeout=0.05)
    assert m.add_request("b", A) == StoreWait("b", 3)
    time.sleep(0.2)                                  # past the deadline; threads never ran
    assert m.poll_store() == ["b"] and m.stats.store_errors == 1
    ex.run()                                         # the read starts past its deadline
    assert m._store.done[0].stop == FAILED
    assert m.poll_store() == [] and m.stats.store_errors == 1
    m.check_invariants()


def test_a_cost_rule_that_says_compute_starts_no_fetch(backend, layout):
    computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", A)
    ex = Manual()
    m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                       store=SharedStore(backend, layout, executor=ex,
                                         cost=FetchCost(1e9)))    # computing is instant
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 0 and not ex.jobs


def test_attached_memory_must_fit_the_slots(backend, layout):
    m, _, _ = setup(backend, layout)
    good = [[memoryview(bytearray(8))] for _ in range(4)]
    for bad in (good[:3], [[memoryview(bytearray(7))]] * 4, [[memoryview(bytes(8))]] * 4):
        with pytest.raises(ConfigError):
            m.attach_host_memory(bad)
    m.attach_host_memory([[memoryview(bytearray(3)), memoryview(bytearray(5))] for _ in range(4)])
    with pytest.raises(ConfigError):
        KVCacheManager(8, 4).attach_host_memory(good)


@pytest.mark.parametrize("slot", [memoryview(bytearray(8)), bytearray(8), "abcdefgh"],
                         ids=["a-view", "a-buffer", "a-str"])
def test_a_slot_given_one_buffer_instead_of_a_list_is_told_so(backend, layout, slot):
    """The common slip (one view per slot, not a list of them) is named as such, not as
    a buffer that is not one (iterating a view gives ints)."""
    m, _, _ = setup(backend, layout)
    with pytest.raises(ConfigError, match=r"^host slot 0: a list of writable views, got "):
        m.attach_host_memory([slot] * 4)


def test_the_fetcher_makes_the_slots_views_from_the_memory_attached_at_the_start(backend, layout):
    """The scheduler's thread hands over the slots, not a view per slot: the fetcher
    makes them, from the memory attached when the fetch started (none can be attached
    while it runs: test_fetch_faults), and the payloads land there."""
    m, ex, _ = setup(backend, layout)
    first = bytearray(32)
    m.attach_host_memory([[memoryview(first)[8 * i:8 * (i + 1)]] for i in range(4)])
    assert isinstance(m.add_request("b", A), StoreWait)
    f = m._waits.waiting["b"]
    assert f.buffers == [] and f.views is not None  # nothing per slot on this thread
    later = bytearray(32)
    with pytest.raises(ConfigError, match="under way"):
        m.attach_host_memory([[memoryview(later)[8 * i:8 * (i + 1)]] for i in range(4)])
    made, views = [], f.views
    f.views = lambda slots: made.append(views(slots)) or made[-1]
    ex.run()
    assert [b[0].obj for b in made[0]] == [first] * 3
    assert f.buffers == f.keys == f.heads == f.states == []  # the reads' own: dropped (``finish``)
    assert m.poll_store() == ["b"]
    assert m.add_request("b", A).num_cached_tokens == 12
    assert sorted(first[8 * s.block_id:8 * s.block_id + 8] for s in f.slots) == \
        sorted(bytes([i]) * 8 for i in range(3))   # the writer's blocks 0, 1, 2
    assert later == bytearray(32)
    m.check_invariants()


# ---- the landing's work done on the fetcher's thread (``Fetch.ready``) ------------------

def pool_short(m, blocks=5):
    """Another request ("h") holds ``blocks`` of ``m``'s 8 blocks: a run of A's lands in
    host slots alone (the pool cannot give it device blocks); ``free`` it before the
    re-admission."""
    m.add_request("h", list(range(200, 200 + 4 * blocks)), read_cache=False)


def test_the_fetcher_fills_the_slots_and_they_stay_unfindable_until_landed(backend, layout):
    m, ex, _ = setup(backend, layout)
    pool_short(m)
    m.add_request("b", A)
    ex.run()                                         # the fetcher's thread, here
    f = m._store.done[0]
    assert f.filled and f.unique and f.run == 3
    s0, s1, s2 = f.slots
    assert [s.content_id for s in f.slots] == list(f.planned)
    assert (s0.parent_cid, s1.parent_cid, s2.parent_cid) == (0, s0.content_id, s1.content_id)
    assert s0.child is s1 and s1.child is s2 and [s.hash for s in f.slots] == f.hashes
    # filled, not findable: the first slot has no key, the others' parents are ids the
    # start took, which nothing findable holds; none is in a map
    assert s0.key is None and [s1.key, s2.key] == f.chunks[1:3]
    assert not any(m._host.by_chunk.get(c) in f.slots for c in f.chunks)
    assert m.lookup(A) == 0
    m.check_invariants()
    assert m.poll_store() == ["b"] and m.lookup(A) == 12
    m.check_invariants()
    m.free("h")
    assert m.add_request("b", A).num_cached_tokens == 12 and m.stats.store_hits == 12


def test_the_slots_of_a_run_that_lands_on_the_device_stay_keyless_then_go_empty(backend, layout):
    """Its slots hold the payload until the loads out of them ran (issue 25, store-r12):
    the fetcher fills them without keys, the landing keys the device blocks alone, and
    the slots go empty once the step ran; the tier keeps none of the run."""
    m, ex, _ = setup(backend, layout)
    m.add_request("b", A)
    ex.run()
    f = m._store.done[0]
    assert f.filled and f.devices is not None and not any(s.key for s in f.slots)
    assert m.poll_store() == ["b"] and m.lookup_block_ids(A) == tuple(b.block_id for b in f.devices)
    assert not any(s.key for s in f.slots) and len(m._host) == 0 and m._host.num_free == 1
    m.check_invariants()
    loads = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads == [BlockLoads(tuple(s.block_id for s in f.slots), tuple(b.block_id for b in f.devices))]
    assert m._host.num_free == 4 and len(m._host) == 0        # empty once the step ran
    m.check_invariants()
    assert m.add_request("b", A).num_cached_tokens == 12 and m.stats.store_hits == 12
    m.check_invariants()


def block0_on_host(m):
    """Leave A's block 0 in a host slot of ``m`` (and none of A on the device)."""
    m.add_request("p", A[:5], read_cache=False)      # A's block 0, computed
    m.take_kv_ops()
    m.free("p")
    m.add_request("q", list(range(100, 129)), read_cache=False)  # 8 blocks: block 0 goes
    m.take_kv_ops()                                  # down to a host slot
    m.free("q")
    assert m.lookup(A) == 4


def test_a_filled_run_is_missed_by_a_stale_guess_until_it_lands(backend, layout):
    """The fetcher keys every slot of the run but the first: a guess that reaches the
    first (the ``child`` link of the slot holding its parent's content, left from an
    earlier use of these slots) finds no key there, though the parent id matches."""
    m, ex, _ = setup(backend, layout, host_blocks=8)   # (h's evicted blocks: empty slots)
    block0_on_host(m)
    pool_short(m)
    m.take_kv_ops()
    assert isinstance(m.add_request("b", A), StoreWait)
    f = m._waits.waiting["b"]
    assert f.first == 1 and len(f.slots) == 2 and f.devices is None
    f.hits[0].child = f.slots[0]                     # the stale guess
    ex.run()
    assert f.filled and f.slots[0].parent_cid == f.hits[0].content_id
    assert f.slots[0].key is None and f.slots[1].key == f.chunks[1]
    assert m.lookup(A) == 4                          # filled, not found
    m.check_invariants()
    assert m.poll_store() == ["b"] and m.lookup(A) == 12
    m.check_invariants()
    m.free("h")
    assert m.add_request("b", A).num_cached_tokens == 12


def test_a_host_hit_then_a_run_landed_in_the_step_load_in_one_op_in_order(backend, layout):
    """The re-admission loads a host hit and the run that landed after it in this step:
    the hit is pinned, the run stays pinned once (not walked again: ``hold`` takes its
    ids from the landing), and the one BlockLoads names every slot in the prompt's order."""
    m, ex, _ = setup(backend, layout, host_blocks=8)   # (h's evicted blocks: empty slots)
    block0_on_host(m)
    pool_short(m)                                    # (the run lands in the slots alone)
    m.take_kv_ops()
    assert isinstance(m.add_request("b", A), StoreWait)
    f = m._waits.waiting["b"]
    hit = f.hits[0]
    ex.run()
    assert m.poll_store() == ["b"] and f.devices is None
    m.free("h")
    adm = m.add_request("b", A)
    assert adm.num_cached_tokens == 12
    m.check_invariants()
    assert hit.ref_cnt == 1 and all(s.ref_cnt == 1 for s in f.slots)     # pinned once
    loads = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert loads == [BlockLoads((hit.block_id, *[s.block_id for s in f.slots]),
                                tuple(adm.block_ids[:3]))]
    m.check_invariants()
    assert hit.ref_cnt == 0 and all(s.ref_cnt == 0 for s in f.slots)     # unpinned


def test_a_fill_that_fails_on_the_fetcher_is_done_at_the_landing(backend, layout, monkeypatch):
    import prefixkv.core.store_waits as store_waits

    def broken(f):
        f.slots[0].content_id = -7                   # part-way, then it fails
        raise RuntimeError("no fill")

    monkeypatch.setattr(store_waits, "fetch_ready", broken)  # the name start() hands the fetch
    m, ex, _ = setup(backend, layout)
    pool_short(m)
    m.add_request("b", A)
    ex.run()
    f = m._store.done[0]
    assert not f.filled and f.run == 3
    assert m.poll_store() == ["b"]
    assert [s.content_id for s in f.slots] == list(f.planned)   # filled by the scheduler
    m.check_invariants()
    m.free("h")
    assert m.add_request("b", A).num_cached_tokens == 12 and m.stats.store_hits == 12


def test_a_run_that_repeats_a_block_is_keyed_by_content(backend, layout):
    rep = [1, 2, 3, 4] * 3 + [9]                     # three blocks of equal tokens
    m, ex, _ = setup(backend, layout, rep)
    pool_short(m)
    m.add_request("b", rep)
    ex.run()
    assert not m._store.done[0].unique
    assert m.poll_store() == ["b"]
    assert len(m._host.by_chunk) == 1 and len(m._host.by_key) == 2
    m.check_invariants()
    assert m.lookup(rep) == 12
    m.free("h")
    assert m.add_request("b", rep).num_cached_tokens == 12
    m.check_invariants()
