"""``core.dependents.computed_on``, against the plain fixed point it replaces (every pass
over every entry of every request, until nothing joins): the same blocks, ``blocks``
first, each once, whatever the order of the requests, the rows (groups) per request,
the released entries (None) and the holds no request makes (all, some or none of them
told as ``outside``)."""

from __future__ import annotations

from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.core import dependents
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
    outside = []  # (the holds no request makes: some of them told to computed_on)
    for b in set(held):
        extra = draw(st.integers(0, 2) if draw(st.booleans()) else st.just(0))
        b.refs = held.count(b) + extra
        told = draw(st.integers(0, extra))
        outside += [b] * told
    named = draw(st.lists(st.sampled_from(held), max_size=3)) if held else []
    return tables, named, draw(st.permutations(outside))


@settings(max_examples=500, deadline=None)
@given(scenes(), st.sampled_from([64, 0, 2]))
def test_the_same_blocks_as_the_fixed_point(scene, scan):
    # (scan: the requests a search looks at one by one before it reads the others'
    # entries at C speed; 64, the module's, is more than any scene has)
    tables, named, outside = scene
    with patch.object(dependents, "SCAN", scan):
        out = computed_on(tables, named, outside)
    assert len(out) == len(set(out))
    assert out[:len(set(named))] == list(dict.fromkeys(named))
    assert set(out) == fixed_point(tables, named)


@st.composite
def hit_chains(draw):
    """Requests that hit others' blocks: each takes a leading run of an earlier one's
    entries (in every row) and computes its own after it, so chains of hits form; the
    list shuffled (a hitter may come before the request it hit: preemption), some holds
    made by no request, some told."""
    num_rows = draw(st.integers(1, 2))
    ids = iter(range(10**6))
    tables = []
    for _ in range(draw(st.integers(1, 24))):
        length = draw(st.integers(1, 10))
        rows = [[] for _ in range(num_rows)]
        if tables and draw(st.booleans()):
            src_rows, src_n = draw(st.sampled_from(tables))
            m = draw(st.integers(1, max(1, min(length, src_n))))
            rows = [list(r[:m]) for r in src_rows]
        for r in range(num_rows):
            rows[r] += [Block(next(ids)) for _ in range(length - len(rows[r]))]
        tables.append((rows, draw(st.integers(1, length))))
    tables = draw(st.permutations(tables))
    held = [b for rows, _ in tables for row in rows for b in row]
    outside = []
    for b in dict.fromkeys(held):
        extra = draw(st.integers(0, 1))
        b.refs = held.count(b) + extra
        outside += [b] * draw(st.integers(0, extra))
    named = draw(st.lists(st.sampled_from(held), min_size=1, max_size=2))
    return tables, named, outside


@settings(max_examples=300, deadline=None)
@given(hit_chains(), st.sampled_from([64, 0, 1, 3]))
def test_chains_of_hits_give_the_fixed_points_blocks(scene, scan):
    tables, named, outside = scene
    with patch.object(dependents, "SCAN", scan):
        out = computed_on(tables, named, outside)
    assert len(out) == len(set(out)) and set(out) == fixed_point(tables, named)


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


class _Watched(list):
    """A row that records whether the search looked at it."""

    seen = False

    def __iter__(self):
        self.seen = True
        return super().__iter__()

    def __getitem__(self, i):
        self.seen = True
        return super().__getitem__(i)


def _scene(num_requests, width):
    """Requests of ``width`` full blocks each, none shared, every row watched."""
    return [([_Watched(_blocks([1] * width))], width) for _ in range(num_requests)]


def test_a_hold_told_outside_is_not_looked_for_in_the_other_requests():
    # the last request's block 1 is held by a store fetch too: once that hold is told,
    # the search stops at the request (before, it passed every other one, looking for
    # a holder that is no request)
    tables = _scene(50, 4)
    last = tables[-1][0][0]
    last[1].refs = 2
    out = computed_on(tables, [last[1]], [last[1]])
    assert out == [last[1], last[2], last[3]]
    assert not any(rows[0].seen for rows, _ in tables[:-1])
    for rows, _ in tables:
        rows[0].seen = False
    assert computed_on(tables, [last[1]]) == out  # (not told: found the same, passing all)
    assert all(rows[0].seen for rows, _ in tables[:-1])


def test_once_placed_a_named_block_is_looked_for_at_its_index_alone():
    # b's block 2 is held by the first request too (a hit): the pass back to it looks at
    # index 2 of each request between, not at their whole rows
    tables = _scene(30, 64)
    b = tables[-1][0][0]
    first = tables[0][0][0]
    first[2] = b[2]
    first[2].refs = 2
    looked = []

    class Row(list):  # (records how many entries each look takes in)
        def __iter__(self):
            looked.append(len(self))
            return super().__iter__()

        def __getitem__(self, i):
            looked.append(len(range(*i.indices(len(self)))) if isinstance(i, slice) else 1)
            return super().__getitem__(i)

    middle = [([Row(rows[0])], n) for rows, n in tables[1:-1]]
    out = computed_on([tables[0], *middle, tables[-1]], [b[2]])
    assert set(out) == {b[2], *b[3:], *first[3:]}
    assert looked and max(looked) == 1  # (each middle row: its entry 2 alone)
