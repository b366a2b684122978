"""``core.keyless``: the spans of an eviction's list that are pending runs' blocks, and
the content read from the run's record for each position."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.core.block import Block
from prefixkv.core.keyless import Keyless, new_keyless
from prefixkv.core.run import RunCounts, new_run


def run_of(k, pcid=7, cid0=20, width=2):
    """A pending run of ``k`` blocks: the head's token bytes b"hh", block i's bytes
    ``bytes([i, i])``, extra b"x"."""
    blocks = [Block(100 + i) for i in range(k)]
    data = b"hh" + b"".join(bytes([i]) * width for i in range(k))
    run = new_run(blocks, data, b"x", 0, 0, RunCounts(), pcid)
    run.cid0 = cid0
    return run


def test_positions_read_the_runs_record_forward_backward_and_cut():
    r = run_of(4)
    ks = Keyless()
    ks.add(1, r, 0, 1, 4)                 # positions 1..4: the run forward
    ks.add(6, r, 3, -1, 2)                # positions 6, 7: its last two, last first
    assert ks.content(1) == (7, b"\0\0", b"x", 20)
    assert ks.content(2) == (20, b"\1\1", b"x", 21)
    assert ks.content(4) == (22, b"\3\3", b"x", 23)
    assert ks.content(6) == (22, b"\3\3", b"x", 23)
    assert ks.content(7) == (21, b"\2\2", b"x", 22)


def test_new_keyless_is_an_empty_record_of_its_own():
    """``new_keyless()`` (the eviction's, without the class call) is ``Keyless()``: no
    spans, a list of its own each time."""
    a, b = new_keyless(), new_keyless()
    assert type(a) is Keyless and a.spans == [] == Keyless().spans
    a.add(0, run_of(2), 0, 1, 2)
    assert len(a.spans) == 1 and b.spans == []


def among_per_block(ks, blocks, start, ids):
    """``Keyless.among`` as ``_withdraw_orphans`` read it before (block by block, a span's
    through ``content``): the reference."""
    spans = [(lo, hi) for lo, hi, *_ in ks.spans]
    out = []
    for i in range(start, len(blocks)):
        b = blocks[i]
        if any(lo <= i < hi for lo, hi in spans):
            content = ks.content(i)
        elif b.key is not None:
            content = (b.parent_cid, b.key if isinstance(b.key, bytes) else b.key[1],
                       b.extra, b.content_id)
        else:
            continue
        if content[3] in ids:
            out.append((i, content))
    return out


def test_among_finds_the_ids_positions_without_walking_a_span(monkeypatch):
    """Positions 1..4 run forward, 6..7 backward; 0, 5, 8 keyed (5 by its triple), 9 no
    key: each id names one position a span (ids 22 and 23 are in both), read from the
    record; ``content`` is not called (a span is not walked)."""
    r = run_of(4)
    ks = Keyless()
    ks.add(1, r, 0, 1, 4)
    ks.add(6, r, 3, -1, 2)
    blocks = [Block(i) for i in range(10)]
    for i, b in enumerate(blocks):
        b.content_id, b.parent_cid, b.key, b.extra = 1000 + i, 999 + i, bytes([i]), b""
    blocks[5].key = (1004, b"\5", b"")
    blocks[9].key = None
    calls = []
    monkeypatch.setattr(Keyless, "content", lambda self, i: calls.append(i))
    ids = {20, 23, 1005, 1008, 1009, 22, 77}
    assert sorted(ks.among(blocks, 0, ids)) == [
        (1, (7, b"\0\0", b"x", 20)), (3, (21, b"\2\2", b"x", 22)), (4, (22, b"\3\3", b"x", 23)),
        (5, (1004, b"\5", b"", 1005)),
        (6, (22, b"\3\3", b"x", 23)), (7, (21, b"\2\2", b"x", 22)), (8, (1007, b"\x08", b"", 1008))]
    assert sorted(ks.among(blocks, 7, ids)) == [(7, (21, b"\2\2", b"x", 22)),
                                                (8, (1007, b"\x08", b"", 1008))]
    assert ks.among(blocks, 2, {20, 21, 9999}) == [(2, (20, b"\1\1", b"x", 21))]
    assert ks.among(blocks, 2, {21}) == [(2, (20, b"\1\1", b"x", 21))]  # (fewer ids than
    assert ks.among(blocks, 7, {22}) == [(7, (21, b"\2\2", b"x", 22))]  # the span's blocks)
    assert calls == []


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_among_is_the_per_block_reading(data):
    """Random spans (forward or backward, cut anywhere in their run) between keyed and
    keyless blocks, any start and id set: ``among`` lists exactly what a per-block
    reading through ``content`` finds (positions and contents)."""
    draw = data.draw
    ks = Keyless()
    blocks: list[Block] = []
    cid = 500
    for _ in range(draw(st.integers(0, 4))):
        for _ in range(draw(st.integers(0, 3))):  # keyed (or keyless) blocks between spans
            b = Block(len(blocks))
            b.content_id, b.parent_cid, b.extra = cid, cid - 1, b"e"
            b.key = draw(st.sampled_from([bytes([cid % 256]), (cid - 1, b"t", b"e"), None]))
            blocks.append(b)
            cid += 1
        n = draw(st.integers(1, 6))
        r = run_of(n, pcid=cid, cid0=cid + 1)
        cid += n + 2
        k = draw(st.integers(1, n))
        fwd = draw(st.booleans())
        at = draw(st.integers(0, n - k)) if fwd else draw(st.integers(k - 1, n - 1))
        ks.add(len(blocks), r, at, 1 if fwd else -1, k)
        blocks += [Block(len(blocks) + j) for j in range(k)]
    start = draw(st.integers(0, len(blocks)))
    known = [b.content_id for b in blocks] + [c for *_, c in
                                             (ks.content(i) for lo, hi, *_ in ks.spans
                                              for i in range(lo, hi))]
    ids = draw(st.sets(st.sampled_from(known or [0]) | st.integers(495, cid + 3),
                           max_size=12))
    assert sorted(ks.among(blocks, start, ids)) == among_per_block(ks, blocks, start, ids)
