"""vLLM's ``prefix_cache_retention_interval`` with every group at ONE block size (a pure
sliding-window model, vLLM's ``UnitaryKVCacheCoordinator``; full attention beside
windows of the same size): tests/sized_model.py's reference, whose sizes are then all
equal (hash block = alignment = the one size), driven beside vLLM 0.33's own manager by
test_vllm_sized_model.py's random streams (``Pair``): the same block ids, free queue,
keys cached and hits after every call. This checks the reference that
tests/test_groups_one_size_retention.py holds prefixkv's manager to. Needs vllm
installed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_sized_model import OP, PROMPT, STEMS, Pair, _drive, _pool  # noqa: E402

# (groups: (block size, window or None), retention interval)
ONE_SIZE = {
    "window8@8, retention 0": (((8, 8),), 0),
    "window12@8, retention 32": (((8, 12),), 32),
    "window20@8, retention 32": (((8, 20),), 32),
    "full8+window8@8, retention 0": (((8, None), (8, 8)), 0),
    "full8+window12@8, retention 24": (((8, None), (8, 12)), 24),
    "window20@16+full16, retention 32": (((16, 20), (16, None)), 32),
    "full8+window4@8+window30@8, retention 16": (((8, None), (8, 4), (8, 30)), 16),
}


@pytest.mark.parametrize("layout", list(ONE_SIZE))
@settings(max_examples=30, deadline=None)
@given(extra=st.integers(0, 6), ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_one_size_reference_retains_as_vllms_manager(layout, extra, ops, probe):
    groups, retention = ONE_SIZE[layout]
    _drive(Pair(groups, _pool(groups, extra), retention=retention), ops, probe)


def _run(pair, ops, probe):
    for op in ops:
        pair.do(*op)
        pair.note_events()
        pair.compare(probe)


def test_a_rewind_forgets_a_window_block_only_another_requests_mark_cached():
    # Found by the property above (full8+window12@8, retention 24). a (9 tokens) caches
    # its window block 0 as the tail of its replay boundary (8); b (25 tokens) hits it
    # and caches its window blocks 1 and 2 (its segment tails and its own boundary's,
    # 24): block 0 is not b's to cache. vLLM's recompute of b from 7 keeps block 0
    # cached; the reference's (prefixkv's) rewind forgets its content and the regrow
    # does not cache it again (unreachable for b): by design (a rewind forgets), so
    # the reference says it diverged and the comparison stops there.
    groups = ((8, None), (8, 12))
    pair = Pair(groups, _pool(groups, 0), retention=24)
    _run(pair, [("add", STEMS[0][:9], None), ("free", 0, 0), ("add", STEMS[0][:23] + [0, 0], None)]
         + [("add", [7], None)] * 4, [7])
    assert pair.model.reqs["r3"].tables == [[1, 4, 2, 5], [3, 6, 7, 8]]
    head = (1, None, tuple(STEMS[0][:8]))  # (the window's block 0, id 3, a's)
    assert pair.mirror[head] == 1 and pair.model.holders[head] == [3] and not pair.model.diverged
    pair.do("recompute", 0, 18)
    pair.note_events()
    assert pair.model.diverged
    assert pair.mirror[head] == 1 and head not in pair.model.holders  # (the rest as vLLM's)
    assert {k: v for k, v in pair.mirror.items() if k != head} == \
        {k: len(v) for k, v in pair.model.holders.items() if not len(k[2]) % 8}


def test_a_rewind_forgets_a_pure_windows_block_only_another_requests_mark_cached():
    # The same in a pure window (window8@8, retention 0), as the property's other found
    # example began: c (26 tokens, [0] * 6 + [3] * 20) caches its window block 2 (id 5)
    # as its replay boundary's tail (25 -> 24); d (c's first 25 tokens and [3] * 20)
    # hits it (24), computes one token (a block more: id 7) and, once c is gone,
    # recomputes from 23: vLLM keeps block 2 cached; the reference forgets it and d's
    # marks (44) do not reach it.
    pair = Pair(((8, 8),), _pool(((8, 8),), 0), retention=0)
    _run(pair, [("add", [7], None), ("add", [0] * 9, None), ("free", 0, 0), ("again", (1, 3), None),
                ("again", (2, 1), 1), ("free", 1, 0)], [7])
    assert pair.model.reqs["r5"].tables == [[0, 0, 5, 7]] and pair.model.reqs["r5"].computed == 25
    tail = (0, None, (0,) * 6 + (3,) * 18)
    assert pair.model.holders == {(0, None, (0,) * 8): [2], tail: [5]} and not pair.model.diverged
    pair.do("recompute", 1, 2)
    pair.note_events()
    assert pair.model.diverged
    assert pair.mirror == {(0, None, (0,) * 8): 1, tail: 1}
    assert pair.model.holders == {(0, None, (0,) * 8): [2]}
