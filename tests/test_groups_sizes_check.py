"""The sized manager's invariant check (groups/sized_release.py ``_check_request``) names a
request's block that lacks the content its place says it holds, or holds another
prefix's (groups/request.py ``GroupRequest.check``): full attention at 4
beside a window of 8 at 8, a 17-token prompt (its full-attention blocks 0..3 recorded,
the last one included). The block's key is taken away by hand, as a bug would, and put back."""

import pytest

from prefixkv import InvariantError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, sliding_window


@pytest.mark.parametrize("j", [0, 1, 3])
def test_a_recorded_block_without_content_is_named(j):
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 30, BlockSizes.of([4, 8]))
    m.add_request("a", list(range(17)))
    m.check_invariants()
    b = m._requests["a"].tables[0][j]
    key, b.key = b.key, None
    with pytest.raises(InvariantError, match=f"request 'a' group 0: block {j} lacks content at 17 tokens"):
        m.check_invariants()
    b.key = key
    m.check_invariants()


def test_a_recorded_block_holding_another_prefix_is_named():
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 30, BlockSizes.of([4, 8]))
    m.add_request("a", list(range(17)))
    t = m._requests["a"].tables[0]
    t[1].key, t[2].key = t[2].key, t[1].key
    with pytest.raises(InvariantError, match="request 'a' group 0: block 1 holds another prefix"):
        m.check_invariants()
    t[1].key, t[2].key = t[2].key, t[1].key
    m.check_invariants()
