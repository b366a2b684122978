"""The store start's short path (core/store_start.py) on a prompt of whole blocks: its
hits stop before the block holding its last token, as the general path's
(tests/store/test_start_path.py compares the two; this pins the answer itself)."""

from prefixkv import KVCacheManager
from prefixkv.store import SharedStore
from waiting import LIVE

from .conftest import always
from .test_readmit_path import BASE, stored  # noqa: F401 (a fixture)
from .test_start_path import Executor


def test_a_prompt_of_whole_blocks_on_the_device_hits_all_but_its_last(stored):  # noqa: F811
    m = KVCacheManager(16, 4, hash_mode="sha256", host_blocks=8,
                       store=SharedStore(*stored, cost=always(), timeout=LIVE, executor=Executor()))
    m.add_request("a", BASE[:24], read_cache=False)
    m.free("a")
    for k, rid in ((24, "b"), (23, "c")):
        adm = m.add_request(rid, m.prepare(BASE[:k]))
        assert adm.num_cached_tokens == 20, (k, adm)
        m.free(rid)
    m.check_invariants()
