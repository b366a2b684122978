"""How a hybrid manager's request grows: the mechanism under decode.py's calls
(functions ``HybridKVCacheManager``'s body lists, ``self`` the manager).

    | released (null) | held: hits, computed, scheduled | new (this call) | reserved |
    0            cut[g] * bs                      num_scheduled            total   num_reserved

A step that starts at ``s`` first releases, in each windowed group, the leading blocks no
query at or after ``s`` reads (``_going``, ``_release``: the order is
``release_order``'s); blocks it releases count as free for the step's own allocation.
Then every group's table is made to cover the step (``_take``: new entries, a sparse
group's empty but the last; ``_fill``: a sparse group's empty entry where the step ends)
and the blocks it fills are recorded (``_prepare`` / ``_record``, parts.py). ``_roomy``
tells the one-token steps that need none of this (they only append).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.block import Block, blocks_for
from ..errors import ConfigError, RequestError
from ..index.announce import Prepared
from .release_order import release_order
from .request import GroupRequest

Growth = tuple[tuple[int, ...], ...]
"""Block ids added, one tuple per group, in group order."""

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def _release(self: HybridKVCacheManager, req: GroupRequest, going: list[list[Block | None]] | None) -> None:
    if going is not None:
        for g, part in enumerate(going):
            self._released[g] += sum(b is not None for b in part)
        self._pool.free_groups(self._release_order(req, going), going)
        req.plan_release(self.groups, self._group_sizes)


def _release_order(self: HybridKVCacheManager, req: GroupRequest,
                   going: list[list[Block | None]]) -> list[Block]:
    """``GroupRequest.release(going)``, the blocks in the order to release them
    (``release_order``)."""
    return release_order(self.groups, self.block_size, req, going, self._index.finds)


def _going(self: HybridKVCacheManager,
           req: GroupRequest, start: int) -> tuple[list[list[Block | None]] | None, int]:
    """The blocks each group releases when a step starts at ``start`` (None when none
    does), and how many of them return to the pool (held by no other)."""
    if req.release_bound is not None:
        start = min(start, req.release_bound)
    if start < req.next_release:
        return None, 0
    going = [t[c:spec.num_released(start, b)] for spec, t, c, b in
             zip(self.groups, req.tables, req.cut, self._group_sizes, strict=True)]
    return going, sum(b is not None and b.ref_cnt == 1 for part in going for b in part)


def _roomy(self: HybridKVCacheManager, req: GroupRequest) -> bool:
    """Whether one more token at ``num_scheduled`` lands in a block the tables have
    (a sparse group's included: its state goes there), fills no block and moves no
    window past a block (it then only appends)."""
    n, bs = req.num_scheduled, self.block_size
    return n % bs != bs - 1 and n < req.next_release and (
        n % bs != 0 or n < len(req.tables[0]) * bs) and (
        not self._sparse or all(req.tables[g][n // bs] is not None for g in self._sparse))


def _prepare_fills(self: HybridKVCacheManager,
                   reqs: list[GroupRequest], new: Sequence[int]) -> dict[int, Prepared]:
    """What the blocks filled by this step need (chunks, extras, hashes), computed
    before any change: a ``hash_mode`` callable may fail, and the step must then
    change nothing."""
    bs = self._hash_size  # (a step fills a prefix id's block)
    out: dict[int, Prepared] = {}
    for req, t in zip(reqs, new, strict=True):
        n = req.num_scheduled
        if n % bs == bs - 1:
            req.tokens.append(t)
            try:
                out[id(req)] = self._prepare(req, n // bs, n // bs + 1,
                                             req.nodes[-1] if req.nodes else None)
            finally:
                del req.tokens[n:]
    return out


def _grow(self: HybridKVCacheManager, req: GroupRequest, total: int, new_tokens: Sequence[int] | None,
          prepared: Prepared | None = None) -> Growth | None:
    """Release what the step starting at ``num_scheduled`` no longer reads, append
    ``new_tokens`` and cover ``[0, total)`` in every group; None on shortage (nothing
    changed). ``prepared``: the full blocks' data when the caller computed it."""
    bs, start = self.block_size, req.num_scheduled
    going, freed = self._going(req, start)
    per_group = blocks_for(total, bs) - len(req.tables[0]) + self._ahead0
    holes = self._holes(req, total) if per_group <= 0 else []
    if self._num_fresh(per_group) + len(holes) > self._pool.num_free + freed:
        return None
    n, first, last = len(req.tokens), start // bs, total // bs
    if new_tokens is not None:
        req.tokens.extend(new_tokens)
    if prepared is None and first < last:
        try:
            prepared = self._prepare(req, first, last, req.nodes[-1] if req.nodes else None,
                                     req.prompt)
        except (ConfigError, RequestError):  # (RequestError: lookahead.check_keyed)
            del req.tokens[n:]
            raise
    self._release(req, going)
    added = self._take(req, per_group) if per_group > 0 else self._fill(req, total, holes)
    req.num_scheduled = total
    req.step_start = max(start, req.step_start)  # (after a rewind: what was released stays)
    if req.prompt is not None and total >= n:  # the prefill's last chunk
        req.prompt = None
    if prepared is not None:
        self._record(req, first, prepared)
    return added


def _holes(self: HybridKVCacheManager, req: GroupRequest, total: int) -> list[int]:
    """The sparse groups whose entry where a step ending at ``total`` writes its state
    is empty (reserved slots the step stops short of, or a recompute after a
    ``rewind``): each takes a block there."""
    j = blocks_for(total, self.block_size) - 1
    return [g for g, s in enumerate(self.groups) if s.sparse and req.tables[g][j] is None]


def _fill(self: HybridKVCacheManager, req: GroupRequest, total: int, holes: list[int]) -> Growth:
    """A free block into each of ``holes`` (the caller checked they are there)."""
    if not holes:
        return self._nothing
    j, fresh = blocks_for(total, self.block_size) - 1, self._pool.take(len(holes))
    added: list[tuple[int, ...]] = [()] * len(self.groups)
    for g, b in zip(holes, fresh, strict=True):
        self._index.own(g, [b])
        req.tables[g][j] = b
        added[g] = (b.block_id,)
    return tuple(added)


def _take(self: HybridKVCacheManager, req: GroupRequest, per_group: int) -> Growth:
    """Append ``per_group`` entries to each group's table, free blocks but for a
    sparse group's jumped-over ones (the caller checked the blocks are there); the
    ids of the blocks, per group."""
    fresh = self._pool.take(self._num_fresh(per_group))
    added = []
    for g, table in enumerate(req.tables):
        n = min(per_group, 1) if self.groups[g].sparse else per_group
        new, fresh = fresh[:n], fresh[n:]
        self._index.own(g, new)
        table += [None] * (per_group - n) + new  # type: ignore[operator]
        added.append(tuple([b.block_id for b in new]))
    return tuple(added)
