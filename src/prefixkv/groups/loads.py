"""Where a sparse (Mamba) group's blocks go at an admission with a load: tokens after
the hit whose KV an outside source writes (``add_request``'s ``num_external_tokens``,
a connector's load). Functions of plain ints, used by both admissions (admission.py,
sized_admission.py).

A Mamba group keeps one state per block, the state after the block's last token, in the
block where a step ends (``GroupSpec.sparse``). A load ends at ``first`` (the request's
first query): the source writes the state after ``first`` tokens, so the group takes
the block holding position ``first - 1`` (vLLM 0.33's ``MambaManager`` takes the same
one: ``allocate_external_computed_blocks`` with its ``get_num_skipped_tokens``), and
none of the hit's (no query reads them: ``GroupSpec.admitted_cut``). The step computes
on from there and takes the block where it ends too, when another. A load whose tokens
land later (vLLM's ``delay_cache_blocks``: the caller schedules fewer tokens than it
loads) has no step of its own: its block is the only one taken.

    | hit | load ............| step |
                         ^ first - 1: the load's state block     ^ total - 1: the step's

vLLM takes the load's blocks first, group after group, then the step's
(``allocate_new_computed_blocks`` before ``allocate_new_blocks``): ``in_order`` deals the
fresh blocks so, for the same block ids.

The state block of the load holds the state at its end when ``first`` ends it: it is
marked as such (``mark``; recorded with the other full blocks once scheduled: the
sized ``_record`` and the one-size one read ``GroupRequest.states``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for

if TYPE_CHECKING:
    from .request import GroupRequest

__all__ = ["count", "in_order", "loaded", "mark", "places", "row"]


def places(block_size: int, hit: int, first: int, total: int) -> tuple[int, ...]:
    """The entries (block indices at ``block_size``) a sparse group fills at an
    admission whose hit ends at ``hit``, first query at ``first`` (past ``hit``: a
    load) and step at ``total`` (below ``first``: the load lands later), in order."""
    end = blocks_for(max(total, first), block_size) - 1
    if first == hit:
        return (end,)
    load = blocks_for(first, block_size) - 1
    return (load,) if load == end else (load, end)


def count(where: tuple[int, ...], start: int) -> int:
    """How many of ``where`` (``places``) are new entries (at ``start`` or past)."""
    return sum(j >= start for j in where)


def row(where: tuple[int, ...], start: int, length: int, new: Sequence[Block | None]) -> list[Block | None]:
    """A sparse group's ``length`` new entries from ``start``: ``new`` (``count``
    blocks) at ``where``, in order, None elsewhere."""
    out: list[Block | None] = [None] * length
    for j, b in zip([j for j in where if j >= start], new, strict=True):
        out[j - start] = b
    return out


def mark(sparse: Sequence[int], sizes: Sequence[int], req: GroupRequest, first: int) -> None:
    """A load ends at ``first``: each sparse group's block ending there holds the state
    at its end (``GroupRequest.states``; a step past it, to ``total``, computes on in
    later blocks)."""
    for g in sparse:
        b = sizes[g]
        if first % b == 0:
            if req.states is None:
                req.states = set()
            req.states.add((g, first // b - 1))


def in_order(fresh: list[Block], taken: Sequence[int], below: Sequence[int]) -> list[Block]:
    """``fresh`` (``sum(taken)`` blocks) dealt as vLLM takes them at a load: each
    group's first ``below[g]`` blocks (those of the load: ``loaded``), group after
    group, then the rest, group after group. Returns them in group order, as the
    admission hands them out (``taken[g]`` per group)."""
    it = iter(fresh)
    heads = [[next(it) for _ in range(n)] for n in below]
    return [b for h, t, n in zip(heads, taken, below, strict=True)
            for b in h + [next(it) for _ in range(t - n)]]


def loaded(taken: int, start: int, end: int, where: tuple[int, ...] | None) -> int:
    """How many of a group's ``taken`` new blocks (entries from ``start``) vLLM takes
    for a load ending in entry ``end - 1`` (``allocate_external_computed_blocks``):
    those below ``end``; a sparse group's (``where``: its ``places``), the first of
    ``where`` when new (else its new blocks are the step's: a copy on write of the
    hit's block, where the load ends inside it, included)."""
    if where is None:
        return min(taken, max(0, end - start))
    return min(taken, count(where[:1], start))
