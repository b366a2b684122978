"""Invalidation: the manager's ``uncache_blocks`` and ``rewind`` (KV that turned out
invalid: a failed load, a rejected draft). Both take content out of the index with every
block computed on top of it, drop the shared store's pending writes of it before the index
forgets, and make a store fetch holding it give it up (``store_giveup.py``). The public
contracts are on ``KVCacheManager``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from ..errors import RequestError, check_block_ids, check_count
from .dependents import computed_on
from .store_giveup import give_up, held_by_others

if TYPE_CHECKING:
    from .manager import KVCacheManager


def uncache_blocks(self: KVCacheManager, block_ids: Iterable[int]) -> None:
    """Make the content of these blocks unfindable (their KV turned out invalid, e.g.
    a load that failed) while live requests hold them; a block no request holds is
    left as it is. The shared store's pending writes of these blocks and of every
    block computed on top of them are dropped. A content that leaves the index so
    takes the cached blocks recorded under it along (and theirs: withdrawn, free ones
    empty), and blocks its request fills after it are not findable until ``rewind``
    recomputes them. Each live request holding one loses the content of its full
    blocks after it too (computed on top of it), also when another block keeps the
    named one's content findable (a spare), and so on for a request holding one of
    those. A store fetch holding one of these blocks, or one that lost its content
    with them (its device hits, or its landed run), gives it up, with every block
    after it in its chain (``rewind`` then finds them the request's alone); a fetch
    left with no valid hit before its run landed ends its request's wait (listed by
    the next ``poll_store``: it computes). Raises RequestError for an id outside
    the pool, or ``block_ids`` not an iterable (nothing changes)."""
    blocks = self._pool.blocks
    ids = check_block_ids(block_ids, len(blocks))
    held = [blocks[i] for i in ids if blocks[i].ref_cnt > 0]
    if held:  # (and the blocks live requests computed on top of them)
        bs = self.block_size
        # (the holds of pending copies and store fetches: no request to look for)
        outside = self._copies.pins + (self._waits.held.holds() if self._waits is not None else [])
        held = computed_on((((r.blocks,), r.num_scheduled // bs)
                            for r in self._requests.values()), held, outside)
    landing = getattr(self._index, "landing", None)
    if landing:  # (blocks a store fetch fills: no findable content yet, as a free block)
        apart = {id(b) for run in landing.values() for b in run}
        held = [b for b in held if id(b) not in apart]
    self._drop_puts(held)  # (the store's pending writes: before the index forgets)
    self._pool.emptied(self._index.uncache(held, cut=True))
    if self._waits is not None and self._waits.held.holders:  # (a store fetch's holds on
        give_up(self._waits, held, True)  # them, and on what lost its content with them)


def rewind(self: KVCacheManager, request_id: Hashable, num_tokens: int) -> None:
    """Take the request back to its first ``num_tokens`` scheduled tokens, to be
    recomputed (KV after them turned out invalid: ``uncache_blocks``; vLLM then sets
    its computed tokens back). Its tokens stay known: ``extend`` schedules them again
    in the step that recomputes them, and the full blocks they fill are cached anew
    (before, a block ``uncache_blocks`` emptied stayed unfindable while its request
    lived, recomputed or not). Its full blocks from ``num_tokens`` on lose their
    content and pending store writes, and stay in its table as reserved slots.
    Raises RequestError (unknown id, ``num_tokens`` outside ``[0,
    num_scheduled_tokens]``, or one of those blocks held by another request too,
    which must be freed or preempted first), before any change. A store fetch
    holding one of them (another request's device hits, or its run landed on the
    device) is no such request: it gives them up, as after ``uncache_blocks``."""
    req = self._get(request_id)
    check_count("num_tokens", num_tokens, 0, req.num_scheduled)
    full = num_tokens // self.block_size
    tail = req.blocks[full:req.num_scheduled // self.block_size]
    waits = self._waits
    shared = [b.block_id for b in held_by_others(waits, tail)]  # (a store fetch's hold
    if shared:  # is given up: ``store_giveup.py``)
        raise RequestError(f"request {request_id!r} cannot rewind to {num_tokens}: blocks "
                           f"{shared} are held by other requests too")
    if waits is not None and waits.held.holders:  # (before ``uncache``: the request's alone,
        give_up(waits, tail, False)  # they lose their content, never kept as spares)
    self._drop_puts(tail)  # (before the index forgets)
    self._pool.emptied(self._index.uncache(tail, cut=True))  # (and their cached children)
    if req.num_scheduled == len(req.tokens) > num_tokens:
        self._num_prefilling += 1
    req.num_reserved = max(req.num_reserved, req.num_scheduled)
    req.num_scheduled = num_tokens
    req.num_cached = min(req.num_cached, full * self.block_size)
