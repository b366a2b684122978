"""``core.dependents.computed_on``, against the plain fixed point it replaces (every pass
over every entry of every request, until nothing joins): the same blocks, ``blocks``
first, each once, whatever the order of the requests, the rows (groups) per request,
the released entries (None) and the holds no request makes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.core.block import Block
from prefixkv.core.dependents import computed_on


def fixed_point(tables, blocks):
    going, grew = set(blocks), True
    while grew:
        grew = False
        for rows, n in tables:
            first = min((j for row in rows for j, b in enumerate(row[:n]) if b in going), default=None)
            if first is None:
                continue
            later = {b for row in rows for b in row[first + 1:n] if b is not None} - going
            going |= later
            grew = grew or bool(later)
    return going


@st.composite
def scenes(draw):
    """Requests over a few rows (groups); entry j of a row is drawn from the blocks of
    index j of that row (a block sits at one index in every row holding it), some None;
    each request's full entries are a prefix; blocks' counts are their holders plus,
    sometimes, a hold no request makes."""
    num_rows = draw(st.integers(1, 2))
    width = draw(st.integers(1, 7))
    spread = draw(st.integers(2, 6))  # blocks per index and row: how rarely requests share
    pool = [[[Block(r * 1000 + j * 10 + k) for k in range(spread)] for j in range(width)]
            for r in range(num_rows)]
    tables = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(0, width))
        rows = []
        for r in range(num_rows):
            picks = draw(st.lists(st.integers(-1, spread - 1), min_size=length, max_size=length))
            rows.append([None if k < 0 and r else pool[r][j][max(k, 0)] for j, k in enumerate(picks)])
        tables.append((rows, draw(st.integers(0, length))))
    held = [b for rows, _ in tables for row in rows for b in row if b is not None]
    for b in set(held):
        b.refs = held.count(b) + draw(st.integers(0, 1) if draw(st.booleans()) else st.just(0))
    named = draw(st.lists(st.sampled_from(held), max_size=3)) if held else []
    return tables, named


@settings(max_examples=500, deadline=None)
@given(scenes())
def test_the_same_blocks_as_the_fixed_point(scene):
    tables, named = scene
    out = computed_on(tables, named)
    assert len(out) == len(set(out))
    assert out[:len(set(named))] == list(dict.fromkeys(named))
    assert set(out) == fixed_point(tables, named)


def test_a_holder_listed_before_the_request_that_brought_the_block_is_found():
    # e (listed first) hit c's block 2, c hit b's block 1, b holds the failed block 0
    blocks = [Block(i) for i in range(8)]
    b0, b1, b2, c2, c3, e3, e4, x = blocks
    e = ([[x, b1, c2, e3, e4]], 5)
    c = ([[x, b1, c2, c3]], 4)
    b = ([[b0, b1, b2]], 3)
    for blk, n in ((x, 2), (b0, 1), (b1, 3), (b2, 1), (c2, 2), (c3, 1), (e3, 1), (e4, 1)):
        blk.refs = n
    assert set(computed_on([e, c, b], [b0])) == {b0, b1, b2, c2, c3, e3, e4}
    assert set(computed_on([e, c, b], [c3])) == {c3}  # (the last full one: nothing after)


def test_only_full_entries_go_or_make_later_ones_go():
    a0, a1, a2 = (Block(i) for i in range(3))
    a0.refs = a1.refs = a2.refs = 1
    assert computed_on([([[a0, a1, a2]], 2)], [a0]) == [a0, a1]  # a2: partial
    assert computed_on([([[a0, a1, a2]], 2)], [a1]) == [a1]


def _blocks(refs):
    out = [Block(i) for i in range(len(refs))]
    for b, n in zip(out, refs, strict=True):
        b.refs = n
    return out


def test_every_other_holder_of_a_joined_block_is_found():
    # X1 (q's, computed on q's failed block 0) is held by r and s too: both lose what
    # follows it (the search stops only once both are found)
    q0, x1, q2, r0, r2, s0, s2 = _blocks([1, 3, 1, 1, 1, 1, 1])
    tables = [([[q0, x1, q2]], 3), ([[r0, x1, r2]], 3), ([[s0, x1, s2]], 3)]
    assert set(computed_on(tables, [q0])) == {q0, x1, q2, r2, s2}


def test_a_request_found_again_further_back_loses_its_other_rows_entries_there_too():
    # r first goes from index 2 (its named block r2, in row 0); then X1 (q's, at index 1)
    # makes it go from index 1: its row 1 entry at index 2 (RN2) joins as well
    q0, x1, q2, qq0, y1, qq2, r0, r2, r3, rr0, rr1, rn2, rr3 = _blocks([1, 2] + [1] * 11)
    q = ([[q0, x1, q2], [qq0, y1, qq2]], 3)
    r = ([[r0, x1, r2, r3], [rr0, rr1, rn2, rr3]], 4)
    out = computed_on([q, r], [q0, r2])
    assert set(out) == {q0, r2, x1, q2, y1, qq2, r3, rr3, rn2}
