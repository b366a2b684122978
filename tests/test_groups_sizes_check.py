"""The sized manager's invariant check (groups/sized_release.py ``_check_request``) names a
request's block that lacks the content its place says it holds: full attention at 4
beside a window of 8 at 8, a 17-token prompt (its full-attention blocks 0..3 recorded).
The block's key is taken away by hand, as a bug would, and put back."""

import pytest

from prefixkv import InvariantError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, sliding_window


def test_a_recorded_block_without_content_is_named():
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 30, BlockSizes.of([4, 8]))
    m.add_request("a", list(range(17)))
    m.check_invariants()
    b = m._requests["a"].tables[0][1]
    key, b.key = b.key, None
    with pytest.raises(InvariantError, match="request 'a' group 0: block 1 lacks content at 17 tokens"):
        m.check_invariants()
    b.key = key
    m.check_invariants()
