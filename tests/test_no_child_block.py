"""``NO_CHILD``, the ``child`` of a block without one, is a ``Block`` holding no content,
its key ``b""``: the guess a claim or a store tries first meets a block's type and a
bytes key whether the guess is a block or the sentinel, so 3.11 keeps those attribute
reads specialized to the block's slots and the key's compare is bytes with bytes (another
type sent each read down the generic lookup, a None key each compare down the reflected
fallback: C paths cold after the forward pass, benchmarks/results/events-r24.md). It
fails every check a guess must pass, and a write to it is caught by ``check_invariants``
(an object of its own type, with no slots, refused writes)."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.core.block import NO_CHILD, Block
from prefixkv.errors import InvariantError


def test_no_child_is_a_block_without_content() -> None:
    assert type(NO_CHILD) is Block
    assert NO_CHILD.key == b"" and not NO_CHILD.chained and not NO_CHILD.twin
    assert NO_CHILD.parent_cid == NO_CHILD.content_id == -1
    assert NO_CHILD.child is NO_CHILD and NO_CHILD.counted is None and NO_CHILD.starts is None
    assert Block(7).child is NO_CHILD  # (each block's until it has a child)


def test_guesses_meet_no_child_and_stay_exact() -> None:
    m = KVCacheManager(64, 4, seed=0, enable_events=True)
    p = list(range(1, 30))
    a = m.add_request("a", m.prepare(p))  # a miss: the first block's guess is NO_CHILD
    m.take_pending_events()
    b = m.add_request("b", m.prepare(p[:20] + [99] * 9))  # a hit, then a miss after it
    assert a is not None and b is not None
    assert b.num_cached_tokens == 20 and b.block_ids[:5] == a.block_ids[:5]
    m.check_invariants()
    assert NO_CHILD.key == b"" and NO_CHILD.child is NO_CHILD


@pytest.mark.parametrize(("field", "value"), [("key", b"\0" * 16), ("key", None), ("chained", True),
                                              ("content_id", 0), ("child", Block(5))])
def test_a_write_to_no_child_is_caught(field: str, value: object) -> None:
    m = KVCacheManager(64, 4, seed=0)
    m.add_request("a", m.prepare(list(range(1, 30))))
    m.check_invariants()
    old = getattr(NO_CHILD, field)
    setattr(NO_CHILD, field, value)
    try:
        with pytest.raises(InvariantError, match="NO_CHILD was written to"):
            m.check_invariants()
    finally:
        setattr(NO_CHILD, field, old)
    m.check_invariants()
