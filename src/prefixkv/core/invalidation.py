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


def uncache_blocks(m: KVCacheManager, block_ids: Iterable[int]) -> None:
    """``KVCacheManager.uncache_blocks``: checks the ids, then empties the held blocks and
    what live requests computed on them."""
    blocks = m._pool.blocks
    ids = check_block_ids(block_ids, len(blocks))
    held = [blocks[i] for i in ids if blocks[i].ref_cnt > 0]
    if held:  # (and the blocks live requests computed on top of them)
        bs = m.block_size
        # (the holds of pending copies and store fetches: no request to look for)
        outside = m._copies.pins + (m._waits.holds() if m._waits is not None else [])
        held = computed_on((((r.blocks,), r.num_scheduled // bs)
                            for r in m._requests.values()), held, outside)
    landing = getattr(m._index, "landing", None)
    if landing:  # (blocks a store fetch fills: no findable content yet, as a free block)
        apart = {id(b) for run in landing.values() for b in run}
        held = [b for b in held if id(b) not in apart]
    m._drop_puts(held)  # (the store's pending writes: before the index forgets)
    m._pool.emptied(m._index.uncache(held, cut=True))
    if m._waits is not None and m._waits.holders:  # (a store fetch's holds on
        give_up(m._waits, held, True)  # them, and on what lost its content with them)


def rewind(m: KVCacheManager, request_id: Hashable, num_tokens: int) -> None:
    """``KVCacheManager.rewind``: every check before the first change."""
    req = m._get(request_id)
    check_count("num_tokens", num_tokens, 0, req.num_scheduled)
    full = num_tokens // m.block_size
    tail = req.blocks[full:req.num_scheduled // m.block_size]
    waits = m._waits
    shared = [b.block_id for b in held_by_others(waits, tail)]  # (a store fetch's hold
    if shared:  # is given up: ``store_giveup.py``)
        raise RequestError(f"request {request_id!r} cannot rewind to {num_tokens}: blocks "
                           f"{shared} are held by other requests too")
    if waits is not None and waits.holders:  # (before ``uncache``: the request's alone,
        give_up(waits, tail, False)  # they lose their content, never kept as spares)
    m._drop_puts(tail)  # (before the index forgets)
    m._pool.emptied(m._index.uncache(tail, cut=True))  # (and their cached children)
    if req.num_scheduled == len(req.tokens) > num_tokens:
        m._num_prefilling += 1
    req.num_reserved = max(req.num_reserved, req.num_scheduled)
    req.num_scheduled = num_tokens
    req.num_cached = min(req.num_cached, full * m.block_size)
