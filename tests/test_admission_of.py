"""``Admission.of`` (public) and ``admission_of`` (what the manager's admission path calls,
a function: no classmethod bound a step): the same lazy admission over the first blocks
of a request's list."""

from __future__ import annotations

from prefixkv import Admission
from prefixkv.core.block import Block
from prefixkv.results import admission_of


def test_of_and_admission_of_read_the_same_first_blocks_however_the_list_grows() -> None:
    blocks = [Block(7), Block(3), Block(9)]
    a, b = Admission.of("r", blocks, 16, 20), admission_of("r", blocks, 16, 20)
    blocks.append(Block(5))  # (the manager appends a decoded block: not these admissions')
    assert isinstance(a, Admission) and isinstance(b, Admission)  # (a private subclass:
    # ``tests/test_made_by_type_call.py``)
    assert a == b == Admission("r", [7, 3, 9], 16, 20)
    assert a.block_ids == b.block_ids == (7, 3, 9)
    assert a.group_block_ids == ((7, 3, 9),)


def test_block_ids_from_is_block_ids_past_first_whether_listed_yet_or_not() -> None:
    from prefixkv.groups.results import GroupAdmission

    for first in range(5):
        blocks = [Block(7), Block(3), Block(9)]
        lazy = admission_of("r", blocks, 16, 20)
        blocks.append(Block(5))  # (not this admission's)
        assert lazy.block_ids_from(first) == (7, 3, 9)[first:]
        assert lazy._ids is None  # (nothing listed: a later read lists them all)
        assert lazy.block_ids == (7, 3, 9) and lazy.block_ids_from(first) == (7, 3, 9)[first:]
        assert Admission("r", [7, 3, 9], 16, 20).block_ids_from(first) == (7, 3, 9)[first:]
        group = GroupAdmission("r", [[7, 3, 9], [0, 4, 6]], 16, 20)
        assert group.block_ids_from(first) == group.block_ids[first:] == (7, 3, 9)[first:]
