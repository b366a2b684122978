"""``claim`` compares a run's token bytes with the prompt's at an offset
(``index/content.py``; until events-r30 a run of fewer than 64 blocks of 16 tokens was
compared with a slice of the prompt's bytes, a longer one at an offset: both lengths
stay here). A run the prompt agrees with is taken whole (no cut, no tail run made), and
a run the prompt parts from, or is cut short of (the hit's limit), is cut where the
prompt stops agreeing with it."""

from __future__ import annotations

from typing import Any

import pytest

from prefixkv import KVCacheManager

BS = 16
SHORT = 64  # (runs of fewer blocks were compared as a slice: 4 KiB of token bytes)


def stored(m: KVCacheManager, blocks: int) -> tuple[list[int], Any, tuple[int, ...]]:
    """A prompt of ``blocks`` full blocks and one token more, admitted and freed: the
    prompt, its run (headed by its first block) and its block ids."""
    prompt = list(range(1, blocks * BS + 2))
    m.add_request("first", m.prepare(prompt))
    ids = m.get_block_ids("first")
    head = m._pool.blocks[ids[0]]
    m.free("first")
    run = head.starts
    assert run is not None and len(run.blocks) == blocks - 1
    return prompt, run, ids


@pytest.mark.parametrize("blocks", [3, SHORT - 1, SHORT, SHORT + 40])
@pytest.mark.parametrize("events", [False, True])
def test_a_run_the_prompt_agrees_with_is_taken_whole(blocks: int, events: bool) -> None:
    m = KVCacheManager(1024, BS, seed=0, enable_events=events)
    prompt, run, ids = stored(m, blocks)
    last = run.blocks[-1]
    adm = m.add_request("again", m.prepare(prompt + [7] * 40))
    assert adm is not None and adm.num_cached_tokens == blocks * BS
    assert len(run.blocks) == blocks - 1 and run.blocks[-1] is last
    assert last.starts is None or last.starts.blocks[0] not in run.blocks  # no tail cut off
    assert m.get_block_ids("again")[:blocks] == ids[:blocks]
    m.check_invariants()


@pytest.mark.parametrize("blocks", [6, SHORT + 40])
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("parts", [False, True])
def test_a_run_is_cut_where_the_prompt_stops_agreeing(blocks: int, events: bool,
                                                      parts: bool) -> None:
    """The prompt ends in the run (cut short), or parts from it (a token differs)."""
    m = KVCacheManager(1024, BS, seed=0, enable_events=events)
    prompt, run, ids = stored(m, blocks)
    if parts:
        hit = blocks - 2  # the first block the prompt differs in
        prompt[hit * BS + 3] = 31_999
    else:
        hit = blocks // 2 - 1  # its full blocks: the last is not a hit (its last token)
        prompt = prompt[:(hit + 1) * BS]
    adm = m.add_request("other", m.prepare(prompt))
    assert adm is not None and adm.num_cached_tokens == hit * BS
    assert m.get_block_ids("other")[:hit] == ids[:hit]
    assert len(run.blocks) == hit - 1  # the head, then the blocks the hit took
    m.check_invariants()


@pytest.mark.parametrize("blocks", [6, SHORT + 40])
@pytest.mark.parametrize("events", [False, True])
def test_a_run_past_the_hits_limit_is_cut_at_it(blocks: int, events: bool) -> None:
    """The prompt agrees with the whole run, but its last full block holds its last token
    (never a hit), or a cap stops the hit earlier: the bytes past the limit are not
    compared, though the prompt has them."""
    m = KVCacheManager(1024, BS, seed=0, enable_events=events)
    prompt, run, ids = stored(m, blocks)
    adm = m.add_request("all", m.prepare(prompt[:blocks * BS]))
    assert adm is not None and adm.num_cached_tokens == (blocks - 1) * BS
    assert m.get_block_ids("all")[:blocks - 1] == ids[:blocks - 1]
    m.check_invariants()
    m.free("all")
    adm = m.add_request("capped", m.prepare(prompt), max_hit_tokens=3 * BS + 5)
    assert adm is not None and adm.num_cached_tokens == 3 * BS
    assert m.get_block_ids("capped")[:3] == ids[:3]
    m.check_invariants()
