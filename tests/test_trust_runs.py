"""A request rewound and computed again records its blocks as a new shared run while
the run recorded the first time (headed by the block before them, not shared) is still
there, stale. Found by tests/test_trust_lazy_events.py's random workloads (a rewind,
then forks, frees and admissions): a claim verified the stale run (same tokens, same
parent) and took its blocks one by one, leaving them counted by the new run, still
free as one segment; the eviction then took that whole segment, and handed a block the
claim had just taken as a hit to the same request as a new block."""

from prefixkv import ExtraKeys, KVCacheManager

SALT = ExtraKeys(cache_salt="t")
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 347, 151, 315, 272]


def test_a_claim_through_a_stale_run_never_hands_out_a_hit_again():
    m = KVCacheManager(12, 4, hash_mode="xxhash", seed=3)
    m.add_request("r0", PROMPT, extra=SALT)             # blocks 0-3: a run [1, 2, 3] after 0
    m.add_request("r1", [100])
    m.free("r1")
    m.append_tokens("r0", [300, 409, 27, 488, 458])     # block 4 full, 5 partial
    m.fork("r0", "f4")
    m.fork("r0", "f5")
    m.add_request("r6", [100])
    m.free("f5")
    m.free("f4")
    m.append_tokens("r0", [401, 444, 452])              # block 5 full
    m.free("r6")
    m.take_kv_ops()
    m.rewind("r0", 7)                                   # blocks 1-5 lose their content
    assert m.extend("r0", 17) is not None               # ... and get it again: run [2..5] after 1
    m.free("r0")
    m.add_request("r18", [7] * 9)
    m.add_request("r20", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 68])  # evicts block 5
    assert m.free_block_order() == [4, 3, 2, 1, 0]
    m.check_invariants()
    # hits 0, 1, 2 (free) and needs 3 more: 6 of the 5 free blocks, a shortage (before:
    # admitted with blocks (0, 1, 2, 4, 3, 2), block 2 a hit and a new block)
    assert m.add_request("r27", PROMPT[:12] + list(range(200, 209)), extra=SALT) is None
    m.check_invariants()
    adm = m.add_request("r28", PROMPT[:12] + list(range(200, 205)), extra=SALT)
    assert adm is not None and len(set(adm.block_ids)) == len(adm.block_ids), adm
    assert adm.block_ids[:3] == (0, 1, 2) and adm.num_cached_tokens == 12
    m.check_invariants()
