"""A slot's content that the device still holds keeps the slots under it. ``HostTier.up``
(slot -> the device block its content last went up to) is a guess: once a held spare
takes the content over from that block (the block evicted, its spare keyed in its place),
the guess names a block holding something else. Before (hostlru-r18, orphan-r17's open
risk, built by hand), an offload that then took the slot holding the content withdrew
the slots under it (``BlockRemoved``, CPU) while ``lookup`` still reached them through
the spare: their host copies were lost (no wrong KV). Now the device's maps are asked
too (``ContentIndex.keyed``). Block size 4, seed 0, exact ids."""

from prefixkv import BlockRemoved, KVCacheManager
from prefixkv.tiers.host_orphans import held_by

A = [1, 2, 3, 4, 5, 6, 7, 8]  # A0, A1


def test_a_slot_under_a_content_a_spare_took_over_is_kept():
    m = KVCacheManager(6, 4, seed=0, host_blocks=8, enable_events=True)
    h = m._host

    def step(rid, prompt, free=True):
        m.add_request(rid, prompt)
        ops = m.take_kv_ops()
        if free:
            m.free(rid)
        m.check_invariants()
        return ops

    step("a", A + [99])
    step("b", list(range(20, 40)) + [98])     # evicts A1, A0: slots 0, 1
    assert [(s.content_id, s.parent_cid) for s in h.slots[:2]] == [(2, 1), (1, 0)]
    step("p", A + [97], free=False)            # A0, A1 load into blocks 0, 1 (up)
    m.add_request("q", A[:3])
    m.append_tokens("q", [A[3]])               # q's block 4 holds A0 too: block 0's spare
    m.take_kv_ops()
    assert [b.block_id for b in m._index._twins[1]] == [4] and h.up[1].block_id == 0
    m.free("p")
    step(("r", 0), [100] * 4 + [96], free=False)
    step(("r", 1), [101] * 8 + [96], free=False)  # evicts block 0: the spare takes A0 over
    assert not held_by(h.up[1], 1) and m.lookup(A + [0]) == 8  # (a stale guess)
    m.free(("r", 0))
    m.free(("r", 1))
    m.take_events()
    step("s", list(range(200, 212)) + [1])     # takes slot 7, then slot 1 (A0's, the LRU)
    assert h.slots[1].content_id != 1
    removed = [e.block_ids for e in m.take_events()
               if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert (0,) not in removed                 # A1's slot stays: block 4 holds A0
    assert m.lookup(A + [0]) == 8
    assert h.slots[0].key is not None and h.check_parents(m._pool.blocks) is None
