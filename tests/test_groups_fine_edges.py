"""Edges of full attention larger than the hash block (groups/partial_full.py,
groups/fine.py) that tests/test_groups_partial_full.py and the fine machines reach
rarely: the group alone looking past a boundary it has no entry at, a hit at the last
boundary of a prompt whose length is a multiple of the hash block, a block given
another entry (fine.hold)."""

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba
from test_groups_fine import Scene


def _manager(full, num_blocks=24):
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks,
                                BlockSizes.of([full, 4], 2, partial=True), hash_mode="sha256")


def test_full_attention_alone_looks_at_every_boundary_inside_its_next_block():
    """Full attention at 8 (hash 2): "0" leaves the entry of boundary 4 inside block 0;
    "y", live, has computed 6 tokens of another prompt (the prefix at 6 walked, no entry
    there). A reader of that prefix: full attention alone serves 4 (the entry at 4, after
    none at 6), Mamba nothing."""
    m = _manager(8)
    m.add_request("0", [0, 0, 1, 1, 2])
    m.free("0")
    m.add_request("y", [0, 0, 1, 1, 2, 2, 7, 7, 7, 7, 7], num_new_tokens=6, read_cache=False)
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 6, 6, 6]) == (4, 0)
    m.check_invariants()


def test_a_copy_at_the_last_boundary_of_an_even_prompt_holds_the_entry():
    """A reader of 8 tokens (a multiple of the hash block) hits 6, its last boundary
    before its last token, and computes one token: its copy of block 1 holds the entry
    of 6 beside the source (vLLM caches every copy)."""
    m = _manager(4)
    m.add_request("0", [0, 0, 1, 1, 2, 2, 3], num_new_tokens=6)
    full = m.get_block_ids("0")[0][1]
    m.free("0")
    prompt = [0, 0, 1, 1, 2, 2, 3, 3]
    adm = m.add_request("1", prompt, num_new_tokens=1)
    assert adm.num_cached_tokens == 6
    copy = m.get_block_ids("1")[0][1]
    assert copy != full
    assert m.prefix_probe(prompt).copies(6, 0) == (full, copy)
    m.check_invariants()


def test_a_block_given_another_entry_loses_its_own_first():
    """``fine.hold`` on a block holding another prefix's entry (never seen from the
    manager: a request's last boundary is fixed): the old entry goes (the block's only
    content: dropped with it; beside a whole key: the key stays), the new one is held."""
    s = Scene()
    tokens, nodes, a = s.held()
    other = s.nodes([9, 9, 9])
    s.events()
    s.hold(a, other, 0, [9, 9, 9])
    s.sound()
    assert s.index.fine.find(0, nodes[0]) is None and s.index.fine.find(0, other[0]) is a
    assert s.index.nodes[a.block_id] is other[0] and a.key is other[0].key
    assert s.events() == [("Removed", nodes[0].hash), ("Stored", other[0].hash)]
    whole, _ = s.promoted_and_copied()[:2]
    b = s.index.find(0, whole[1])
    s.hold(b, other, 0, [9, 9, 9])
    s.sound()
    assert s.index.find(0, whole[1]) is b and s.index.nodes[b.block_id] is whole[1]
    assert s.index.fine.holds(b, other[0]) and not s.index.fine.holds(b, whole[0])


def test_a_primary_evicted_gives_its_partial_entry_up_to_its_spare():
    """Full attention at 8 beside Mamba at 4 (hash 2): r and s compute the same 7-token
    prompt, then 3 more tokens, each without reading the cache: both full-attention
    blocks 0 (1, r's primary; 5, s's spare) hold the prompt's entry at 6 beside the
    whole key. r freed, x's admission evicts block 1 (Mamba takes it): the spare holds
    the prefix and the entry alone, and a reader of 6 tokens finds block 5 only, never
    the block x writes. (mutants-r30: the evicted primary kept as the entry's holder.)"""
    m = _manager(8, num_blocks=12)
    prompt = [0, 0, 1, 1, 2, 2, 3]
    for rid in ("r", "s"):
        m.add_request(rid, prompt, read_cache=False)
        m.append_tokens(rid, [3, 4, 4])
    assert [m.get_block_ids(rid)[0] for rid in ("r", "s")] == [(1, 3), (5, 7)]
    assert {k: [b.block_id for b in v] for k, v in m._index.fine.holders.items()} == {(0, 3): [1, 5]}
    m.free("r")
    got = m.add_request("x", list(range(100, 148)))
    assert got.group_block_ids == ((4, 2, 3, 9, 10, 11), (0,) * 11 + (1,))
    assert [b.block_id for b in m._index.fine.holders[(0, 3)]] == [5]
    assert m.prefix_probe(prompt).copies(6, 0) == (5,)
    m.check_invariants()
