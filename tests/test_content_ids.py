"""One content, one content id: content recorded again while another holder keeps it
(in the triple-keyed overflow, or in a host slot) takes that holder's id, so the blocks
keyed under it stay findable and events predict lookup. Pool of 7 blocks of 4 tokens;
scenarios shrunk by the state machines (tests/test_state_machine.py)."""

from prefixkv import ExtraKeys, KVCacheManager

P0 = [1, 2, 3, 4, 5, 6, 7, 8]


def test_content_in_the_overflow_is_found_when_its_tokens_key_was_freed():
    m = KVCacheManager(7, 4, seed=1, host_blocks=6)
    m.add_request("r0", [1, 2, 3, 4, 0], extra=ExtraKeys(cache_salt="a"), num_new_tokens=4)
    m.free("r0")                             # a salted (1,2,3,4) holds the tokens' key
    m.add_request("r1", [1, 2, 3, 4, 0], num_new_tokens=3)
    m.add_request("r2", P0 + [0])            # unsalted (1,2,3,4) goes under its triple
    m.take_kv_ops()
    m.free("r2")
    m.add_request("r4", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    m.take_kv_ops()
    m.extend("r1", 2)                        # evicts the salted block, then records r1's
    m.take_kv_ops()                          # (1,2,3,4): the content r2's blocks hold
    assert m.lookup(P0 + [0]) == 8           # was 4: r2's second block is keyed under it
    m.check_invariants()


def test_content_recomputed_while_a_host_slot_keeps_it_keeps_the_slots_id():
    m = KVCacheManager(7, 4, seed=1, host_blocks=6)
    m.add_request("r0", [0, 0, 0])
    m.take_kv_ops()
    m.append_tokens("r0", [0])
    m.take_kv_ops()
    m.append_tokens("r0", [0])
    m.take_kv_ops()
    m.add_request("r1", [1, 2, 3, 4, 0], num_new_tokens=3)
    m.take_kv_ops()
    m.add_request("r3", P0 + [0])
    m.take_kv_ops()
    m.free("r3")
    m.add_request("r4", [9, 9, 9, 9, 5, 6, 7, 8, 0])  # evicts (5,6,7,8): offloaded
    m.take_kv_ops()
    m.extend("r1", 2)    # evicts (1,2,3,4) into a slot while r1 records it again
    m.take_kv_ops()
    assert m.lookup(P0 + [0]) == 8           # was 4: the slot's child keyed under the old id
    m.check_invariants()
