"""Groups of different block sizes (groups/sizes.py, hits.longest_sized_hit): the hit rule
against brute force over every aligned length, the one-size rule it must agree with, the
keys and the blocks cached. vLLM's own manager checks them in
tests/engines/test_vllm_block_sizes_reference.py."""

import math
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ConfigError
from prefixkv.groups import (
    BlockSizes,
    chunked_local,
    full_attention,
    longest_hit,
    longest_sized_hit,
    mamba,
    sliding_window,
)

specs = st.one_of(
    st.just(full_attention()),
    st.integers(1, 40).map(sliding_window),
    st.integers(1, 40).map(chunked_local),
    st.just(mamba()),
)


def brute_force(groups, sizes, align, limit, cached):
    """The largest aligned L <= limit at which every group holds the blocks a query at L
    reads, trying every L (the definition, docs/groups.md "Hits")."""
    def serves(g, end):
        b = sizes[g]
        return all(cached[g][j] for j in range(groups[g].first_needed(end) // b, end // b))
    return max(end for end in range(0, limit + 1, align) if all(serves(g, end) for g in range(len(groups))))


@settings(max_examples=400, deadline=None)
@given(groups=st.lists(specs, min_size=1, max_size=4), data=st.data())
def test_longest_sized_hit_equals_brute_force_and_probes_each_block_once(groups, data):
    hash_size = data.draw(st.integers(1, 3))
    sizes = [hash_size * data.draw(st.sampled_from([1, 2, 3, 4])) for _ in groups]
    align = reduce(math.lcm, sizes) * data.draw(st.sampled_from([1, 1, 2]))
    limit = data.draw(st.integers(-1, 60))
    cached = [data.draw(st.lists(st.booleans(), min_size=61 // b, max_size=61 // b)) for b in sizes]
    probes = []

    def probe(g, j):
        assert 0 <= j < max(limit, 0) // align * align // sizes[g]
        probes.append((g, j))
        return cached[g][j]

    assert longest_sized_hit(groups, sizes, align, limit, probe) == \
        brute_force(groups, sizes, align, max(limit, 0), cached)
    assert len(probes) == len(set(probes))


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(specs, min_size=1, max_size=4), bs=st.integers(1, 5), data=st.data())
def test_at_one_block_size_it_is_the_one_size_hit(groups, bs, data):
    limit = data.draw(st.integers(0, 12))
    cached = [data.draw(st.lists(st.booleans(), min_size=limit, max_size=limit)) for _ in groups]

    def probe(g, j):
        return cached[g][j]

    sized = longest_sized_hit(groups, [bs] * len(groups), bs, limit * bs + bs - 1, probe)
    assert sized == longest_hit(groups, bs, limit, probe) * bs


def test_a_hit_by_hand():
    # full attention at 8 beside a 20-token window at 16 (lcm 16): a query at 48 reads full
    # blocks 0..5 and window blocks 29 // 16 = 1 .. 2; at 32, window 0..1; at 16, window 0
    sizes = BlockSizes.of([8, 16])
    groups = (full_attention(), sliding_window(20))
    have = {(0, j) for j in range(6)} | {(1, 1), (1, 2)}
    assert sizes.longest_hit(groups, 50, lambda g, j: (g, j) in have) == 48
    have.discard((1, 1))
    assert sizes.longest_hit(groups, 50, lambda g, j: (g, j) in have) == 0
    have.add((1, 0))
    assert sizes.longest_hit(groups, 50, lambda g, j: (g, j) in have) == 16
    assert sizes.longest_hit(groups, 15, lambda g, j: True) == 0  # (below the lcm)


def test_block_sizes_of_defaults_and_keys():
    sizes = BlockSizes.of([8, 24, 16])
    assert (sizes.sizes, sizes.hash_size, sizes.align) == ((8, 24, 16), 8, 48)
    # group 1's block j (positions 24j .. 24j + 23) is keyed by fine hash 3j + 2
    assert [sizes.key_index(1, j) for j in range(3)] == [2, 5, 8]
    assert [sizes.key_index(0, j) for j in range(3)] == [0, 1, 2]
    assert [sizes.num_keyed(1, n) for n in (2, 3, 5, 6)] == [0, 1, 1, 2]
    explicit = BlockSizes.of((8, 16), hash_size=4, align=32)
    assert (explicit.key_index(0, 0), explicit.key_index(1, 0), explicit.align) == (1, 3, 32)


@pytest.mark.parametrize("args, match", [
    (([],), "one block size per group"),
    ((3,), "sequence of block sizes"),
    (([8, 0],), "positive int"),
    (([8, True],), "positive int"),
    (([8, 16], 3), "multiple of hash_size 3"),
    (([8, 16], 8, 24), "multiple of every group's block size"),
    (([8, 16], 0), "hash_size must be a positive int"),
    (([8, 16], None, -16), "align must be a positive int"),
])
def test_block_sizes_of_refuses_bad_sizes(args, match):
    with pytest.raises(ConfigError, match=match):
        BlockSizes.of(*args)


@settings(max_examples=300, deadline=None)
@given(spec=specs, k=st.integers(1, 4), per=st.integers(1, 4), n=st.integers(0, 120))
def test_a_block_is_cached_iff_a_hit_at_an_aligned_end_within_the_computed_tokens_reads_it(spec, k, per, n):
    sizes = BlockSizes.of([k, 4 * k], hash_size=k, align=4 * k * per)  # (group 0 at size k)
    ends = range(sizes.align, n // sizes.align * sizes.align + 1, sizes.align)
    for j in range(n // k + 2):
        reads = any(spec.first_needed(hit) // k <= j < hit // k for hit in ends)
        if spec.sparse:  # (Mamba: every block, vLLM's dense retention)
            reads = (j + 1) * k <= n // sizes.align * sizes.align
        assert sizes.caches(spec, 0, n, j) == reads, (j, spec)


def test_cached_and_stored_by_hand():
    # a 20-token window at 8 beside full attention at 24 (lcm 24): at 72 tokens the window
    # caches the cdiv(19, 8) = 3 blocks before each boundary: all its blocks; a 17-token
    # window cdiv(16, 8) = 2 of every 3; full attention its 3 blocks, and the last hash
    # boundary (72 - 1) // 8 * 8 = 64 lies inside its block 2 (64 % 24 = 16), below the
    # end 72: a partial entry at fine hash 64 // 8 - 1 = 7, announced at size 8. At 71
    # tokens the end is 48 < 64: no partial entry.
    sizes = BlockSizes.of([8, 24])
    wide, narrow = (sliding_window(20), full_attention()), (sliding_window(17), full_attention())
    assert [sizes.caches(wide[0], 0, 72, j) for j in range(9)] == [True] * 9
    assert [sizes.caches(narrow[0], 0, 72, j) for j in range(9)] == [False, True, True] * 3
    assert [sizes.caches(narrow[0], 0, 71, j) for j in range(9)] == [False, True, True] * 2 + [False] * 3
    assert sizes.stored(narrow, 72) == [(0, j, 8) for j in (1, 2, 4, 5, 7, 8)] + [
        (1, 2, 24), (1, 5, 24), (1, 8, 24), (1, 7, 8)]
    assert sizes.stored(narrow, 71) == [(0, j, 8) for j in (1, 2, 4, 5)] + [(1, 2, 24), (1, 5, 24)]
    # Mamba at 8 beside full attention at 24: only its block where the prompt ends, when
    # the prompt ends at a multiple of 24
    states = (mamba(), full_attention())
    assert sizes.stored(states, 72) == [(0, 8, 8), (1, 2, 24), (1, 5, 24), (1, 8, 24), (1, 7, 8)]
    assert sizes.stored(states, 71) == [(1, 2, 24), (1, 5, 24)]
