"""A step's release in rounds (``release_order.in_rounds``): several copies of one sliding
window releasing the same blocks, each freeing its content, with every hit that reads one
of them alive, take the cascade's order without running it. Against the cascade on the
whole tables (``free_order_reference.release_order_whole``), on steps made to meet the
conditions or to miss one of them by a little: another window, another cut or count, a
block held twice or without content, a block a hit needs not found."""

from __future__ import annotations

import random
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from free_order_reference import release_order_whole
from prefixkv.core.block import Block
from prefixkv.core.request import RequestKeys
from prefixkv.groups import full_attention, sliding_window
from prefixkv.groups.release_order import in_rounds, release_order
from prefixkv.groups.request import GroupRequest

BS = 4
FLAWS = ("spec", "cut", "count", "shared", "empty", "missed")


def _step(rng: random.Random, k: int, windows: int, tokens: int, flaw: str | None,
          c: int | None = None, n: int | None = None):
    """Full attention and ``windows`` sliding windows of ``tokens``; each window releases
    blocks c .. c+n-1 (its cut c; random unless given), but where ``flaw`` says; what
    each group finds."""
    specs = [full_attention()] + [sliding_window(tokens)] * windows
    if flaw == "spec":
        specs[-1] = sliding_window(tokens + BS)
    c = rng.randint(0, k - 2) if c is None else c
    n = rng.randint(2, k - c) if n is None else n
    ids = iter(range(1, 10**6))
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), len(specs))
    going, found = [], []
    for g, s in enumerate(specs):
        cut = 0 if not s.releases else c + (flaw == "cut" and g == windows and c + n < k)
        m = 0 if not s.releases else n - (flaw == "count" and g == windows)
        row: list[Block | None] = [None] * cut
        for j in range(cut, k + 1):
            b = Block(next(ids), refs=1)
            b.key = ("content", g, j) if j < k else None
            row.append(b)
        req.tables[g], req.cut[g] = row, cut
        going.append(row[cut:cut + m])
        found.append([j >= cut or rng.random() < 0.95 for j in range(k)])
    g, j = rng.randint(1, windows), rng.randint(0, n - 1)
    if flaw == "shared":
        going[g][min(j, len(going[g]) - 1)].refs = 2
    elif flaw == "empty":
        going[g][min(j, len(going[g]) - 1)].key = None
    elif flaw == "missed":
        found[g][rng.randint(max(0, c - 4), k - 1)] = False
    req.nodes = list(range(k))
    return specs, req, going, found


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(2, 40), windows=st.integers(2, 5),
       tokens=st.sampled_from([6, 8, 13, 16]), flaw=st.none() | st.sampled_from(FLAWS))
def test_the_order_in_rounds_is_the_cascades(seed, k, windows, tokens, flaw):
    rng = random.Random(seed)
    state = rng.getstate()
    outs = []
    for fn in (release_order, release_order_whole):
        rng.setstate(state)
        specs, req, going, found = _step(rng, k, windows, tokens, flaw)
        outs.append([b.block_id for b in fn(specs, BS, req, going,
                                            lambda g, nodes, f=found: (f[g][j] for j in nodes))])
    assert outs[0] == outs[1]


def test_a_clean_step_is_taken_in_rounds_and_a_missed_block_is_not():
    # five windows of 16 tokens (a hit of h blocks reads blocks h-4 .. h-1) release
    # blocks 10..13 of a 30-block prefix: round by round from block 13
    specs, req, going, found = _step(random.Random(0), 30, 5, 16, None, 10, 4)
    n = 4
    windows = [1, 2, 3, 4, 5]
    finds = lambda g, nodes: (found[g][j] for j in nodes)  # noqa: E731
    for g in windows:  # (every block a hit reading c .. c+n-1 needs: found)
        found[g][:] = [True] * 30
    got = in_rounds(specs, BS, req, going, windows, finds)
    assert got == [going[g][j] for j in range(n - 1, -1, -1) for g in windows]
    found[3][9] = False  # (read by the hits at 11 .. 13, alive no more)
    assert in_rounds(specs, BS, req, going, windows, finds) is None
    found[3][9] = True
    found[3][17] = False  # (read by the hits at 18 .. 21, which read no released block)
    assert in_rounds(specs, BS, req, going, windows, finds) == got
    found[3][17] = True
    found[3][16] = False  # (read by the hit at 17, which reads block 13)
    assert in_rounds(specs, BS, req, going, windows, finds) is None
    found[3][16] = True
    found[3][6] = False  # (read by the hits at 7 .. 10, which read no released block)
    assert in_rounds(specs, BS, req, going, windows, finds) == got
