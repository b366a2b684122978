"""Blocks a group holds past its table's end (``GroupSpec.ahead``, groups/spec_blocks.py):
vLLM's speculative blocks of Mamba in ``mamba_cache_mode="none"``, served as a 2-token
window. Exact ids at one block size and at two, growth one token at a time (the path
that only appends), and the arguments refused."""

import pytest

from prefixkv.errors import ConfigError, PromptTooLongError
from prefixkv.groups import BlockSizes, GroupSpec, HybridKVCacheManager, full_attention, mamba, sliding_window


def test_ahead_is_a_sliding_windows_count():
    assert sliding_window(2, ahead=3).ahead == 3 and full_attention().ahead == 0
    for bad in (-1, True, 1.0, "2"):
        with pytest.raises(ConfigError, match="ahead=an int >= 0"):
            sliding_window(2, ahead=bad)
    with pytest.raises(ConfigError, match="ahead=0 \\(sliding windows and Mamba only hold blocks ahead\\)"):
        GroupSpec("full_attention", ahead=1)
    with pytest.raises(ConfigError, match="ahead=0"):
        GroupSpec("chunked_local_attention", 4, ahead=2)
    assert mamba().ahead == 0 and mamba(ahead=2).ahead == 2 == GroupSpec("mamba", ahead=2).ahead
    with pytest.raises(ConfigError, match="mamba group takes ahead=an int >= 0"):
        mamba(ahead=-1)


def test_a_window_first_keeps_its_blocks_ahead_as_tokens_come_one_by_one():
    # the 2-token window (Mamba none) with 2 blocks ahead is group 0, whose table length
    # measures growth; blocks of 4. 5 tokens, then 7 decoded one at a time
    m = HybridKVCacheManager([sliding_window(2, ahead=2), full_attention()], 20, 4, enable_caching=False)
    adm = m.add_request("a", list(range(5)))
    assert [list(t) for t in adm.group_block_ids] == [[1, 2, 3, 4], [5, 6]]
    seen = []
    for t in range(7):
        m.append_tokens("a", [100 + t])
        m.check_invariants()
        seen.append(([list(t) for t in m.get_block_ids("a")], m.num_free_blocks))
    # the step at 5 releases the window's block 0 (id 1, back first: nothing cached);
    # the 9th token takes a block per group, the window's its 3rd ahead (id 1 again),
    # and the step at 9 releases its block 1
    assert m.null_block_id == 0
    assert seen[:3] == [([[0, 2, 3, 4], [5, 6]], 14)] * 3
    assert seen[3] == ([[0, 2, 3, 4, 1], [5, 6, 7]], 12)
    assert seen[4:] == [([[0, 0, 3, 4, 1], [5, 6, 7]], 13)] * 3
    m.free("a")
    assert m.num_free_blocks == 19


def test_blocks_ahead_at_their_groups_own_size():
    # full attention at 4, the window at 8 with 3 blocks ahead (hash 4, lcm 8): 9 tokens,
    # a reserve of 6 slots, then one at a time up to 24
    sizes = BlockSizes.of([4, 8], 4)
    m = HybridKVCacheManager([full_attention(), sliding_window(2, ahead=3)], 30, sizes, enable_caching=False)
    adm = m.add_request("a", list(range(9)))
    assert [len(t) for t in adm.group_block_ids] == [3, 2 + 3]
    m.reserve("a", 6)  # (15 slots: 4 blocks of 4, 2 of 8)
    assert [len(t) for t in m.get_block_ids("a")] == [4, 2 + 3]
    for t in range(15):
        m.append_tokens("a", [t])
        m.check_invariants()
        n = 10 + t
        assert [len(x) for x in m.get_block_ids("a")] == [max(4, -(-n // 4)), max(2, -(-n // 8)) + 3]
    m.free("a")
    assert m.num_free_blocks == 29


def test_blocks_ahead_in_the_group_of_the_smaller_blocks():
    # the window at 4 with 2 ahead beside full attention at 8: the window grows at
    # positions where full attention does not (the one-token path must see it)
    sizes = BlockSizes.of([8, 4], 4)
    m = HybridKVCacheManager([full_attention(), sliding_window(2, ahead=2)], 30, sizes, enable_caching=False)
    m.add_request("a", list(range(3)))
    for t in range(14):
        m.append_tokens("a", [t])
        m.check_invariants()
        n = 4 + t
        assert [len(x) for x in m.get_block_ids("a")] == [-(-n // 8), -(-n // 4) + 2]


def test_a_prompt_whose_blocks_ahead_never_fit_is_too_long():
    # 11 usable blocks: 8 tokens take 2 + 2 blocks, and the window's 8 ahead make 12
    m = HybridKVCacheManager([full_attention(), sliding_window(2, ahead=8)], 12, 4)
    with pytest.raises(PromptTooLongError):
        m.add_request("a", list(range(8)))
    assert m.add_request("b", list(range(4))) is not None  # (1 + 1 + 8 = 10)


def test_the_blocks_ahead_count_in_the_full_sequence_fit():
    # a 16-token prompt scheduled 4 tokens at a time must fit whole (require_full_fit):
    # its blocks with the window's 2 ahead need 10 or 11 free blocks; 9 free (another
    # request's 21 tokens held) refuse it, 11 (17 tokens held) admit it (mutants-r29)
    for other, ids in ((21, None), (17, [[13, 14, 15], [16]])):
        m = HybridKVCacheManager([sliding_window(2, ahead=2), full_attention()], 24, 4, enable_caching=False)
        m.add_request("x", list(range(100, 100 + other)))
        got = m.add_request("a", list(range(16)), num_new_tokens=4, require_full_fit=True)
        assert (None if got is None else [list(t) for t in got.group_block_ids]) == ids
        m.check_invariants()


def test_a_prompt_whose_blocks_ahead_never_fit_is_too_long_at_two_sizes():
    # 11 usable blocks: full attention at 4, the window at 8 with 8 ahead; 9 tokens take
    # 3 + 2 + 8 = 13 (too long), 8 tokens 2 + 1 + 8 = 11 (all of them) (mutants-r29)
    sizes = BlockSizes.of([4, 8], 4)
    m = HybridKVCacheManager([full_attention(), sliding_window(2, ahead=8)], 12, sizes)
    with pytest.raises(PromptTooLongError):
        m.add_request("a", list(range(9)))
    assert m.add_request("b", list(range(8))) is not None and m.num_free_blocks == 0


def test_a_mamba_group_moves_its_blocks_ahead_as_vllms_align_mode():
    # full attention and Mamba at 4, Mamba with 2 blocks ahead: 4 tokens, 4, then 32
    # (the state jumps 8 entries: both blocks ahead move to the end, one fresh block
    # after them), then one token (one more entry: the first block ahead becomes the
    # state, one fresh block); never cached before they hold a state
    m = HybridKVCacheManager([full_attention(), mamba(ahead=2)], 40, 4)
    tokens = list(range(41))
    assert [list(t) for t in m.add_request("a", tokens[:40], num_new_tokens=4).group_block_ids] == \
        [[1], [2, 3, 4]]
    m.extend("a", 4)
    assert [list(t) for t in m.get_block_ids("a")] == [[1, 5], [2, 3, 4, 6]]
    m.extend("a", 32)
    assert list(m.get_block_ids("a")[1]) == [0, 3, 0, 0, 0, 0, 0, 0, 0, 4, 6, 15]
    m.check_invariants()
    m.append_tokens("a", [tokens[40]])
    assert list(m.get_block_ids("a")[1]) == [0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 6, 15, 17]
    m.check_invariants()
    m.free("a")
    assert m.num_free_blocks == 39


def test_lookahead_slots_beside_blocks_ahead_at_different_sizes_are_refused():
    sizes = BlockSizes.of([4, 8], 4)
    m = HybridKVCacheManager([full_attention(), mamba(ahead=1)], 40, sizes)
    with pytest.raises(ConfigError, match="lookahead slots .* blocks ahead"):
        m.add_request("a", list(range(10)), num_lookahead_tokens=2)
    assert m.num_free_blocks == 39
    m.add_request("a", list(range(10)))
    with pytest.raises(ConfigError, match="lookahead slots"):
        m.reserve("a", 3)
    m.check_invariants()


@pytest.mark.parametrize("sizes", [4, BlockSizes.of([4, 8], 4)], ids=["one-size", "two-sizes"])
def test_a_load_beside_a_mamba_group_holding_blocks_ahead_is_refused_before_any_change(sizes):
    # a connector's load (num_external_tokens) beside Mamba's blocks ahead is not served
    # (the load's state block and the blocks ahead would share the row's end): refused,
    # nothing taken; without the load the same prompt is admitted
    m = HybridKVCacheManager([full_attention(), mamba(ahead=1)], 40, sizes)
    with pytest.raises(ConfigError, match="a load \\(8 external tokens\\) beside a Mamba group holding"):
        m.add_request("a", list(range(10)), num_external_tokens=8)
    assert m.num_free_blocks == 39
    assert m.add_request("a", list(range(10))) is not None  # (the id was never taken)
    m.check_invariants()
