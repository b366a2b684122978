"""``add_request(..., num_prompt_tokens=)``: where a hybrid manager of different block
sizes announces a prompt's partial tail entry (vLLM's ``_cache_partial_tail_block``,
groups/sized.py ``_tail``) when the tokens admitted are more than the prompt (a
preempted request re-admitted with what it decoded: vLLM keeps its
``num_prompt_tokens``); tests/engines/test_vllm_preempted_tail.py runs it beside vLLM."""

import pytest

from prefixkv import RequestError
from prefixkv.groups import (
    BlockSizes,
    GroupBlockRemoved,
    GroupBlockStored,
    HybridKVCacheManager,
    full_attention,
    sliding_window,
)


def _manager():
    return HybridKVCacheManager((sliding_window(10), full_attention()), 40, BlockSizes.of([8, 16], 8, 16),
                                hash_mode="sha256", seed=0, enable_events=True)


def _tails(m):
    """The partial tail entries announced: (group, the hash block's index)."""
    return [(e.group_idx, e.first_block) for e in m.take_events()
            if isinstance(e, GroupBlockStored) and e.group_idx == 1 and len(e.token_bytes) == 4 * 8]


@pytest.mark.parametrize(("num_prompt", "tail"), [(None, 4), (48, 4), (41, 4), (32, 2), (25, 2), (40, None),
                                                  (8, None)])
def test_the_tail_entry_is_at_the_prompts_last_boundary(num_prompt, tail):
    """48 tokens admitted: the tail is the hash block before the prompt's last hash
    boundary short of its last token (40 of a prompt of 41 to 48, 24 of 25 to 32), when
    that boundary lies inside a block of 16 (32 for 40 is a block's end: none; 8 of 8:
    no boundary above 0)."""
    m = _manager()
    m.add_request("r", list(range(48)), num_prompt_tokens=num_prompt)
    assert _tails(m) == ([] if tail is None else [(1, tail)])
    m.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 49, True, 2.0, "32"])
@pytest.mark.parametrize("prepared", [False, True])
def test_a_bad_num_prompt_tokens_is_refused_before_any_change(bad, prepared):
    m = _manager()
    tokens = list(range(48))
    prompt = m.prepare(tokens) if prepared else tokens
    before = (m.free_block_order(), m.num_free_blocks, m.stats)
    with pytest.raises(RequestError, match="num_prompt_tokens"):
        m.add_request("r", prompt, num_prompt_tokens=bad)
    assert (m.free_block_order(), m.num_free_blocks, m.stats) == before
    assert m.add_request("r", prompt) is not None  # (the id stays free; a Prompt still serves)


def test_check_invariants_names_a_tail_entry_held_by_a_block_not_its_groups_primary():
    """The partial tail entry of a prompt of 16 tokens (full attention at 8 beside full
    attention at 16) is held by group 1's block 0, which holds its group's prefix. Moved
    by hand to a block that holds no prefix, or to group 0's block holding the same prefix
    (another group's), ``check_invariants`` names it (a spare of the group's prefix may
    hold one too: poolview-r25, each entry counts its holders). (mutants-r24: the check
    dropped, or its test, survived every test: no sound state reaches it.)"""
    from prefixkv.errors import InvariantError

    specs, sizes = [full_attention(), full_attention()], BlockSizes.of([8, 16])
    for to in ("empty", "other group"):
        m = HybridKVCacheManager(specs, 6, sizes, enable_events=True, seed=0)
        (g0, g1) = m.add_request("r", list(range(16))).group_block_ids
        tails = m._index.tails
        assert (g0, g1, list(tails)) == ((0, 1), (2,), [2])
        m.check_invariants()
        moved = m.num_blocks - 1 if to == "empty" else g0[1]   # (block 5: no request's)
        tails[moved] = tails.pop(g1[0])
        with pytest.raises(InvariantError, match=f"block {moved} holds a partial tail entry but not "
                                                 "its group's prefix"):
            m.check_invariants()


def test_a_tail_entry_stays_with_the_spare_that_takes_its_blocks_prefix():
    """r and s admit the same prompt of 16 tokens (full attention at 8 beside full
    attention at 16): group 1's block 2 (r's) holds the prefix and the partial tail entry
    of hash block 0, s's block 5 is a spare holding the same entry (vLLM caches it on
    every copy: poolview-r25, each entry counts its holders). r freed, x's admission
    evicts block 2: the spare takes the prefix and keeps the entry, which is not
    withdrawn (s still holds it, as on vLLM), and x, whose third block of 16 is block 2
    again, announces its own tail there. (mutants-r24: the heir's path; before
    poolview-r25 the entry was withdrawn here, while vLLM's stream still held it.)"""
    specs, sizes = [full_attention(), full_attention()], BlockSizes.of([8, 16])
    m = HybridKVCacheManager(specs, 12, sizes, enable_events=True, seed=0)
    hashes = m.prepare(list(range(16))).hashes
    assert m.add_request("r", list(range(16))).group_block_ids == ((0, 1), (2,))
    assert m.add_request("s", list(range(16))).group_block_ids == ((3, 4), (5,))
    m.free("r")
    m.take_events()
    assert m.add_request("x", list(range(50, 98))).group_block_ids == ((6, 7, 8, 9, 10, 11), (1, 0, 2))
    events = m.take_events()
    assert [(e.group_idx, e.block_ids, e.block_hashes) for e in events
            if isinstance(e, GroupBlockRemoved) and e.group_idx == 1] == []
    assert {b: e.block_hashes for b, e in m._index.tails.items()}[5] == (hashes[0],)
    assert [(e.group_idx, e.block_ids, len(e.token_bytes)) for e in events if isinstance(e, GroupBlockStored)
            and e.group_idx == 1 and len(e.token_bytes) == 4 * 8] == [(1, (2,), 32)]
    m.check_invariants()


def test_a_spare_freed_gives_up_its_tail_entry_and_the_last_holder_withdraws_it():
    """r and s admit the same prompt of 16 tokens (as above): both group 1 blocks (2, r's
    primary; 5, s's spare) hold the partial tail entry of hash block 0. s freed, its spare
    returns empty and no longer holds the entry (no event: r's block still does); r freed
    and block 2 evicted by x's admission, the prefix and then the entry are withdrawn
    there. (mutants-r30: a spare's entry kept, the last holder's withdrawal is missing.)"""
    specs, sizes = [full_attention(), full_attention()], BlockSizes.of([8, 16])
    m = HybridKVCacheManager(specs, 12, sizes, enable_events=True, seed=0)
    hashes = m.prepare(list(range(16))).hashes
    m.add_request("r", list(range(16)))
    m.add_request("s", list(range(16)))
    assert sorted(m._index.tails) == [2, 5]
    m.take_events()
    m.free("s")
    assert m.take_events() == [] and sorted(m._index.tails) == [2]
    m.check_invariants()
    m.free("r")
    got = m.add_request("x", list(range(50, 114)))
    assert got.group_block_ids == ((5, 4, 3, 6, 7, 8, 9, 10), (11, 1, 0, 2))
    assert [(e.group_idx, e.block_ids, e.block_hashes) for e in m.take_events()
            if isinstance(e, GroupBlockRemoved) and e.group_idx == 1] == [(1, (2,), (hashes[1],)),
                                                                         (1, (2,), (hashes[0],))]
    m.check_invariants()


def test_a_reset_forgets_the_tail_entries_and_the_same_prompt_announces_its_own_again():
    """r's 16-token prompt leaves block 2 (group 1) holding the tail entry of hash block 0;
    r freed, the cache reset: no block holds an entry any more (the checks agree), and s,
    the same prompt, has its own announced in its block 5. (mutants-r30: the entries
    kept by ``GroupIndex.clear``.)"""
    specs, sizes = [full_attention(), full_attention()], BlockSizes.of([8, 16])
    m = HybridKVCacheManager(specs, 12, sizes, enable_events=True, seed=0)
    assert m.add_request("r", list(range(16))).group_block_ids == ((0, 1), (2,))
    m.free("r")
    assert m.reset_prefix_cache()
    assert dict(m._index.tails) == {} and not m._index.tails.held
    m.check_invariants()
    m.take_events()
    assert m.add_request("s", list(range(16))).group_block_ids == ((3, 4), (5,))
    assert _tails(m) == [(1, 0)]
    m.check_invariants()
