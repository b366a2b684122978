"""``KVCacheManager.held_content`` (core/lookups.py), which the vLLM plug-in's block
objects read (integrations/vllm/block_hash_view.py), on the core alone: what a block
holds findable, by id, over the whole pool, and the ids it refuses."""

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import RequestError


def test_a_block_holds_its_content_while_cached_and_none_once_evicted():
    m = KVCacheManager(4, 4)
    m.add_request("a", list(range(9)))  # (blocks 0 and 1 full, block 2 partial)
    a0, a1, a2 = m.get_block_ids("a")
    held = [m.held_content(b) for b in (a0, a1, a2)]
    assert held[0] is not None and held[1] is not None and held[0] != held[1]
    assert held[0][0] == held[1][0] == 0 and held[2] is None
    m.free("a")
    assert [m.held_content(b) for b in (a0, a1)] == held[:2]  # (freed: still cached)
    m.add_request("b", list(range(50, 63)))  # (takes every block: a's evicted)
    now = [m.held_content(b) for b in m.get_block_ids("b")]
    assert None not in now[:3] and now[3] is None and not set(now[:3]) & set(held[:2])
    m.check_invariants()


def test_caching_off_holds_nothing():
    m = KVCacheManager(4, 4, enable_caching=False)
    m.add_request("a", list(range(9)))
    assert [m.held_content(b) for b in range(4)] == [None] * 4


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True])
def test_an_id_not_of_the_pool_is_refused(bad):
    m = KVCacheManager(4, 4)
    with pytest.raises(RequestError, match="block id"):
        m.held_content(bad)
    assert m.held_content(3) is None
