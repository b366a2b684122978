"""A fork beside an uncached window (``sliding_window(W, cached=False)``): the child's
window holds what the parent's holds, so the positions below what the parent's engine
rebuilt are lost to it too (a case mutants-r25's mutation pass found no test of)."""

from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

PROMPT = list(range(100, 140))


def test_a_forked_child_reads_lost_kv_below_the_parents_rebuilt_window():
    # b hits a's 12 tokens; its uncached 6-token window holds fresh blocks rebuilt from
    # 7 on only, and c, forked from b, holds the same: a recompute of c from 9 reads
    # 4..9, whose 4..6 hold nothing, so what it computes is never cached
    m = HybridKVCacheManager([full_attention(), sliding_window(6, cached=False)], 40, 4)
    m.add_request("a", PROMPT[:12])
    m.free("a")
    assert m.add_request("b", PROMPT[:16]).num_cached_tokens == 12
    assert m.fork("b", "c") is not None
    assert m.reads_released("c", 9) and m.reads_released("c", 11)
    assert m.reads_released("c", 9) == m.reads_released("b", 9)
    m.rewind("c", 9)
    m.append_tokens("c", PROMPT[9:16])
    m.check_invariants()
    m.free("b")
    m.free("c")
    assert m.lookup(PROMPT[:16] + [0]) == 8
