"""The hybrid manager given its sizes as a ``BlockSizes`` (groups/sizes.py
``manager_sizes``): one size for every group is the one-size manager; what it does not
serve yet (groups of different block sizes, docs/groups.md) is refused at construction
with ConfigError, as are sizes for another number of groups."""

import pytest

from prefixkv import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, sliding_window

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
    (BlockSizes.of([8, 16]), "not served by HybridKVCacheManager yet"),
    (BlockSizes.of([16, 16], hash_size=8), "not served by HybridKVCacheManager yet"),
    (BlockSizes.of([16, 16], align=32), "not served by HybridKVCacheManager yet"),
    (BlockSizes.of([8]), r"one block size per group \(2\), got 1"),
    (BlockSizes.of([8, 8, 8]), r"one block size per group \(2\), got 3"),
    (BlockSizes((8, 12), 8, 24), "multiple of hash_size 8"),  # (built around BlockSizes.of)
    (BlockSizes((8, 0), 8, 8), "a group's block size must be a positive int"),
])
def test_sizes_it_does_not_serve_are_refused(sizes, match):
    with pytest.raises(ConfigError, match=match):
        HybridKVCacheManager(GROUPS, 64, sizes)

