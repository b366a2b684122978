"""The order a finished hybrid request's blocks join the free queue (groups/free_order.py),
against brute force: after any number of evictions from the batch, every hit of the
request's prefix that vLLM's order (group by group, each tail first) leaves alive is alive,
no block of use goes before one of no use, and the blocks of use keep vLLM's order."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.core.block import Block
from prefixkv.core.request import RequestKeys
from prefixkv.groups import chunked_local, full_attention, mamba, sliding_window
from prefixkv.groups.free_order import free_order
from prefixkv.groups.request import GroupRequest

BS = 4
SPECS = [full_attention(), sliding_window(3), sliding_window(6), sliding_window(13), chunked_local(8),
         chunked_local(12), mamba()]


def _need(spec, h, k):
    """Blocks of the prefix (below k) that a hit of h blocks needs in a group of ``spec``."""
    first = spec.num_unread(h * BS, BS) if spec.releases else 0
    return range(first, min(h, k))


def _alive(specs, k, cached, longer, gone):
    """The hits (1 .. far past k) alive when the blocks at ``gone`` ((g, j)) are evicted."""
    out = set()
    for h in range(1, k + 40):
        if h > k and not longer:
            break
        if all(cached[g][j] and (g, j) not in gone for g, s in enumerate(specs) for j in _need(s, h, k)):
            out.add(h)
    return out


@st.composite
def batches(draw):
    specs = draw(st.lists(st.sampled_from(SPECS), min_size=2, max_size=3))
    k = draw(st.integers(0, 9))
    extra = draw(st.integers(0, 2))  # partial or reserved blocks past the prefix
    ids = iter(range(1, 1000))
    tables, cached, where = [], [], {}
    for g, s in enumerate(specs):
        cut = draw(st.integers(0, k)) if s.releases else 0
        row: list[Block | None] = [None] * cut
        found = []
        for j in range(k + extra):
            if j < cut or (s.sparse and draw(st.booleans())):
                if j < k:
                    found.append(draw(st.booleans()))  # (cached elsewhere, or not)
                if j >= cut:
                    row.append(None)
                continue
            b = Block(next(ids), refs=draw(st.sampled_from([1, 1, 1, 2])))
            content = j < k and draw(st.integers(0, 5)) > 0
            b.key = ("content", g, j) if content else None
            row.append(b)
            if j < k:
                found.append(content or draw(st.booleans()))
            where[id(b)] = (g, j)
        tables.append(row)
        cached.append(found)
    req = GroupRequest("r", array("q"), RequestKeys.of(None, 0, BS), len(specs))
    req.tables = tables
    req.nodes = [object()] * k  # (only their count is read)
    return specs, req, cached, draw(st.booleans()), where


@settings(max_examples=300, deadline=None)
@given(batch=batches())
def test_the_free_order_keeps_every_hit_vllms_order_keeps_after_each_eviction(batch):
    specs, req, cached, longer, where = batch
    k = len(req.nodes)
    out = free_order(specs, BS, req, lambda g, j: cached[g][j], longer)
    vllm = [b for t in req.tables for b in reversed(t) if b is not None]
    assert sorted(b.block_id for b in out) == sorted(b.block_id for b in vllm)

    def joins(b):
        g, j = where[id(b)]
        return j < k and b.ref_cnt == 1 and b.key is not None

    def evicted(order, n):
        return {where[id(b)] for b in order[:n] if joins(b)}

    of_use_placed = []
    for n in range(len(out) + 1):
        mine = _alive(specs, k, cached, longer, evicted(out, n))
        assert mine >= _alive(specs, k, cached, longer, evicted(vllm, n)), n
        if n == len(out) or not joins(out[n]):
            continue
        # placing a block of use: every block of no use went before it
        g, j = where[id(out[n])]
        use = {h for h in mine if j in _need(specs[g], h, k)}
        if use:
            of_use_placed.append(out[n])
            for b in out[n + 1:]:
                if joins(b):
                    g2, j2 = where[id(b)]
                    assert any(j2 in _need(specs[g2], h, k) for h in mine), (b, n)
    # the blocks placed while of use come in vLLM's order
    rank = {id(b): i for i, b in enumerate(vllm)}
    assert [rank[id(b)] for b in of_use_placed] == sorted(rank[id(b)] for b in of_use_placed)
