"""The hybrid manager given its sizes as a ``BlockSizes`` (groups/sizes.py
``manager_sizes``): one size for every group is the one-size manager; different sizes
make a ``SizedHybridKVCacheManager`` (groups/sized.py), checked call for call against
vLLM's own manager in tests/engines/test_vllm_block_sizes_manager.py and by hand here;
what it does not serve yet is refused with ConfigError (docs/groups.md), as are sizes
for another number of groups."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ConfigError, PromptTooLongError
from prefixkv.engine.build import UncachedHybridManager
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.groups.events import GroupBlockRemoved
from prefixkv.groups.sized import SizedHybridKVCacheManager

GROUPS = [full_attention(), sliding_window(12)]


def run(m):
    """A few calls whose block ids and hits depend on the block size."""
    prompt = list(range(40))
    a = m.add_request("a", prompt)
    step = m.append_step(["a"], [7])
    m.free("a")
    b = m.add_request("b", prompt + [1, 2])
    return (a.group_block_ids, step, b.num_cached_tokens, b.group_block_ids, m.lookup(prompt),
            m.get_block_ids("b"), m.take_events())


def test_one_size_for_every_group_is_the_one_size_manager():
    sized = HybridKVCacheManager(GROUPS, 64, BlockSizes.of([8, 8]), seed=0, enable_events=True)
    plain = HybridKVCacheManager(GROUPS, 64, 8, seed=0, enable_events=True)
    assert (sized.block_size, sized.sizes) == (8, BlockSizes((8, 8), 8, 8))
    assert plain.sizes == sized.sizes
    assert run(sized) == run(plain)
    assert sized.prepare(list(range(20))).chunks == plain.prepare(list(range(20))).chunks
    sized.check_invariants()


@pytest.mark.parametrize("sizes, match", [
    (BlockSizes.of([8]), r"one block size per group \(2\), got 1"),
    (BlockSizes.of([8, 8, 8]), r"one block size per group \(2\), got 3"),
    (BlockSizes((8, 12), 8, 24), "multiple of hash_size 8"),  # (built around BlockSizes.of)
    (BlockSizes((8, 0), 8, 8), "a group's block size must be a positive int"),
])
def test_sizes_it_does_not_serve_are_refused(sizes, match):
    with pytest.raises(ConfigError, match=match):
        HybridKVCacheManager(GROUPS, 64, sizes)



@pytest.mark.parametrize("sizes", [BlockSizes.of([8, 16]), BlockSizes.of([16, 16], hash_size=8),
                                   BlockSizes.of([16, 16], align=32)])
def test_sizes_that_are_not_one_size_make_the_sized_manager(sizes):
    m = HybridKVCacheManager(GROUPS, 64, block_size=sizes)
    assert type(m) is SizedHybridKVCacheManager and m.sizes == sizes and m.block_size == sizes.align


def test_what_the_sized_manager_does_not_serve_yet_is_refused():
    with pytest.raises(ConfigError, match="UncachedHybridManager serves one block size"), \
            pytest.warns(DeprecationWarning):
        UncachedHybridManager(GROUPS, 64, BlockSizes.of([8, 16]))  # type: ignore[arg-type]
    m = HybridKVCacheManager(GROUPS, 64, BlockSizes.of([8, 16]))
    m.add_request("a", list(range(40)))
    # (rewind: tests/test_groups_sizes_rewind.py)
    for call in (lambda: m.fork("a", "b"), lambda: m.uncache_blocks([1])):
        with pytest.raises(ConfigError, match="not served with groups of different block sizes yet"):
            call()
    m.check_invariants()


def test_mamba_beside_full_attention_of_another_size_by_hand():
    # full attention at 8 beside Mamba at 4 (hash 4, lcm 8; block 0 is the null block):
    # Mamba takes one block where each step ends, releases the state block before the
    # one it reads, records a block holding the state at its own end once the cached
    # tokens (rounded down to 8) pass it; hits at multiples of 8 need its state there
    m = HybridKVCacheManager([full_attention(), mamba()], 16, BlockSizes.of([8, 4]), enable_events=True)
    a = m.add_request("a", list(range(20)), num_new_tokens=8)
    assert a.group_block_ids == ((1,), (0, 2))
    assert [(e.group_idx, e.block_size, len(e.token_ids)) for e in m.take_events()] == [(0, 8, 8), (1, 4, 4)]
    assert m.extend("a", 8) == ((3,), (4,)) and m.get_block_ids("a") == ((1, 3), (0, 2, 0, 4))
    assert m.extend("a", 4) == ((5,), (6,)) and m.get_block_ids("a") == ((1, 3, 5), (0, 0, 0, 4, 6))
    assert m.free_block_order() == [7, 8, 9, 10, 11, 12, 13, 14, 15, 2]  # (2: the state at 8, cached)
    assert m.lookup_block_ids(list(range(20)) + [7]) == ((1, 3), (0, 0, 0, 4))
    assert m.lookup_block_ids(list(range(12)) + [50, 51]) == ((1,), (0, 2))  # (no state at 12 is kept)
    m.free("a")
    assert m.free_block_order() == [6, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 3, 1, 4]
    b = m.add_request("b", list(range(16)) + [9, 9], num_new_tokens=2)
    assert b.num_cached_tokens == 16 and b.group_block_ids == ((1, 3, 6), (0, 0, 0, 4, 5))
    m.check_invariants()


def test_peek_beside_a_mamba_group_of_another_size_is_refused():
    # vLLM's EAGLE beside Mamba moves Mamba's checkpoints to EAGLE's replay boundary: not served
    with pytest.raises(ConfigError, match="peek .* beside a Mamba group"):
        HybridKVCacheManager([full_attention(), mamba()], 16, BlockSizes.of([4, 8], peek=(True, False)))
    m = HybridKVCacheManager([full_attention(), mamba()], 16, BlockSizes.of([8, 4]))
    with pytest.raises(ConfigError, match="peek with groups of different block sizes"):
        m.lookup(list(range(20)), peek=True)


def test_a_mamba_block_a_step_ran_past_is_never_recorded():
    # a step from 6 to 12 runs past the end of Mamba block 1 (at 8): the block holds the
    # state at 6, so it is not recorded when the cached tokens reach 8 (nor after)
    m = HybridKVCacheManager([full_attention(), mamba()], 16, BlockSizes.of([8, 4]))
    m.add_request("a", list(range(20)), num_new_tokens=6)
    m.extend("a", 6)
    m.extend("a", 4)
    assert m.lookup(list(range(8)) + [50]) == 0 and m.lookup(list(range(16)) + [50]) == 16
    m.check_invariants()


def test_tables_hits_and_caching_at_different_sizes_by_hand():
    # full attention at 8 beside a 12-token window at 16: hash block 8, lcm 16
    m = HybridKVCacheManager(GROUPS, 64, BlockSizes.of([8, 16]), enable_events=True)
    a = m.add_request("a", list(range(40)))  # 5 blocks of 8, 3 of 16; cached up to 32
    assert [len(t) for t in a.group_block_ids] == [5, 3]
    stored = [(e.group_idx, e.block_size, len(e.token_ids)) for e in m.take_events()]
    assert stored == [(0, 8, 8)] * 4 + [(1, 16, 16)] * 2
    assert m.lookup(list(range(40)) + [1]) == 32  # (aligned to 16, though 40 are in group 0)
    assert m.lookup(list(range(31)) + [1]) == 16
    b = m.add_request("b", list(range(33)) + [5] * 7)
    assert b.num_cached_tokens == 32 and b.group_block_ids[0][:4] == a.group_block_ids[0][:4]
    # the window at 32 reads 21..32: its block 0 is the null block, its block 1 shared
    assert b.group_block_ids[1][:2] == (m.null_block_id, a.group_block_ids[1][1])
    for _ in range(8):  # to 48 tokens: a's blocks up to 48 are recorded at 48
        m.append_tokens("a", [7])
    assert m.num_scheduled_tokens("a") == 48 and len(m.get_block_ids("a")[1]) == 3
    assert [(e.group_idx, e.block_size) for e in m.take_events()] == [(0, 8), (0, 8), (1, 16)]
    m.check_invariants()
    m.free("a")
    m.free("b")
    m.check_invariants()


LAYOUTS = [  # (block size, window or None) per group: test_vllm_block_sizes_reference's kinds
    ((8, None), (16, 20)), ((8, 10), (16, None)), ((8, None), (24, None)),
    ((8, 6), (16, None), (32, 40)), ((16, 17), (8, None), (8, 9)), ((16, 20), (24, None)),
]


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), n=st.integers(1, 150), chunk=st.integers(1, 150))
def test_the_events_are_what_block_sizes_says_is_stored(layout, n, chunk):
    # a prompt of n tokens computed whole, in chunks: one GroupBlockStored per block
    # BlockSizes.stored names, its partial tail entries included (one hash block), keyed
    # by the chain hash at the block's last hash boundary, its parent the group's block
    # before, its tokens the block's; each once, whatever the chunks
    specs = [full_attention() if w is None else sliding_window(w) for _, w in layout]
    sizes = BlockSizes.of([b for b, _ in layout])
    m = HybridKVCacheManager(specs, 200, sizes, enable_events=True, seed=0)
    prompt = [5 + k % 7 for k in range(n)]
    m.add_request("r", prompt, num_new_tokens=chunk)
    while m.num_scheduled_tokens("r") < n:
        m.extend("r", min(chunk, n - m.num_scheduled_tokens("r")))
        m.check_invariants()
    hashes = m.prepare(prompt).hashes
    fine = {h: i for i, h in enumerate(hashes)}
    got = []
    for e in m.take_events():
        (key,) = e.block_hashes
        i, b = fine[key], e.block_size
        j = e.first_block
        assert (j + 1) * b // sizes.hash_size - 1 == i and e.token_ids == prompt[j * b:(j + 1) * b]
        assert e.parent_block_hash == (None if j == 0 else hashes[j * b // sizes.hash_size - 1])
        got.append((e.group_idx, i, b))
    assert sorted(got) == sorted(sizes.stored(specs, n))


def test_a_partial_tail_is_withdrawn_after_its_block_and_restated_after_an_overflow():
    # full attention at 8 beside full attention at 16: a prompt of 16 tokens puts the
    # partial tail entry of its hash block 0 (tokens 0..7) in group 1's block 0 (vLLM's
    # cache_partial_block); when that block is evicted, vLLM withdraws its own entry,
    # then the tail; an overflowed log restates it after the group's blocks
    sizes = BlockSizes.of([8, 16])
    specs = [full_attention(), full_attention()]
    prompt = list(range(16))
    m = HybridKVCacheManager(specs, 6, sizes, enable_events=True, seed=0, max_events=2)
    hashes = m.prepare(prompt).hashes
    m.add_request("r", prompt)
    stored = [(e.group_idx, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
              for e in m.take_events()[1:]]  # (after the AllBlocksCleared of the overflow)
    assert stored == [(0, (hashes[0],), None, prompt[:8], 8), (0, (hashes[1],), hashes[0], prompt[8:], 8),
                      (1, (hashes[1],), None, prompt, 16), (1, (hashes[0],), None, prompt[:8], 8)]
    m = HybridKVCacheManager(specs, 6, sizes, enable_events=True, seed=0)
    m.add_request("r", prompt)
    m.free("r")
    m.take_events()
    m.add_request("s", [50 + k for k in range(32)])  # (the whole pool: every block evicted)
    removed = [(e.group_idx, e.block_hashes) for e in m.take_events() if isinstance(e, GroupBlockRemoved)]
    assert sorted(removed) == sorted((g, (h,)) for g in (0, 1) for h in hashes)
    assert removed[removed.index((1, (hashes[1],))) + 1] == (1, (hashes[0],))
    m.check_invariants()


OPS = st.lists(st.tuples(st.sampled_from("aaeeeddddrfFl"), st.integers(0, 3), st.integers(1, 60),
                         st.integers(0, 20)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), pool=st.integers(12, 80), ops=OPS)
def test_random_calls_keep_the_sized_manager_sound(layout, pool, ops):
    # admissions (chunks, lookahead, external tokens, capped hits), prefill chunks,
    # decode steps, reserves and frees on a small pool: after each call the invariants
    # hold (each group's table at its own size, recorded exactly where BlockSizes.caches
    # says); a call that returns None changed nothing; num_blocks_to_allocate is what
    # the next chunk takes
    specs = [full_attention() if w is None else sliding_window(w) for _, w in layout]
    m = HybridKVCacheManager(specs, pool, BlockSizes.of([b for b, _ in layout]), enable_events=True)
    live: dict[int, int] = {}  # request -> its prompt length
    for op, r, k, x in ops:
        before = ({q: m.get_block_ids(q) for q in live}, m.num_free_blocks)
        if op == "a" and r not in live:
            prompt = [r % 2 * 50 + t % 9 for t in range(k + x)]
            try:
                got = m.add_request(r, prompt, num_new_tokens=max(1, k // 2), num_lookahead_tokens=x % 3,
                                    num_external_tokens=x % 5, max_hit_tokens=None if x % 2 else k)
            except PromptTooLongError:
                got = None
            if got is not None:
                live[r] = len(prompt)
        elif op == "e" and r in live and m.num_scheduled_tokens(r) < live[r]:
            n = min(x + k, live[r] - m.num_scheduled_tokens(r))
            want = m.num_blocks_to_allocate(r, m.num_scheduled_tokens(r) + n)
            free = m.num_free_blocks
            got = m.extend(r, n)
            if got is not None:  # (net of what the window's release returns)
                assert max(0, free - m.num_free_blocks) == want
        elif op == "d":
            for t in range(x + 1):  # (decode steps: each request's token is its own)
                ready = [q for q in live if m.num_scheduled_tokens(q) == m.num_tokens(q)]
                held = {q: m.get_block_ids(q) for q in ready}  # (this step's: earlier ones grew)
                step = m.append_step(ready, [100 + 10 * q + t % 10 for q in ready])
                for q in step.short:
                    assert m.get_block_ids(q) == held[q]
                m.check_invariants()
            got = True
        elif op == "r" and r in live:
            got = m.reserve(r, x)
        elif op in "fF" and r in live:
            m.free(r, num_computed_tokens=None if op == "f" else m.num_scheduled_tokens(r) // 2)
            del live[r]
            got = True
        elif op == "l":
            assert m.lookup([r % 2 * 50 + t % 9 for t in range(k)]) % m.block_size == 0
            got = True
        else:
            continue
        if got is None:
            assert ({q: m.get_block_ids(q) for q in live}, m.num_free_blocks) == before
        m.check_invariants()


def test_what_a_request_computes_after_a_block_that_lost_its_kv_is_never_found():
    # a computes a 40-token prompt (its blocks below 32 recorded), c the same prompt
    # without reading the cache (its blocks are spares of a's); b hits a's 32 tokens
    # and ends there; a is freed before any of its tokens were computed: its blocks
    # lose their content (the prefix stays found in c's spares), so what b computes on
    # top of them (from its last hit block on: the one-size manager's cut_off) is never
    # found, as at one block size
    for sizes in (8, BlockSizes.of([8, 16])):
        m = HybridKVCacheManager(GROUPS, 80, sizes)
        prompt = list(range(40))
        m.add_request("a", prompt)
        m.add_request("c", prompt, read_cache=False)
        assert m.add_request("b", prompt[:32] + [7]).num_cached_tokens == 32
        m.free("a", num_computed_tokens=0)
        m.check_invariants()
        for _ in range(23):
            m.append_tokens("b", [9])
        m.check_invariants()
        assert m.lookup(prompt[:32] + [7] + [9] * 23 + [1]) == 32, sizes


def test_a_hit_names_the_first_cached_copy_once_the_holder_is_evicted():
    # Full attention at 4 and 12 (hash 4, lcm 12). b and c hit a's first 12 tokens and
    # recompute its hash blocks 3 and 4 (past the aligned hit): their blocks 3 and 4 in
    # the group at 4 are spares of a's, b's made first. d evicts a's blocks; vLLM 0.33
    # then finds the copy it cached first, b's (tests/engines/test_vllm_sized_model.py:
    # the same ids, one lower, as prefixkv keeps no null block here). Before, c's.
    stem = [1 + k % 7 for k in range(48)]
    m = HybridKVCacheManager([full_attention(), full_attention()], 24, BlockSizes.of([4, 12]), seed=0)
    m.add_request("a", stem[:20] + [0] * 4)
    m.free("a")
    m.add_request("b", stem[:25])
    m.add_request("c", stem[:20] + [9] * 4 + [0])
    assert m.get_block_ids("b") == ((0, 1, 2, 8, 9, 10, 11), (6, 12, 13))
    assert m.get_block_ids("c") == ((0, 1, 2, 14, 15, 16, 17), (6, 18, 19))
    m.add_request("d", [9 - k % 5 for k in range(12)] + [0])
    assert m.get_block_ids("d") == ((20, 21, 22, 23), (5, 4))  # (a's blocks 5 and 4 evicted)
    assert m.lookup_block_ids(stem) == ((0, 1, 2, 3, 9, 10), (6, 12))  # (b's block 4)
    assert m.free_block_order() == [3, 7]
    m.check_invariants()
