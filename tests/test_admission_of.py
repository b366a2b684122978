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
