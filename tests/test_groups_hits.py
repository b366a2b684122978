"""The hit rule against brute force over every candidate length, and the specs' policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ConfigError
from prefixkv.groups import GroupSpec, chunked_local, full_attention, longest_hit, mamba, sliding_window

specs = st.one_of(
    st.just(full_attention()),
    st.integers(1, 13).map(sliding_window),
    st.builds(sliding_window, st.integers(1, 13), st.integers(1, 9)),  # (retained: hits ignore it)
    st.integers(1, 13).map(chunked_local),
)


def brute_force(groups, bs, limit, cached):
    """The largest k every group accepts, trying every k (the definition)."""
    def accepts(g, k):
        lo = 0 if not groups[g].releases else groups[g].first_needed(k * bs) // bs
        return all(cached[g][j] for j in range(lo, k))
    return max(k for k in range(limit + 1) if all(accepts(g, k) for g in range(len(groups))))


@settings(max_examples=400, deadline=None)
@given(groups=st.lists(specs, min_size=1, max_size=4), bs=st.integers(1, 5),
       data=st.data())
def test_longest_hit_equals_brute_force_and_probes_each_block_once(groups, bs, data):
    limit = data.draw(st.integers(0, 12))
    cached = [data.draw(st.lists(st.booleans(), min_size=limit, max_size=limit)) for _ in groups]
    probes = []

    def probe(g, j):
        assert 0 <= j < limit
        probes.append((g, j))
        return cached[g][j]

    assert longest_hit(groups, bs, limit, probe) == brute_force(groups, bs, limit, cached)
    assert len(probes) == len(set(probes))


def brute_force_peek(groups, bs, limit, cached, peek):
    """The largest k every group accepts, where a peeking group also needs block k
    cached (k > 0), trying every k."""
    def accepts(g, k):
        lo = 0 if not groups[g].releases else groups[g].first_needed(k * bs) // bs
        return k == 0 or all(cached[g][j] for j in range(lo, k + peek[g]))
    return max(k for k in range(limit + 1) if all(accepts(g, k) for g in range(len(groups))))


@settings(max_examples=400, deadline=None)
@given(groups=st.lists(st.one_of(specs, st.just(mamba())), min_size=1, max_size=4),
       bs=st.integers(1, 5), data=st.data())
def test_longest_hit_with_peeking_groups_equals_brute_force_and_probes_each_block_once(groups, bs, data):
    limit = data.draw(st.integers(0, 12))
    peek = data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    cached = [data.draw(st.lists(st.booleans(), min_size=limit + 1, max_size=limit + 1)) for _ in groups]
    probes = []

    def probe(g, j):
        assert 0 <= j < limit + peek[g]
        probes.append((g, j))
        return cached[g][j]

    got = longest_hit(groups, bs, limit, probe, peek)
    assert got == brute_force_peek(groups, bs, limit, cached, peek)
    assert len(probes) == len(set(probes))


def test_a_peeking_group_needs_the_block_after_the_hit():
    bs, both = 4, [full_attention(), sliding_window(8)]   # the window reads blocks k-2, k-1
    everything = lambda g, j: True  # noqa: E731
    assert longest_hit(both, bs, 5, everything, (True, True)) == 5      # block 5 probed too
    assert longest_hit(both, bs, 5, lambda g, j: j < 5, (True, True)) == 4
    # the window's block 3 gone: without peeking, k=5 reads 3, 4 (no), k=3 reads 1, 2
    assert longest_hit(both, bs, 5, lambda g, j: g == 0 or j != 3) == 3
    # peeking, k=3 needs block 3 as well: k=2 (blocks 0, 1, and 2 peeked)
    assert longest_hit(both, bs, 5, lambda g, j: g == 0 or j != 3, (True, True)) == 2
    assert longest_hit(both, bs, 5, lambda g, j: j != 0, (True, True)) == 0
    assert longest_hit([full_attention()], bs, 3, lambda g, j: j < 1, (True,)) == 0


def test_a_window_needs_only_its_blocks_and_a_miss_inside_it_drops_the_hit_below_the_miss():
    bs = 4
    w = [sliding_window(8)]  # a query at 4k reads 4k-7 .. 4k: blocks k-2, k-1
    # blocks 0..5 of which 0, 1 and 3 are gone: k=6 needs blocks 4, 5 (cached)
    assert longest_hit(w, bs, 6, lambda g, j: j not in (0, 1, 3)) == 6
    # 4 gone: k in 5..6 need it; k=4 needs blocks 2, 3 (3 gone); k in 2..3 need 1 (gone)
    assert longest_hit(w, bs, 6, lambda g, j: j not in (4, 3, 1)) == 1
    assert longest_hit(w, bs, 6, lambda g, j: j != 4) == 4
    # with a full-attention group, every block from 0 counts
    both = [full_attention(), sliding_window(8)]
    assert longest_hit(both, bs, 6, lambda g, j: g == 1 or j < 5) == 5
    assert longest_hit(both, bs, 6, lambda g, j: g == 0 or j != 3) == 6  # 3 is out of reach
    assert longest_hit(both, bs, 6, lambda g, j: g == 0 or j != 4) == 4


def test_chunked_local_needs_the_blocks_of_the_current_chunk_only():
    c = [chunked_local(8)]  # bs 4: chunks are blocks (0, 1), (2, 3), ...
    assert longest_hit(c, 4, 5, lambda g, j: j == 4) == 5      # k=5: chunk from block 4
    assert longest_hit(c, 4, 5, lambda g, j: j != 4) == 4      # k=4 starts a chunk: nothing
    assert longest_hit(c, 4, 3, lambda g, j: False) == 2


def test_first_needed_matches_the_kernels_window():
    # window_size (W - 1, 0): a query at p reads p - (W - 1) .. p
    spec = sliding_window(5)
    assert spec.window_size == (4, 0) and spec.first_needed(10) == 6 and spec.first_needed(2) == 0
    assert spec.num_unread(10, 4) == 1 and spec.num_unread(12, 4) == 2
    assert full_attention().window_size is None and full_attention().first_needed(99) == 0
    assert chunked_local(6).first_needed(13) == 12


@pytest.mark.parametrize("make", [
    lambda: GroupSpec("local"), lambda: GroupSpec("full_attention", 4),
    lambda: sliding_window(0), lambda: chunked_local(-1), lambda: sliding_window(True),
    lambda: chunked_local(3).window_size,
])
def test_bad_specs_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()


@settings(max_examples=300, deadline=None)
@given(spec=specs, bs=st.integers(1, 6), cut=st.integers(0, 8))
def test_release_at_and_unread_from_are_the_first_positions_past_which_a_block_goes(spec, bs, cut):
    """``unread_from``: the first position no query reads block ``cut`` from;
    ``release_at``: the first one the request releases it at (``retained`` later)."""
    if not spec.releases:
        assert all(spec.num_unread(p, bs) == 0 == spec.num_released(p, bs) for p in range(200))
        return
    at, unread = spec.release_at(cut, bs), spec.unread_from(cut, bs)
    assert spec.num_unread(unread, bs) > cut and spec.num_unread(unread - 1, bs) <= cut
    assert spec.num_released(at, bs) > cut and spec.num_released(at - 1, bs) <= cut
    assert at == unread + spec.retained


def vllm_sliding_hit(window, bs, cached):
    """vLLM's sliding-window hit, as its SlidingWindowManager documents it (written here
    from that description): scanning from the right, the hit ends at the top of the first
    run of ceil((W - 1) / bs) consecutive cached blocks; without such a run, the run of
    cached blocks from block 0 is the hit."""
    need = -(-(window - 1) // bs)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        run = run + 1 if cached[i] else 0
        if run >= need:
            return i + run
    lead = 0
    while lead < len(cached) and cached[lead]:
        lead += 1
    return lead


@settings(max_examples=400, deadline=None)
@given(window=st.integers(2, 20), bs=st.integers(1, 6), data=st.data())
def test_a_sliding_group_hits_as_vllm_defines_it(window, bs, data):
    cached = data.draw(st.lists(st.booleans(), max_size=14))
    got = longest_hit([sliding_window(window)], bs, len(cached), lambda g, j: cached[j])
    assert got == vllm_sliding_hit(window, bs, cached)


def test_vllm_documented_examples():
    # find_longest_cache_hit's docstring: block size 4, window 8 -> [NULL, NULL, b7, b8]
    assert sliding_window(8).num_unread(4 * 4, 4) == 2
    # remove_skipped_blocks: blocks below (num_computed - W + 1) // bs are dropped
    for computed in range(40):
        assert sliding_window(8).num_unread(computed, 4) == max(0, computed - 8 + 1) // 4


@pytest.mark.parametrize(("block_size", "limit"), [(0, 4), (-16, 4), (True, 4), (16.0, 4), (None, 4),
                                                   (16, 4.0), (16, None)])
def test_longest_hit_refuses_a_bad_block_size_or_limit(block_size, limit):
    """A block size that is not a positive int (0 was a ZeroDivisionError beside a window,
    a float a TypeError, deep in the search) or a limit that is not an int: ConfigError
    before ``cached`` is asked anything."""
    asked = []
    with pytest.raises(ConfigError, match="longest_hit"):
        longest_hit((full_attention(), sliding_window(32)), block_size, limit,
                    lambda g, j: asked.append((g, j)) or True)
    assert asked == []


@pytest.mark.parametrize(("sizes", "align", "limit"), [((8, 16), 0, 64), ((8, 16), 24, 64),
                                                       ((8, 0), 16, 64), ((8,), 16, 64),
                                                       ((8, 16), 16.0, 64), ((8, 16), 16, None)])
def test_longest_sized_hit_refuses_sizes_that_do_not_divide_align(sizes, align, limit):
    """Sizes and an alignment ``BlockSizes`` would refuse (a size not dividing ``align``,
    0, fewer sizes than groups, a float) or a limit that is not an int: ConfigError
    before ``cached`` is asked anything (0 was a ZeroDivisionError)."""
    from prefixkv.groups import longest_sized_hit

    asked = []
    with pytest.raises(ConfigError, match="longest_sized_hit"):
        longest_sized_hit((full_attention(), sliding_window(32)), sizes, align, limit,
                          lambda g, j: asked.append((g, j)) or True)
    assert asked == []
