"""``KVCacheManager.shared_prefixes``: which requests of a batch share their first blocks
(the groups of cascade attention), on exact scenarios and against a brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, RequestError, SharedPrefix
from prefixkv.core.sharing import shared_prefixes

SYSTEM = list(range(100, 112))  # three blocks of 4


def test_a_shared_system_prompt_a_fork_and_a_stranger():
    m = KVCacheManager(64, 4, seed=0)
    m.add_request("a", SYSTEM + [1, 2, 3, 4, 5])   # blocks 0 1 2 | 3 4
    m.add_request("b", SYSTEM + [7, 8, 9, 9, 9])   # hits 0 1 2, then 5 6
    m.add_request("c", [5] * 9)                    # 7 8 9
    m.fork("a", "a2")                              # shares 0 1 2 3, copies 4 -> 10
    assert m.get_block_ids("a2") == (0, 1, 2, 3, 10)
    assert m.shared_prefixes(["c", "a", "b", "a2"]) == [SharedPrefix(3, (1, 2, 3))]
    assert m.shared_prefixes(["a2", "a"]) == [SharedPrefix(4, (0, 1))]  # the fork shares one more
    assert m.shared_prefixes(["a", "c"]) == [] and m.shared_prefixes([]) == []
    m.free("b")
    m.add_request("b2", SYSTEM + [7, 8, 9, 9, 9])  # b's blocks are still cached: the same ids
    assert m.get_block_ids("b2")[:4] == (0, 1, 2, 5)
    assert m.shared_prefixes(["b2", "a"]) == [SharedPrefix(3, (0, 1))]
    m.check_invariants()


def test_unknown_id_raises_before_anything():
    m = KVCacheManager(8, 4, seed=0)
    m.add_request("a", [1, 2, 3, 4, 5])
    with pytest.raises(RequestError):
        m.shared_prefixes(["a", "nope"])


def test_ids_given_as_a_string_are_refused():
    """"ab" read as the ids "a" and "b": a batch of two that was never asked for."""
    m = KVCacheManager(8, 4, seed=0)
    for rid in "ab":
        m.add_request(rid, [1, 2, 3, 4, 5])
    with pytest.raises(RequestError, match="sequence of ids"):
        m.shared_prefixes("ab")


def _brute(tables):
    groups = {}
    for i, t in enumerate(tables):
        if t:
            groups.setdefault(t[0], []).append(i)
    out = []
    for members in groups.values():
        if len(members) > 1:
            n = 0
            while all(len(tables[i]) > n and tables[i][n] == tables[members[0]][n] for i in members):
                n += 1
            out.append(SharedPrefix(n, tuple(members)))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=8))
def test_matches_a_brute_force(paths):
    # Block ids of a prefix tree, as the manager's sharing makes them: the same path, the same id.
    ids: dict[tuple[int, ...], int] = {}
    tables = [[ids.setdefault(tuple(p[:k + 1]), len(ids)) for k in range(len(p))] for p in paths]
    assert shared_prefixes(tables) == _brute(tables)
