"""``KVCacheManager.ref_cnt`` takes every block id of the pool, the last one included,
and refuses one past it with RequestError (core/manager.py)."""

import pytest

from prefixkv import KVCacheManager, RequestError


def test_ref_cnt_takes_the_last_block_id_and_refuses_the_next():
    m = KVCacheManager(4, 4)
    m.add_request("a", list(range(16)))      # every block: 0..3
    assert [m.ref_cnt(i) for i in range(4)] == [1, 1, 1, 1]
    for bad in (-1, 4):
        with pytest.raises(RequestError):
            m.ref_cnt(bad)
