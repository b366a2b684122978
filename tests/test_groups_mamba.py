"""prefixkv.groups' Mamba group (``mamba()``, a sparse group): the blocks a step takes and
releases, what is cached, hits, and what is refused. Exact block ids, in a pool whose
free order is known (fresh blocks in id order)."""

from __future__ import annotations

import pytest

from prefixkv.errors import ConfigError, PromptTooLongError
from prefixkv.groups import HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.groups.fit import least_blocks

BS = 4
N = 0  # the null block of a manager whose groups release blocks


def test_a_step_takes_the_block_of_its_last_position_and_the_next_step_releases_the_one_before():
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(22)), num_new_tokens=12)   # [0, 12): block 2 holds the state at 12
    assert m.get_block_ids("a") == ((1, 2, 3), (N, N, 4))
    m.extend("a", 7)                                         # [12, 19): reads 4, writes block 4
    assert m.get_block_ids("a") == ((1, 2, 3, 5, 6), (N, N, 4, N, 7))
    m.extend("a", 3)                                         # [19, 22): block 2 goes back
    assert m.get_block_ids("a") == ((1, 2, 3, 5, 6, 8), (N, N, N, N, 7, 9))
    assert m.num_free_blocks == 40 - 1 - 8
    m.append_tokens("a", [100])                              # 22: in block 5, nothing moves
    assert m.get_block_ids("a")[1] == (N, N, N, N, N, 9)     # (block 4, read at 19, released)
    m.check_invariants()


def test_a_hit_takes_the_state_block_at_its_end_alone():
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(13)))                      # one step: block 3 holds the state at 13
    m.append_tokens("a", [13, 14, 15])                       # fills block 3 in place: cached at 16
    assert m.lookup_block_ids(list(range(16)) + [9]) == ((1, 2, 3, 4), (N, N, N, 5))
    adm = m.add_request("b", list(range(16)) + [9, 9, 9, 9, 9])
    assert adm.num_cached_tokens == 16
    assert adm.group_block_ids == ((1, 2, 3, 4, 6, 7), (N, N, N, 5, N, 8))
    m.check_invariants()


def test_a_state_a_step_ran_past_is_not_cached_for_its_block():
    # chunks [0, 6) and [6, 14): Mamba block 1 holds the state at 6 and is never written
    # again (the next step writes block 3); cached as block 1 it would serve a prompt
    # sharing 8 tokens the state after 6 of them. Only a block whose step ended at its
    # end holds its state (vLLM's scheduler ends every prefill chunk but the last on a
    # block boundary in this mode, so it never meets this)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, BS)
    m.add_request("a", list(range(14)), num_new_tokens=6)
    m.extend("a", 8)
    assert m.lookup(list(range(8)) + [99]) == 0
    m.append_tokens("a", [14, 15])                           # block 3 now holds the state at 16
    assert m.lookup(list(range(16)) + [99]) == 16
    m.check_invariants()


def test_least_blocks_counts_one_mamba_block_per_step():
    groups = (full_attention(), mamba())
    # a 40-token prompt in one step: 10 full-attention blocks and 1 Mamba block
    assert least_blocks(groups, BS, 40, None, 0, False, 100) == 11
    m = HybridKVCacheManager(groups, 12, BS)
    m.add_request("a", list(range(40)))                      # fits: 11 of 11 usable
    with pytest.raises(PromptTooLongError):
        m.add_request("b", list(range(41)))                  # 11 + 1: more than the pool
    m.check_invariants()


def test_fork_and_window_size_are_refused_for_mamba():
    m = HybridKVCacheManager([sliding_window(4), mamba()], 40, BS)
    m.add_request("a", list(range(9)))
    with pytest.raises(ConfigError, match="Mamba"):
        m.fork("a", "b")
    with pytest.raises(ConfigError, match="mamba"):
        _ = mamba().window_size
    with pytest.raises(ConfigError):
        type(mamba())("mamba", 3)
    m.check_invariants()
