"""The order a step's released window blocks join the free queue (groups/release_order.py),
against brute force: after any number of evictions from the batch, every hit of the
request's prefix that vLLM's order (group by group, each group's last block first) leaves
alive is alive, whatever the groups find (full attention's misses included, which the
order does not look at)."""

from __future__ import annotations

import random
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from free_order_reference import release_order_whole
from prefixkv.core.block import Block
from prefixkv.core.request import RequestKeys
from prefixkv.groups import full_attention, sliding_window
from prefixkv.groups.release_order import release_order
from prefixkv.groups.request import GroupRequest
from test_groups_free_order import BS, SPECS, _alive


def _step(rng, specs, k):
    """A request of k full blocks whose step releases, in each windowed group, the next
    blocks after its cut; what every group finds of the prefix."""
    ids = iter(range(1, 10**6))
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), len(specs))
    going, cached, where = [], [], {}
    for g, s in enumerate(specs):
        cut = rng.randint(0, k) if s.releases else 0
        n = rng.randint(0, k - cut) if s.releases else 0
        row, part = [None] * cut, []
        found = [rng.random() < 0.7 for _ in range(cut)]
        for j in range(cut, k + 1):
            if s.sparse and cut + n > j > cut and rng.random() < 0.4:
                b = None
            else:
                b = Block(next(ids), refs=2 if rng.random() < 0.1 else 1)
                b.key = ("content", g, j) if j < k and rng.random() < 0.9 else None
                where[id(b)] = (g, j)
            row.append(b)
            if j < k:
                keyed = b is not None and b.key is not None
                found.append(keyed if rng.random() < 0.9 else rng.random() < 0.5)
            if j < cut + n:
                part.append(b)
        req.tables[g], req.cut[g] = row, cut
        going.append(part)
        cached.append(found)
    req.nodes = list(range(k))
    return req, going, cached, where


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 14), size=st.integers(2, 4))
def test_a_steps_release_order_keeps_every_hit_vllms_order_keeps_after_each_eviction(seed, k, size):
    rng = random.Random(seed)
    specs = [rng.choice(SPECS) for _ in range(size)]
    req, going, cached, where = _step(rng, specs, k)
    vllm = [b for part in going for b in reversed(part) if b is not None]
    batch = {id(b) for b in vllm}
    out = release_order(specs, BS, req, going, lambda g, nodes: (cached[g][j] for j in nodes))
    assert sorted(b.block_id for b in out) == sorted(b.block_id for b in vllm)
    assert all(t[j] is None for t, c in zip(req.tables, req.cut, strict=True) for j in range(c))

    def evicted(order, n):
        return {where[id(b)] for b in order[:n]
                if id(b) in batch and b.ref_cnt == 1 and b.key is not None and where[id(b)][1] < k}

    for n in range(len(out) + 1):
        mine, theirs = (_alive(specs, k, cached, True, evicted(o, n)) for o in (out, vllm))
        assert mine >= theirs, n


def test_the_other_windows_block_follows_the_first_windows_before_its_next():
    # two windows of 8 beside full attention, block size 4 (a hit of h blocks reads
    # blocks h-2 and h-1 of each window): a step releases blocks 0..2 of both. vLLM
    # frees window A's 2 1 0, then B's 2 1 0; evicting three takes all of A's, and the
    # hits of 1 to 4 blocks are gone. Placing A's block 2 kills the hits at 3 and 4,
    # which alone read B's block 2: it goes next, and so on down (A2 B2 A1 B1 A0 B0);
    # three evicted leave the hit at 1. Before (vLLM's order): A2 A1 A0 B2 B1 B0
    specs = [full_attention(), sliding_window(8), sliding_window(8)]
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), 3)
    ids = iter(range(1, 100))
    for g in range(3):
        req.tables[g] = [Block(next(ids), refs=1) for _ in range(6)]
        for j, b in enumerate(req.tables[g]):
            b.key = ("content", g, j)
    req.nodes = list(range(6))
    going = [[], req.tables[1][:3], req.tables[2][:3]]
    names = {id(b): f"{'FAB'[g]}{j}" for g in range(3) for j, b in enumerate(req.tables[g])}
    out = release_order(specs, BS, req, going, lambda g, nodes: (True for _ in nodes))
    assert [names[id(b)] for b in out] == ["A2", "B2", "A1", "B1", "A0", "B0"]
    assert req.cut == [0, 3, 3] and req.tables[1][:3] == [None] * 3


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 64), size=st.integers(2, 4))
def test_the_view_without_the_blocks_below_the_cuts_gives_the_whole_tables_order(seed, k, size):
    # long requests beside short windows and chunks: the view leaves blocks out (shift)
    rng = random.Random(seed)
    specs = [rng.choice(SPECS) for _ in range(size)]
    state = rng.getstate()
    outs = []
    for fn in (release_order, release_order_whole):
        rng.setstate(state)
        req, going, cached, _ = _step(rng, specs, k)
        outs.append([b.block_id for b in fn(specs, BS, req, going,
                                            lambda g, nodes, c=cached: (c[g][j] for j in nodes))])
    assert outs[0] == outs[1]


def test_a_steps_view_holds_the_windows_reach_not_the_request(monkeypatch):
    # a 400-block request beside two windows of 8 tokens (a reach of 3 blocks): the view
    # the order is taken on spans a few blocks below the cuts, whatever the length
    # (before, each window's whole table: 400 entries)
    import prefixkv.groups.release_order as module
    specs = [full_attention(), sliding_window(8), sliding_window(8)]
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), 3)
    ids = iter(range(1, 10**4))
    for g in range(3):
        req.tables[g] = [Block(next(ids), refs=1) for _ in range(401)]
        for j, b in enumerate(req.tables[g]):
            b.key = ("content", g, j) if j < 400 else None
    req.nodes = list(range(400))
    for g in (1, 2):
        req.tables[g][:390] = [None] * 390
        req.cut[g] = 390
    going = [[], req.tables[1][390:393], req.tables[2][390:393]]
    seen = []
    real = module.free_order

    def spy(specs, bs, view, found, longer, *rest):
        seen.append((len(view.nodes), [len(t) for t in view.tables]))
        return real(specs, bs, view, found, longer, *rest)
    monkeypatch.setattr(module, "free_order", spy)
    # (block 389 is found by neither window: the hits at 390 and 391 that read it are
    # dead, so the order is not the one in rounds, ``in_rounds``, but the cascade's)
    order = release_order(specs, BS, req, going, lambda g, nodes: (j != 389 for j in nodes))
    assert sorted(b.block_id for b in order) == sorted(b.block_id for p in going for b in p)
    (k, lengths), = seen
    assert k <= 20 and max(lengths) <= 12
