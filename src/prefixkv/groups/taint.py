"""Which KV a rewound request recomputes from a context it lost, and so must never cache.

A recompute from ``p`` (after ``HybridKVCacheManager.rewind``) reads, in each group, the
keys that a query at ``p`` reads: a window's entries released before the rewind are
gone (vLLM's null block), and a Mamba group needs the state after position ``p - 1``.
When one of them is lost, the KV written from ``p`` on is computed from a wrong context,
in every group (a layer's output feeds the next layer's keys), and in every later
position (a full-attention query reads them all):

    | sound: cached as usual | tainted: recomputed over lost KV, never cached  |
    0                    tainted_from                                   (the request's end)

The request keeps running (vLLM's scheduler recomputes there as well); what it computes
is never made findable, so no other request hits it. Another live request that shares a
block the recompute rewrites holds that KV too: it is tainted from the first position
rewritten there, and its cached blocks from there on are made unfindable (their KV was
computed over what the rewind declared invalid). So too when a tainted request is rewound
and recomputes again: it reads its own lost KV (from ``tainted_from`` on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .request import GroupRequest
from .spec import GroupSpec


def reads_lost(specs: Sequence[GroupSpec], req: GroupRequest, p: int, sizes: Sequence[int]) -> bool:
    """Whether a recompute of ``req`` from ``p`` reads KV its tables no longer hold: a
    window's released entry that a query at ``p`` reads, an uncached window's position
    below those it holds since admission (``sound_from``), or a Mamba state other than
    the one after ``p - 1`` (held where the last step ended, ``num_scheduled``, and
    where a step ended on a block's end and its block was recorded: a state block keeps
    the state where its last step ended). ``sizes``: each group's block size."""
    for g, (spec, block_size) in enumerate(zip(specs, sizes, strict=True)):
        if spec.sparse:
            if 0 < p < req.num_scheduled and (
                    p % block_size or (b := req.tables[g][p // block_size - 1]) is None
                    or b.key is None):
                return True
        elif req.cut[g] > spec.num_unread(p, block_size) or (
                req.sound_from is not None and spec.first_needed(p) < req.sound_from[g]):
            return True
    return False


def taint(req: GroupRequest, p: int) -> None:
    """Mark ``req``'s KV from ``p`` on as computed from a lost context."""
    if req.tainted_from is None or p < req.tainted_from:
        req.tainted_from = p


def sharers(req: GroupRequest, p: int, live: Iterable[GroupRequest], block_size: int
            ) -> list[tuple[GroupRequest, int]]:
    """The other live requests holding one of ``req``'s blocks that a recompute of it
    from ``p`` rewrites, each with the first position it rewrites there (a shared block
    sits at the same index in both tables: it holds the same prefix)."""
    first = p // block_size
    rewritten = {id(b) for t in req.tables for b in t[first:] if b is not None and b.ref_cnt > 1}
    out = []
    if rewritten:
        for other in live:
            if other is not req:
                js = [j for t in other.tables for j, b in enumerate(t)
                      if j >= first and b is not None and id(b) in rewritten]
                if js:
                    out.append((other, max(p, min(js) * block_size)))
    return out
