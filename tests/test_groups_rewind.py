"""``HybridKVCacheManager.rewind`` (prefixkv.groups.decode) against what its windows
released and against blocks another request shares: found by risks-r11's group fuzzer
(random call streams, ``check_invariants`` after each call).

block_size is 3; block 0 is the null block.
"""

import pytest

from prefixkv.groups import HybridKVCacheManager, chunked_local, full_attention, sliding_window

WINDOWED = (full_attention(), chunked_local(6), sliding_window(7))


def manager(groups=WINDOWED, num_blocks=24):
    return HybridKVCacheManager(list(groups), num_blocks, 3, seed=0)


def windowed_rewound():
    """A request whose chunk window released blocks 0, 1 at 6, rewound to 3 (a query
    there reads block 0 of the chunk group: vLLM's null entry, left as it is)."""
    m = manager()
    m.add_request("r1", [0, 1, 2, 1, 0, 1])
    m.append_step(["r1"], [1])                           # at 6: chunk 6.. , blocks 0, 1 go
    null = m.null_block_id
    assert m.get_block_ids("r1")[1][:2] == (null, null)
    before = m.get_block_ids("r1")
    m.rewind("r1", 3)
    assert m.get_block_ids("r1") == before
    m.check_invariants()
    return m, before


@pytest.mark.parametrize("call", ["append_step", "append_tokens"])
def test_steps_after_a_rewind_past_released_blocks_keep_them_released(call):
    # before: the one-token fast path set where the last step began to 4, below the
    # step at 6 that released the chunk group's blocks 0, 1, and check_invariants
    # raised "2 blocks released, but a query at 4 still reads block 0"
    m, before = windowed_rewound()
    for t in (1, 0, 1):                                  # 3, 4, 5 recomputed
        if call == "append_step":
            m.append_step(["r1"], [t])
        else:
            m.append_tokens("r1", [t])
        m.check_invariants()
    assert m.get_block_ids("r1") == before and m.num_scheduled_tokens("r1") == 6


def test_release_unread_after_a_rewind_past_released_blocks_keeps_them_released():
    # risks-r11's minimal case: release_unread (vLLM frees what no window reads before it
    # counts) planned the next release, and the next step took the fast path at 3
    m, before = windowed_rewound()
    assert m.release_unread("r1") == 0
    m.append_step(["r1"], [2])
    m.check_invariants()
    assert m.get_block_ids("r1") == before
