"""``core.keyless``: the spans of an eviction's list that are pending runs' blocks, and
the content read from the run's record for each position."""

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
    blocks = [Block(i) for i in range(9)]
    for i, b in enumerate(blocks):
        b.content_id = 1000 + i           # (stale in the spans: never read there)
    assert ks.content_ids(blocks, 0) == [1000, 20, 21, 22, 23, 1005, 23, 22, 1008]
    assert ks.content_ids(blocks, 3) == [22, 23, 1005, 23, 22, 1008]
    assert ks.content_ids(blocks, 7) == [22, 1008]
    assert ks.content_ids(blocks, 8) == [1008]


def test_new_keyless_is_an_empty_record_of_its_own():
    """``new_keyless()`` (the eviction's, without the class call) is ``Keyless()``: no
    spans, a list of its own each time."""
    a, b = new_keyless(), new_keyless()
    assert type(a) is Keyless and a.spans == [] == Keyless().spans
    a.add(0, run_of(2), 0, 1, 2)
    assert len(a.spans) == 1 and b.spans == []
