"""The host tier (L2): exact slots, plans and counts. block_size 4, seed 0."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import (
    Admission,
    BlockLoads,
    BlockOffloads,
    BlockRemoved,
    BlockStored,
    ConfigError,
    KVCacheManager,
    PrefixCacheStats,
)

A = [1, 2, 3, 4, 5, 6, 7, 8, 9]      # two full blocks + 1
B = list(range(20, 29))


def manager(num_blocks=3, host_blocks=4, **kw):
    return KVCacheManager(num_blocks, 4, seed=0, host_blocks=host_blocks, **kw)


def test_eviction_offloads_and_a_later_admission_loads():
    m = manager()
    assert m.add_request("a", A) == Admission("a", (0, 1, 2), 0, 9)
    assert m.take_kv_ops() == []                     # step 1 ends: a's KV is computed
    m.free("a")
    assert m.add_request("b", B) == Admission("b", (2, 1, 0), 0, 9)  # evicts 1, then 0
    assert m.take_kv_ops() == [BlockOffloads((1, 0), (0, 1))]  # block 1 -> slot 0, 0 -> 1
    m.free("b")
    assert m.free_block_order() == [0, 1, 2]         # b's partial block, then LRU
    adm = m.add_request("c", A[:8] + [0])            # both blocks of A come from the host
    assert adm == Admission("c", (0, 1, 2), 8, 1)
    # b's full blocks 1, 2 were evicted (tail first) and offloaded, then A loaded
    assert m.take_kv_ops() == [BlockOffloads((1, 2), (2, 3)),   # block 1 -> slot 2, 2 -> 3
                               BlockLoads((1, 0), (0, 1))]      # slot 1 -> block 0, 0 -> 1
    assert m.stats == PrefixCacheStats(requests=3, queries=27, hits=8, host_hits=8)
    m.check_invariants()


def test_content_recorded_this_step_is_never_offloaded():
    m = manager()
    m.add_request("a", A)
    m.free("a")                                      # no take_kv_ops: still step 1
    m.add_request("b", B)                            # evicts a's blocks, never computed yet
    assert m.take_kv_ops() == []
    assert m.lookup(A) == 0
    m.check_invariants()


def test_a_slot_being_loaded_is_pinned_against_offloads_of_the_same_plan():
    m = manager(num_blocks=3, host_blocks=2)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)
    assert m.take_kv_ops() == [BlockOffloads((1, 0), (0, 1))]  # host full: A
    m.free("b")
    m.add_request("c", A[:8] + [0])                  # loads from slots 0, 1: pinned, so
    ops = m.take_kv_ops()                            # b's evicted blocks cannot go there
    assert [op for op in ops if isinstance(op, BlockOffloads)] == []
    assert [op for op in ops if isinstance(op, BlockLoads)] == [BlockLoads((1, 0), (0, 1))]
    m.check_invariants()


def test_host_hits_continue_after_device_hits_and_lookup_counts_both():
    m = manager(num_blocks=4)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    assert m.free_block_order() == [2, 3, 1, 0]
    m.add_request("x", [7] * 9)                     # 3 blocks: 2, 3, then evicts a's block 1
    assert m.take_kv_ops() == [BlockOffloads((1,), (0,))]
    assert m.lookup(A) == 8                         # block 0 on device, block 1 on host
    m.free("x")
    adm = m.add_request("c", A)
    assert adm == Admission("c", (0, 1, 3), 8, 1)   # x's partial block 1, then evicts 3
    assert m.take_kv_ops() == [BlockOffloads((3,), (1,)), BlockLoads((0,), (1,))]
    m.check_invariants()


def test_events_carry_the_medium():
    m = manager(enable_events=True)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    stored = m.take_events()
    m.add_request("b", B)
    m.take_kv_ops()
    events = m.take_events()
    cpu = [e for e in events if getattr(e, "medium", None) == "CPU"]
    assert {h for e in cpu for h in e.block_hashes} == {h for e in stored for h in e.block_hashes}
    assert all(isinstance(e, BlockStored) for e in cpu)
    gpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert len(gpu_removed) == 2


def a_then_b(m, *, run_plan=True):
    """A computed and freed, then B, which evicts A's blocks into the slots (its plan run
    unless ``run_plan`` is False: the offloads stay pending), then freed."""
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)
    if run_plan:
        m.take_kv_ops()
    m.free("b")


def test_reset_clears_the_host_too():
    m = manager()
    a_then_b(m)
    assert m.reset_prefix_cache() is True
    assert m.lookup(A) == 0 and m.lookup(B) == 0
    m.check_invariants()


def test_reset_drops_the_steps_copies_into_and_out_of_the_slots_it_clears():
    """They stayed in the plan: offloads into cleared slots (which a store fetch of the
    same step may reserve and read into) and loads out of them."""
    m = manager()
    a_then_b(m, run_plan=False)
    assert m.reset_prefix_cache() is True
    assert m.take_kv_ops() == []
    a_then_b(m)
    assert m.add_request("c", A).num_cached_tokens == 8  # loads from the slots
    m.free("c")
    assert m.reset_prefix_cache() is True
    assert m.take_kv_ops() == []
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_host_blocks(bad):
    with pytest.raises(ConfigError):
        KVCacheManager(4, 4, host_blocks=bad)


def test_no_host_tier_keeps_todays_behaviour():
    m = KVCacheManager(3, 4, seed=0)
    m.add_request("a", A)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", B)
    assert m.take_kv_ops() == []
    m.free("b")
    assert m.lookup(A) == 0


@pytest.mark.parametrize("seed", range(6))
def test_a_simulated_store_under_pressure_holds_every_requests_own_kv(seed):
    """Events off (the index's fast paths: evictions demote in batches, admissions adopt
    and load their slots in batches): random admissions of shared prefixes under
    pressure, the plan run on a simulated store every step (offloads, then loads), then
    the step's writes; every live request's blocks hold exactly its own tokens' KV and
    the invariants hold after every step."""
    rng = random.Random(seed)
    bs, num_blocks, slots = 4, 12, 10
    m = KVCacheManager(num_blocks, bs, seed=0, host_blocks=slots)
    kv, host = [None] * num_blocks * bs, [None] * slots * bs
    prefixes = [[rng.randrange(50) for _ in range(3 * bs)] for _ in range(5)]
    live: dict[str, list[int]] = {}
    writes = []
    for step in range(300):
        for op in m.take_kv_ops():  # the plan: offloads (all first), then loads
            assert len(op.src) == len(op.dst) > 0
            if isinstance(op, BlockOffloads):
                for src, dst in zip(op.src, op.dst, strict=True):
                    host[dst * bs:(dst + 1) * bs] = kv[src * bs:(src + 1) * bs]
            else:
                assert isinstance(op, BlockLoads)
                for src, dst in zip(op.src, op.dst, strict=True):
                    kv[dst * bs:(dst + 1) * bs] = host[src * bs:(src + 1) * bs]
        for rid, start in writes:  # the forward pass writes what the step scheduled
            ids, toks = m.get_block_ids(rid), live[rid]
            for pos in range(start, len(toks)):
                kv[ids[pos // bs] * bs + pos % bs] = tuple(toks[:pos + 1])
        writes = []
        for rid, toks in live.items():
            ids = m.get_block_ids(rid)
            assert [kv[ids[p // bs] * bs + p % bs] for p in range(len(toks))] == \
                [tuple(toks[:p + 1]) for p in range(len(toks))], (seed, step, rid)
        m.check_invariants()
        if live and (rng.random() < 0.5 or m.num_free_blocks < 4):
            del live[(rid := rng.choice(sorted(live)))]
            m.free(rid)
        prompt = rng.choice(prefixes)[:rng.randrange(4, 13)] + [rng.randrange(50)
                                                                 for _ in range(rng.randrange(1, 6))]
        adm = m.add_request(f"r{step}", prompt)
        if adm is not None:
            live[adm.request_id] = prompt
            writes.append((adm.request_id, adm.num_cached_tokens))
    assert m.stats.host_hits > 200 and m.stats.hits > m.stats.host_hits


def test_a_decoded_block_that_a_slot_keeps_takes_the_slots_id_so_its_host_children_stay_found():
    m = manager(num_blocks=4, host_blocks=6)
    a = list(range(1, 14))                           # blocks A0, A1, A2 + 1 token
    m.add_request("a", a)
    m.take_kv_ops()
    m.free("a")
    m.add_request("b", list(range(20, 33)))          # evicts A2, A1, A0: all offloaded
    assert [len(op.src) for op in m.take_kv_ops() if isinstance(op, BlockOffloads)] == [3]
    m.free("b")
    assert m.add_request("d", [1, 2, 3, 4, 5, 6, 7]).num_cached_tokens == 4  # A0 loads
    m.take_kv_ops()
    assert m.append_tokens("d", [8]) == ()           # fills A1 again, on the device
    m.check_invariants()
    # A2 waits in a slot under A1's content id: found only if the new block took that id
    assert m.lookup(a) == 12
    m.free("d")
    m.check_invariants()


def test_forks_with_a_tier_decoding_equal_tokens_keep_one_block_found():
    m = manager(num_blocks=8, host_blocks=4)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    m.fork("a", "c")
    for t in (7, 8):                                 # one token a call: the decode path
        m.append_tokens("a", [t])
        m.append_tokens("c", [t])                    # equal content: c's block is a spare
    m.check_invariants()
    assert m.num_cached_blocks == 2
    m.free("a")
    m.check_invariants()
    m.free("c")
    assert m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    m.check_invariants()


def test_with_a_tier_a_decode_block_equal_to_a_content_keyed_by_its_triple_becomes_its_spare():
    m = manager(num_blocks=6, host_blocks=4)
    for rid, prompt in (("y", [1, 2, 3, 4, 0]),              # [1,2,3,4] keyed by its tokens
                        ("x", [5, 6, 7, 8, 1, 2, 3, 4, 0])):  # so x's is keyed by its triple
        m.add_request(rid, prompt)
        m.take_kv_ops()
        m.free(rid)
    need = m.num_free_blocks - 2                          # evicts y's block only (LRU first)
    m.add_request("f", list(range(100, 100 + 4 * (need - 1) + 1)))
    m.take_kv_ops()
    m.free("f")
    assert m.lookup([5, 6, 7, 8, 1, 2, 3, 4, 0]) == 8 and m.lookup([1, 2, 3, 4, 0]) == 4  # (host)
    m.add_request("d", [5, 6, 7, 8, 1, 2, 3])
    m.take_kv_ops()
    before = m.num_cached_blocks
    assert m.append_tokens("d", [4]) == ()               # x's content again: a spare
    assert m.num_cached_blocks == before
    m.check_invariants()
    m.free("d")
    m.check_invariants()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), host_blocks=st.sampled_from([1, 4, 16, 64]))
def test_a_tier_changes_nothing_on_the_device_and_only_adds_hits(seed, host_blocks):
    """The same requests through a manager with a tier and one without: a host hit takes
    fresh blocks exactly as a miss does and fills them with the same content, so every
    admission gets the same block ids (or None in both), decode the same results and the
    pool the same free order; the tier only turns recomputed tokens into cached ones."""
    rng = random.Random(seed)
    plain = manager(num_blocks=24, host_blocks=0)
    tiered = manager(num_blocks=24, host_blocks=host_blocks)
    prefixes = [[rng.randrange(8) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    live = []
    for i in range(150):
        op = rng.random()
        if op < 0.5 or not live:
            prompt = rng.choice(prefixes) + [rng.randrange(8) for _ in range(rng.randrange(10))]
            a, b = plain.add_request(i, prompt), tiered.add_request(i, prompt)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.block_ids == b.block_ids
                assert b.num_cached_tokens >= a.num_cached_tokens
                assert a.num_cached_tokens + a.num_new_tokens == b.num_cached_tokens + b.num_new_tokens
                live.append(i)
        elif op < 0.75:
            rid = rng.choice(live)
            tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 6))]
            assert plain.append_tokens(rid, tokens) == tiered.append_tokens(rid, tokens)
        else:
            rid = live.pop(rng.randrange(len(live)))
            plain.free(rid)
            tiered.free(rid)
        plain.take_kv_ops()
        tiered.take_kv_ops()
        assert plain.free_block_order() == tiered.free_block_order()
    plain.check_invariants()
    tiered.check_invariants()
    assert tiered.stats.hits >= plain.stats.hits
